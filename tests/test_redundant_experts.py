"""Redundant experts outside the layer contract: the weight moves (`eplb.place`), replica
gradients (`eplb.sum_replicas`), `MoELayer`'s placement state and `rebalance`, and bad input.

The contract (`tests/test_layer_contract.py`, `Replicated`) checks outputs and gradients of
replicated layers against the reference on every mesh and scheme."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import MoEConfig, MoELayer, checkpoint, eplb, moe_apply, reference_moe
from moejax.forward import compiled_executables
from moejax.params import EXPERT_PARAMS
from moejax.replicas import move_plan
from moejax.testing import poison, random_params, rank_mask
from tests.helpers import BASE, count_compiles, mesh_of, seed_of, slow, tolerance

CONFIG = MoEConfig(**BASE, num_redundant_experts=8, expert_bias=True)
LOGICAL = dataclasses.replace(CONFIG, num_redundant_experts=0)


def random_placement(rng: np.random.Generator) -> eplb.Placement:
  """A valid placement of 8 experts on 16 slots, drawn at random: every expert once, then
  8 random replicas, shuffled."""
  slots = np.concatenate([np.arange(8), rng.integers(0, 8, 8)])
  return eplb.from_physical_to_logical(rng.permutation(slots), 8)


def test_place_puts_each_experts_weights_in_its_slots(request):
  params = random_params(LOGICAL, jax.random.key(seed_of(request.node.name)))
  placement = random_placement(np.random.default_rng(0))
  physical = eplb.place(params, placement, CONFIG)
  for name in EXPERT_PARAMS:
    logical = np.asarray(getattr(params, name))
    chex.assert_trees_all_equal(
      np.asarray(getattr(physical, name)), logical[placement.physical_to_logical]
    )
  chex.assert_trees_all_equal(physical.router_kernel, params.router_kernel)


@pytest.mark.parametrize("mesh_shape", [slow(None), slow((1, 8)), (2, 4), slow((4, 2))], ids=str)
def test_moving_between_placements_equals_placing_afresh(mesh_shape, request):
  """From physical weights laid out by one placement to another: the same weights as placing
  the logical ones directly, laid out over the expert axis as the layer's."""
  params = random_params(LOGICAL, jax.random.key(seed_of(request.node.name)))
  rng = np.random.default_rng(seed_of(request.node.name))
  old, new = random_placement(rng), random_placement(rng)
  physical = eplb.place(params, old, CONFIG)
  if mesh_shape is not None:
    mesh = mesh_of(*mesh_shape)
    physical = jax.device_put(physical, NamedSharding(mesh, P("expert")))
  moved = eplb.place(physical, new, CONFIG, current=old)
  chex.assert_trees_all_equal(moved, eplb.place(params, new, CONFIG))
  if mesh_shape is not None:
    assert moved.w_down.sharding.is_equivalent_to(NamedSharding(mesh, P("expert")), 3)


def test_moves_on_an_explicit_mesh(request):
  params = random_params(LOGICAL, jax.random.key(seed_of(request.node.name)))
  rng = np.random.default_rng(seed_of(request.node.name))
  old, new = random_placement(rng), random_placement(rng)
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  with jax.set_mesh(mesh):
    physical = jax.device_put(eplb.place(params, old, CONFIG), NamedSharding(mesh, P("expert")))
    moved = eplb.place(physical, new, CONFIG, current=old)
  chex.assert_trees_all_equal(moved, eplb.place(params, new, CONFIG))


def test_experts_that_stay_on_their_device_are_not_sent():
  rng = np.random.default_rng(3)
  for _ in range(20):
    old = random_placement(rng).physical_to_logical
    new = random_placement(rng).physical_to_logical
    devices = int(rng.choice([2, 4, 8]))
    per = 16 // devices
    plan = move_plan(new, old, devices)
    # Independently: a (device, expert) pair travels once when the device needs the expert
    # and holds no copy of it.
    needed = {(slot // per, e) for slot, e in enumerate(new)}
    held = {(slot // per, e) for slot, e in enumerate(old)}
    assert plan.rows_moved == len(needed - held)
    chex.assert_trees_all_equal(plan.send_counts.sum(), plan.recv_counts.sum())
  assert move_plan(new, new, 4).rows_moved == 0


def test_sum_replicas_adds_each_experts_slots(request):
  rng = np.random.default_rng(seed_of(request.node.name))
  placement = random_placement(rng)
  grads = random_params(CONFIG, jax.random.key(seed_of(request.node.name)))
  summed = eplb.sum_replicas(grads, placement)
  for name in EXPERT_PARAMS:
    physical = np.asarray(getattr(grads, name), np.float64)
    want = np.stack([physical[placement.physical_to_logical == e].sum(0) for e in range(8)])
    chex.assert_trees_all_close(np.asarray(getattr(summed, name)), want, **tolerance())
  chex.assert_trees_all_equal(summed.router_kernel, grads.router_kernel)


@pytest.mark.parametrize(
  "dispatch, mesh_shape",
  [("all_gather", (2, 4)), slow("all_to_all", (4, 2))],  # one device's: the contract's no-mesh case
  ids=str,
)
def test_replicated_layer_equals_the_unreplicated_one(dispatch, mesh_shape, request):
  """Same logical weights, replicas placed at random, shared and zero-computation experts,
  chunks, empty ranks and NaN padding: y and dL/dx equal to float rounding."""
  logical = dataclasses.replace(
    LOGICAL,
    dispatch=dispatch,
    top_k=3,
    num_zero_experts=2,
    num_shared_experts=1,
    shared_intermediate_size=8,
  )
  config = dataclasses.replace(logical, num_redundant_experts=8)
  params = random_params(logical, jax.random.key(seed_of(request.node.name)))
  x = jax.random.normal(jax.random.key(1), (8 * 7, 16))
  mask = rank_mask([0, 7, 3, 0, 5, 7, 1, 2], 7)
  placement = random_placement(np.random.default_rng(seed_of(request.node.name)))
  physical = eplb.place(params, placement, config)
  mesh = mesh_of(*mesh_shape)
  run = lambda p, c, **kw: lambda x: moe_apply(p, x, config=c, mesh=mesh, token_mask=mask, **kw)[0]
  ours, plain = run(physical, config, placement=placement), run(params, logical)
  chex.assert_trees_all_close(ours(poison(x, mask)), plain(x), **tolerance(comparison="reordered"))
  loss = lambda layer: lambda x: jnp.sum(jnp.sin(layer(x)))
  chex.assert_trees_all_close(
    jax.grad(loss(ours))(poison(x, mask)),
    jax.grad(loss(plain))(x),
    **tolerance(comparison="reordered"),
  )


def test_without_replicas_physical_counts_are_expert_counts(request):
  config = dataclasses.replace(LOGICAL, num_zero_experts=2, top_k=3)
  params = random_params(config, jax.random.key(seed_of(request.node.name)))
  x = jax.random.normal(jax.random.key(2), (40, 16))
  _, aux = moe_apply(params, x, config=config, mesh=mesh_of(2, 4))
  chex.assert_trees_all_equal(aux.physical_counts, aux.expert_counts[:8])


class TestLayer:
  def test_starts_with_vllms_placement_and_equal_replicas(self):
    layer = MoELayer(CONFIG, rngs=nnx.Rngs(0))
    placement = eplb.Placement(*layer.placement.get_value())
    chex.assert_trees_all_equal(
      np.asarray(placement.physical_to_logical), np.arange(16, dtype=np.int32) % 8
    )
    w = np.asarray(layer.w_gate_up.get_value())
    chex.assert_trees_all_equal(w[8:], w[:8])

  @pytest.mark.parametrize("expert_fsdp", [False, True], ids=["replicated", "fsdp"])
  def test_rebalance_follows_the_load_and_keeps_the_output(self, expert_fsdp):
    """With expert_fsdp the weights move as stored: split over data, and they stay so."""
    mesh = mesh_of(2, 4)
    config = dataclasses.replace(CONFIG, expert_fsdp=expert_fsdp)
    layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(0))
    stored = {name: getattr(layer, name)[...].sharding for name in ("w_gate_up", "b_down")}
    assert stored["w_gate_up"].spec[1] == ("data" if expert_fsdp else None)
    skew = jnp.zeros((1, 8)).at[0, 3].set(6.0)  # expert 3 takes every token's first choice
    x = jax.random.normal(jax.random.key(4), (64, 16))
    logits = jax.random.normal(jax.random.key(5), (64, 8)) + skew
    before = layer(x, router_logits=logits)
    aux = moe_apply(
      layer.moe_params(), x, config=config, mesh=mesh, router_logits=logits,
      placement=eplb.Placement(*layer.placement.get_value()),
    )[1]  # fmt: skip
    chex.assert_trees_all_equal(layer.expert_load.get_value(), aux.physical_counts)
    load = np.bincount(np.arange(16) % 8, weights=np.asarray(aux.physical_counts), minlength=8)
    runs = compiled_executables()
    placement = layer.rebalance()
    chex.assert_trees_all_equal(placement, eplb.rebalance(load, num_physical=16, num_devices=4))
    assert placement.replica_counts[3] > 1
    chex.assert_trees_all_equal(layer.expert_load.get_value(), jnp.zeros(16, jnp.int32))
    with count_compiles() as compiles:
      after = layer(x, router_logits=logits)
    chex.assert_trees_all_close(after, before, **tolerance())
    assert compiles == [] and compiled_executables() == runs
    for name, sharding in stored.items():
      assert getattr(layer, name)[...].sharding == sharding, name
    balance = lambda counts: eplb.balancedness(np.asarray(counts), num_devices=4)
    new_counts = layer.expert_load.get_value()
    assert balance(new_counts) > balance(aux.physical_counts)

  def test_rebalance_from_a_given_load(self, request):
    """And the reference follows the new placement (it must be given it: the slots moved)."""
    layer = MoELayer(CONFIG, rngs=nnx.Rngs(0))
    load = np.random.default_rng(1).random(8)
    placement = layer.rebalance(load)
    chex.assert_trees_all_equal(placement, eplb.rebalance(load, num_physical=16, num_devices=1))
    assert np.any(placement.physical_to_logical[:8] != np.arange(8))  # slot e no longer e
    x = jax.random.normal(jax.random.key(seed_of(request.node.name)), (12, 16))
    want = reference_moe(layer.moe_params(), x, CONFIG, placement=layer.placement.get_value())
    chex.assert_trees_all_close(layer(x), want, **tolerance())
    with pytest.raises(ValueError, match="placement= is required"):
      reference_moe(layer.moe_params(), x, CONFIG)

  def test_optax_sees_only_the_parameters(self):
    layer = MoELayer(CONFIG, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(layer, optax.adam(1e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(6), (12, 16))

    @nnx.jit
    def step(layer, optimizer, x):
      _, grads = nnx.value_and_grad(lambda layer: jnp.sum(layer(x) ** 2))(layer)
      optimizer.update(layer, grads)
      return grads

    grads = step(layer, optimizer, x)
    names = {path[0] for path, _ in nnx.to_flat_state(grads)}
    assert "placement" not in names and "expert_load" not in names and "w_down" in names
    assert int(jnp.sum(layer.expert_load.get_value())) == 12 * CONFIG.top_k

  def test_checkpoint_round_trips_the_placement(self, tmp_path):
    layer = MoELayer(CONFIG, rngs=nnx.Rngs(0))
    layer.rebalance(np.arange(8.0))
    checkpoint.save(tmp_path / "ckpt", layer)
    restored = MoELayer(CONFIG, rngs=nnx.Rngs(1))
    checkpoint.restore(tmp_path / "ckpt", restored)
    chex.assert_trees_all_equal(
      tuple(restored.placement.get_value()), tuple(layer.placement.get_value())
    )
    chex.assert_trees_all_equal(restored.w_gate_up.get_value(), layer.w_gate_up.get_value())

  def test_rebalance_needs_replicas(self):
    layer = MoELayer(LOGICAL, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_redundant_experts is 0"):
      layer.rebalance()
    with pytest.raises(ValueError, match=r"load has shape \(3,\)"):
      MoELayer(CONFIG, rngs=nnx.Rngs(0)).rebalance(np.ones(3))


class TestBadInput:
  def params_and_x(self):
    params = random_params(CONFIG, jax.random.key(0))
    return params, jnp.ones((4, 16))

  def test_physical_experts_must_divide_over_the_expert_axis(self):
    config = dataclasses.replace(CONFIG, num_redundant_experts=2)
    with pytest.raises(ValueError, match="num_experts=8 \\+ num_redundant_experts=2"):
      MoELayer(config, mesh=mesh_of(1, 4), rngs=nnx.Rngs(0))

  def test_negative_redundant_experts(self):
    with pytest.raises(ValueError, match="num_redundant_experts must be an int >= 0"):
      dataclasses.replace(CONFIG, num_redundant_experts=-1)

  def test_placement_is_required_with_replicas_and_rejected_without(self):
    params, x = self.params_and_x()
    with pytest.raises(ValueError, match="placement= is required"):
      moe_apply(params, x, config=CONFIG)
    with pytest.raises(ValueError, match="placement= is given"):
      moe_apply(
        random_params(LOGICAL, jax.random.key(0)), x, config=LOGICAL,
        placement=eplb.initial_placement(8, 8),
      )  # fmt: skip

  @pytest.mark.parametrize(
    "field, value, match",
    [
      ("physical_to_logical", np.zeros(15, np.int32), r"physical_to_logical has shape \(15,\)"),
      ("logical_to_physical", np.zeros((8, 3), np.int32), r"logical_to_physical has shape"),
      ("replica_counts", np.ones(8, np.float32), "replica_counts must be integer"),
    ],
  )
  def test_placement_shapes_are_checked_at_trace_time(self, field, value, match):
    params, x = self.params_and_x()
    placement = eplb.initial_placement(8, 8)._replace(**{field: value})
    with pytest.raises(ValueError, match=match):
      jax.jit(lambda p, x, pl: moe_apply(p, x, config=CONFIG, placement=pl))(params, x, placement)

  @pytest.mark.parametrize(
    "physical, match",
    [
      (np.array([0, 1, 2, 3, 4, 5, 6, 8] + [0] * 8), r"ids outside \[0, 8\)"),
      (np.array([0, 1, 2, 3, 4, 5, 6, 6] + [0] * 8), r"experts \[7\] without a slot"),
      (np.array([0, 1, 2, 3, 4, 5, 6, -1] + [0] * 8), r"ids outside \[0, 8\)"),
    ],
  )
  def test_place_checks_values_on_the_host(self, physical, match):
    params = random_params(LOGICAL, jax.random.key(0))
    placement = eplb.initial_placement(8, 8)._replace(physical_to_logical=physical)
    with pytest.raises(ValueError, match=match):
      eplb.place(params, placement, CONFIG)

  def test_place_checks_the_fields_agree(self):
    params = random_params(LOGICAL, jax.random.key(0))
    placement = eplb.initial_placement(8, 8)
    swapped = placement._replace(replica_counts=placement.replica_counts[::-1].copy() + 0)
    swapped.replica_counts[0] = 3
    with pytest.raises(ValueError, match="replica_counts disagrees"):
      eplb.place(params, swapped, CONFIG)
    moved = placement._replace(logical_to_physical=np.roll(placement.logical_to_physical, 1, 0))
    with pytest.raises(ValueError, match="logical_to_physical disagrees"):
      eplb.place(params, moved, CONFIG)

  def test_place_checks_the_leading_size(self):
    physical = random_params(CONFIG, jax.random.key(0))
    placement = eplb.initial_placement(8, 8)
    with pytest.raises(ValueError, match=r"w_gate_up has leading size 16, expected E"):
      eplb.place(physical, placement, CONFIG)
    with pytest.raises(ValueError, match=r"leading size 8, expected P = E \+ R"):
      eplb.place(random_params(LOGICAL, jax.random.key(0)), placement, CONFIG, current=placement)
