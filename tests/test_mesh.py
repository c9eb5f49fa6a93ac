"""Past the two-axis mesh: axis groups, replicated inputs, expert weights split over data."""

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import (
  MoEConfig,
  MoELayer,
  MoEParams,
  checkpoint,
  eplb,
  moe_apply,
  param_shapes,
  quant,
  reference_moe,
)
from moejax.expert_placement import initial_placement
from moejax.linen import moe_linen
from moejax.params import EXPERT_PARAMS, SHARED_FSDP_PARAMS
from moejax.testing import poison, random_params
from tests.helpers import assert_close, check_against_reference, mesh_of, seed_of, slow
from tests.lowering import collectives

BASE = MoEConfig(
  num_experts=8,
  top_k=2,
  hidden_size=16,
  intermediate_size=24,
  chunk_size=4,
  expert_bias=True,
  num_shared_experts=1,
  shared_intermediate_size=8,
)
TENSOR_MESH = ("data", "expert", "tensor")


def three_axis_mesh(axis_types=None) -> Mesh:
  """(data, expert, tensor) = (2, 2, 2) over the 8 devices."""
  kwargs = {} if axis_types is None else {"axis_types": axis_types}
  return Mesh(np.array(jax.devices()).reshape(2, 2, 2), TENSOR_MESH, **kwargs)


def tokens(seed: int, count: int = 40) -> tuple[jax.Array, jax.Array]:
  x = jax.random.normal(jax.random.key(seed), (count, BASE.hidden_size))
  mask = jax.random.bernoulli(jax.random.key(seed + 1), 0.7, (count,))
  return x, mask


@pytest.mark.parametrize(
  "dispatch, fsdp, redundant",
  [("all_gather", False, 0), ("all_to_all", True, 8)],
  ids=["gather", "a2a-fsdp-redundant"],
)
def test_an_expert_group_computes_each_token_once(dispatch, fsdp, redundant, request):
  """(data, expert, tensor) = (2, 2, 2) with expert_axis=("expert", "tensor") is the (2, 4)
  mesh: the reference's output and gradients, and the same rows sent and expert counts (with
  fsdp: the expert weights over the data group, the router and shared experts over all)."""
  seed = seed_of(request.node.name)
  grouped = dataclasses.replace(
    BASE,
    expert_axis=("expert", "tensor"),
    dispatch=dispatch,
    expert_fsdp=fsdp,
    shared_fsdp=fsdp,
    num_redundant_experts=redundant,
  )
  placement = initial_placement(8, redundant) if redundant else None
  params = random_params(
    dataclasses.replace(grouped, num_redundant_experts=0), jax.random.key(seed)
  )
  x, mask = tokens(seed)
  mesh = three_axis_mesh()
  check_against_reference(params, x, grouped, mesh, mask, seed=seed, placement=placement)
  physical = params if placement is None else eplb.place(params, placement, grouped)
  flat = dataclasses.replace(grouped, expert_axis="expert")
  run = lambda config, mesh: moe_apply(
    physical, x, config=config, mesh=mesh, token_mask=mask, placement=placement
  )[1]
  chex.assert_trees_all_equal(run(grouped, mesh), run(flat, mesh_of(2, 4)))


def test_quantized_experts_restored_onto_a_grouped_mesh(tmp_path, request):
  """An mxfp4 layer saved on (2, 4) and restored onto (2, 2, 2) with an expert group and
  expert_fsdp: the same output, and the reference's on the dequantized weights."""
  config = dataclasses.replace(
    BASE, hidden_size=64, intermediate_size=64, expert_quant="mxfp4", expert_bias=False
  )
  saved = MoELayer(config, mesh=mesh_of(2, 4), rngs=nnx.Rngs(seed_of(request.node.name)))
  checkpoint.save(tmp_path / "ckpt", saved)
  grouped = dataclasses.replace(config, expert_axis=("expert", "tensor"), expert_fsdp=True)
  restored = MoELayer(grouped, mesh=three_axis_mesh(), rngs=nnx.Rngs(0))
  checkpoint.restore(tmp_path / "ckpt", restored)
  assert restored.w_down.values[...].sharding.spec[:2] == (("expert", "tensor"), "data")
  x = jax.random.normal(jax.random.key(seed_of(request.node.name)), (24, 64))
  mask = jnp.arange(24) % 5 != 0
  y = restored(poison(x, mask), mask)
  params, float_config = quant.dequantize_experts(jax.device_get(saved.moe_params()), config)
  assert_close(y, reference_moe(params, x, float_config, mask), what="y")


def test_replicated_tokens_are_split_and_come_back_replicated(request):
  """Tokens replicated over the tensor axis (attention's outputs): each device takes its
  share, and y comes back sharded as x was."""
  mesh = three_axis_mesh(axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  config = dataclasses.replace(BASE, expert_axis=("expert", "tensor"))
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(seed_of(request.node.name)))
  x, mask = tokens(seed_of(request.node.name))
  x = jax.device_put(poison(x, mask), NamedSharding(mesh, P("data")))
  mask = jax.device_put(mask, NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    y = layer(x, mask)
  assert y.sharding.is_equivalent_to(x.sharding, y.ndim), (y.sharding, x.sharding)
  params = jax.device_get(layer.moe_params())
  assert_close(y, reference_moe(params, jnp.nan_to_num(x), config, mask), what="y")


def test_the_linen_bridge_with_groups_and_fsdp(request):
  config = dataclasses.replace(BASE, expert_axis=("expert", "tensor"), expert_fsdp=True)
  module = moe_linen(config, mesh=three_axis_mesh())
  x, mask = tokens(seed_of(request.node.name))
  variables = module.init(jax.random.key(seed_of(request.node.name)), x, mask)
  stored = (("expert", "tensor"), "data", None)
  assert nn.get_partition_spec(variables)["params"]["w_gate_up"] == P(*stored)
  assert nn.unbox(variables)["params"]["w_gate_up"].sharding.spec == P(*stored)
  params = MoEParams(**{name: value for name, value in nn.unbox(variables)["params"].items()})
  y = module.apply(variables, poison(x, mask), mask)
  assert_close(y, reference_moe(jax.device_get(params), x, config, mask), what="y")


def test_fsdp_stores_a_share_and_reduce_scatters_gradients(request):
  """Each device holds 1 / (S * data) of the expert weights; the gradient's program gathers
  them once, outside the chunk loop, and reduce-scatters their gradients, with no
  all-reduce as large as a device's gathered weights (the replicated layer's has one)."""
  mesh = mesh_of(2, 4)
  config = dataclasses.replace(BASE, expert_fsdp=True, chunk_size=2)
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(seed_of(request.node.name)))
  shapes = param_shapes(config)
  for name in EXPERT_PARAMS:
    value = getattr(layer, name)[...]
    (shard,) = {s.data.shape for s in value.addressable_shards}
    assert shard == (shapes[name][0] // 4, shapes[name][1] // 2, *shapes[name][2:]), name
  x, mask = tokens(seed_of(request.node.name))
  local = {name: 4 * np.prod(shapes[name]) // 4 for name in EXPERT_PARAMS}  # gathered, El = 2
  ops = {
    fsdp: _collectives(dataclasses.replace(config, expert_fsdp=fsdp), mesh, x, mask)
    for fsdp in (False, True)
  }
  all_reduced = lambda fsdp: max(size for op, size, _ in ops[fsdp] if op == "all-reduce")
  assert all_reduced(False) >= sum(local.values())  # the check can fail
  assert all_reduced(True) < sum(local.values()) / 4, ops[True]
  scattered = sum(size for op, size, _ in ops[True] if op == "reduce-scatter")
  assert scattered >= sum(local.values()) / 2, ops[True]  # each device keeps 1 / 2
  # Gathered once per call, before the chunk loop: in the entry computation, in no loop.
  weight_gathers = [
    entry
    for op, size, entry in ops[True]
    if op == "all-gather" and size in (local["w_gate_up"], local["w_down"])
  ]
  assert weight_gathers and all(weight_gathers), ops[True]


def test_shared_fsdp_stores_a_share_and_reduce_scatters_gradients(request):
  """With shared_fsdp each device holds 1 / 8 of the router's and shared experts' matrices
  (dim 0); the gradient's program reduce-scatters their gradients, and the all-reduce of the
  replicated layer's (one as large as those matrices) is gone."""
  mesh = mesh_of(2, 4)
  config = dataclasses.replace(BASE, shared_fsdp=True)
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(seed_of(request.node.name)))
  shapes = param_shapes(config)
  for name in SHARED_FSDP_PARAMS:
    if name in shapes:
      (shard,) = {s.data.shape for s in getattr(layer, name)[...].addressable_shards}
      assert shard == (shapes[name][0] // 8, *shapes[name][1:]), name
  x, mask = tokens(seed_of(request.node.name))
  whole = 4 * sum(np.prod(shapes[n]) for n in SHARED_FSDP_PARAMS if n in shapes)  # f32 bytes
  ops = {
    fsdp: _collectives(dataclasses.replace(config, shared_fsdp=fsdp), mesh, x, mask)
    for fsdp in (False, True)
  }
  reduced = lambda fsdp, kind: sum(size for op, size, _ in ops[fsdp] if op == kind)
  assert reduced(False, "all-reduce") - reduced(True, "all-reduce") >= whole  # the check can fail
  assert reduced(True, "reduce-scatter") - reduced(False, "reduce-scatter") >= whole / 8


def _collectives(config, mesh, x, mask) -> list[tuple[str, int, bool]]:
  """(op, bytes of its result, whether in the entry computation) of each all-reduce,
  reduce-scatter and all-gather in the compiled gradient of the layer on `mesh`."""
  params = random_params(config, jax.random.key(0))
  loss = lambda p: jnp.sum(moe_apply(p, x, config=config, mesh=mesh, token_mask=mask)[0] ** 2)
  return collectives(jax.jit(jax.grad(loss)).lower(params).compile().as_text())


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, slow(AxisType.Auto)])
def test_axes_of_size_one_may_be_left_out_of_the_groups(axis_type, request):
  """A framework's mesh with unused axes of size 1 (Levanter's ("replica_dcn", "data",
  "context", "expert", "model")) needs no ceremony: the layer on the (2, 4) devices of its
  data and expert axes gives the reference's output and gradients."""
  seed = seed_of(request.node.name)
  names = ("replica_dcn", "data", "context", "expert", "model")
  mesh = jax.make_mesh((1, 2, 1, 4, 1), names, axis_types=(axis_type,) * 5)
  x, mask = tokens(seed)
  params = random_params(BASE, jax.random.key(seed))
  check_against_reference(params, poison(x, mask), BASE, mesh, mask, seed=seed)


class TestErrors:
  def test_an_axis_in_neither_group(self):
    with pytest.raises(ValueError, match="mesh axis 'tensor' \\(size 2\\) is in neither group"):
      MoELayer(BASE, mesh=three_axis_mesh(), rngs=nnx.Rngs(0))

  def test_a_group_axis_missing_from_the_mesh(self):
    config = dataclasses.replace(BASE, expert_axis=("expert", "tensor"))
    with pytest.raises(ValueError, match=re.escape("config.expert_axis names 'tensor'")):
      MoELayer(config, mesh=mesh_of(2, 4), rngs=nnx.Rngs(0))

  def test_the_expert_group_must_divide_the_experts(self):
    config = dataclasses.replace(BASE, num_experts=6, expert_axis=("expert", "tensor"))
    with pytest.raises(ValueError, match=re.escape("expert_axis=('expert', 'tensor'), 4")):
      MoELayer(config, mesh=three_axis_mesh(), rngs=nnx.Rngs(0))

  def test_the_data_group_must_split_dim_1(self):
    config = dataclasses.replace(BASE, hidden_size=18, expert_fsdp=True)
    with pytest.raises(ValueError, match=r"splits w_gate_up \(8, 18, 48\) along dim 1 .* 4 shards"):
      MoELayer(config, mesh=mesh_of(4, 2), rngs=nnx.Rngs(0))

  def test_every_device_must_split_the_shared_matrices(self):
    config = dataclasses.replace(BASE, hidden_size=18, shared_fsdp=True)
    with pytest.raises(ValueError, match=r"splits router_kernel \(18, 8\) along dim 0 .* 8 shards"):
      MoELayer(config, mesh=mesh_of(4, 2), rngs=nnx.Rngs(0))

  def test_a_scale_block_must_not_straddle_two_shards(self):
    config = dataclasses.replace(
      BASE, hidden_size=64, intermediate_size=64, expert_fsdp=True, expert_quant="mxfp4"
    )
    with pytest.raises(ValueError, match=r"w_gate_up .* into 4 shards in whole 32-row"):
      MoELayer(config, mesh=mesh_of(4, 2), rngs=nnx.Rngs(0))
