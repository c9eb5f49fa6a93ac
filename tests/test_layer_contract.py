"""The layer's contract, one test base run by every dispatch scheme x expert path.

`LayerContract` holds the cases every implementation must pass: every mesh and token pattern
(empty, full and uneven ranks, NaN-poisoned padding) against `reference_moe` with gradients,
every routing and model-family option, the adversarial full exchange buffer, and one
executable for every token pattern. A new scheme, path or feature is a subclass: redundant
experts run the whole contract on replicated, re-placed experts.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import platform
from moejax import MoEConfig, eplb, id_spaces, moe_apply, plan, reference_moe
from moejax.testing import poison, random_params, rank_mask
from tests.helpers import (
  BASE,
  MESHES,
  OPTIONS,
  RICH,
  check_against_reference,
  count_compiles,
  mesh_id,
  mesh_of,
  seed_of,
  tolerance,
)

ROWS_PER_RANK = 9
UNEVEN = [0, 4, 9, 2, 0, 7, 1, 9]  # ranks 0 and 4 empty, ranks 2 and 7 full


def pytest_generate_tests(metafunc):
  """Each subclass names its meshes and options (class attributes); those not in its
  `fast_meshes` and `fast_options` are in the slow tier."""
  cls = metafunc.cls
  tier = lambda value, fast, name: pytest.param(
    value, id=name, marks=() if value in fast else pytest.mark.slow
  )
  if "mesh_shape" in metafunc.fixturenames:
    metafunc.parametrize("mesh_shape", [tier(m, cls.fast_meshes, mesh_id(m)) for m in cls.meshes])
  if "option" in metafunc.fixturenames:
    metafunc.parametrize("option", [tier(o, cls.fast_options, o) for o in cls.options])


class LayerContract:
  """What every dispatch scheme and expert path must do."""

  scheme: str
  expert_backend = "auto"
  meshes = MESHES
  options = tuple(OPTIONS)
  redundant_experts = 0
  # The fast tier: one mesh, and each option once across the classes (the tile loop's).
  fast_meshes = ((2, 4),)
  fast_options = ()

  def config(self, **overrides) -> MoEConfig:
    fields = {**BASE, **overrides}
    return MoEConfig(
      **fields,
      dispatch=self.scheme,
      expert_backend=self.expert_backend,
      num_redundant_experts=self.redundant_experts,
    )

  def placement(self, config: MoEConfig) -> eplb.Placement | None:
    """The placement the layer runs with: None without redundant experts."""
    return None

  def physical(self, params, config: MoEConfig):
    """The logical `params` laid out by `placement` where there is one."""
    placement = self.placement(config)
    return params if placement is None else eplb.place(params, placement, config)

  def apply(self, params, x, config: MoEConfig, mesh, **kwargs):
    """`moe_apply` on the logical `params`, laid out by `placement` where there is one."""
    return moe_apply(
      self.physical(params, config),
      x,
      config=config,
      mesh=mesh,
      placement=self.placement(config),
      **kwargs,
    )

  def check(self, params, x, config: MoEConfig, mesh, mask, **kwargs) -> None:
    check_against_reference(
      params, x, config, mesh, mask, placement=self.placement(config), **kwargs
    )

  def inputs(self, config: MoEConfig, name: str):
    """Logical parameters (E experts) and tokens, drawn from the test's name."""
    key = jax.random.key(seed_of(name))
    params = random_params(dataclasses.replace(config, num_redundant_experts=0), key)
    if config.use_routing_bias:
      outputs = config.num_router_outputs
      params = params._replace(routing_bias=0.1 * jax.random.normal(key, (outputs,)))
    x = 2.0 * jax.random.normal(jax.random.fold_in(key, 1), (8 * ROWS_PER_RANK, 16))
    return params, x

  def test_matches_reference_on_every_token_pattern(self, mesh_shape, request):
    config = self.config(**RICH)
    params, x = self.inputs(config, request.node.name)
    mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
    for counts in ([0] * 8, [ROWS_PER_RANK] * 8, UNEVEN):  # one compiled program for all
      mask = rank_mask(counts, ROWS_PER_RANK)
      self.check(params, x, config, mesh, mask, seed=seed_of(request.node.name))

  def test_expert_counts_match_numpy(self, request):
    config = self.config()
    params, x = self.inputs(config, request.node.name)
    mask = rank_mask(UNEVEN, ROWS_PER_RANK)
    _, aux = self.apply(params, poison(x, mask), config, mesh_of(2, 4), token_mask=mask)
    logits = np.asarray(x, np.float64) @ np.asarray(params.router_kernel, np.float64)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, : config.top_k][np.asarray(mask)]
    chex.assert_trees_all_equal(
      np.asarray(aux.expert_counts), np.bincount(ids.ravel(), minlength=8)
    )

  def test_option_matches_reference(self, option, request):
    config = self.config(**OPTIONS[option])
    params, x = self.inputs(config, request.node.name)
    mask = rank_mask(UNEVEN, ROWS_PER_RANK)
    self.check(params, x, config, mesh_of(2, 4), mask, seed=seed_of(request.node.name))

  def test_every_token_to_one_devices_experts(self, request):
    """Every row routes to expert 0, on expert rank 0, which receives C rows from each of its
    S sources: all_to_all's [S, C] buffer full, nothing dropped."""
    config = self.config(top_k=1, num_shared_experts=1, shared_intermediate_size=8)
    params, x = self.inputs(config, request.node.name)
    noise = jax.random.normal(jax.random.key(seed_of(request.node.name)), (x.shape[0], 8))
    logits = noise + jnp.array([[30.0, 0, 0, 0, 0, 0, 0, 0]])
    y, aux = self.apply(params, x, config, mesh_of(1, 8), router_logits=logits)
    logical = dataclasses.replace(config, num_redundant_experts=0)
    chex.assert_trees_all_close(
      y, reference_moe(params, x, logical, router_logits=logits), **tolerance()
    )
    chex.assert_trees_all_equal(np.asarray(aux.expert_counts), np.eye(8, dtype=int)[0] * x.shape[0])
    # all_to_all sends each row once, to device 0; all_gather sends every chunk everywhere.
    sent = {
      "all_to_all": np.full(8, ROWS_PER_RANK),
      "all_gather": np.asarray(aux.chunks_run) * config.chunk_size * 8,
    }
    chex.assert_trees_all_equal(np.asarray(aux.dispatch_rows), sent[self.scheme])

  def test_replays_expert_ids(self, request):
    """Routing replay: the router's own ids given back reproduce its output bit for bit;
    other ids (zero-computation experts among them) match the reference, gradients too."""
    config = self.config(**OPTIONS["longcat"])
    params, x = self.inputs(config, request.node.name)
    mask, mesh = rank_mask(UNEVEN, ROWS_PER_RANK), mesh_of(2, 4)
    y, aux = self.apply(params, poison(x, mask), config, mesh, token_mask=mask)
    replayed, again = self.apply(
      params, poison(x, mask), config, mesh, token_mask=mask, expert_ids=aux.expert_ids
    )
    chex.assert_trees_all_equal((replayed, again.expert_ids), (y, aux.expert_ids))
    rng = np.random.default_rng(seed_of(request.node.name))
    others = [rng.permutation(config.num_router_outputs)[: config.top_k] for _ in x]
    self.check(params, x, config, mesh, mask, seed=1, expert_ids=jnp.asarray(np.stack(others)))

  def test_one_executable_for_every_token_pattern(self, request):
    config = self.config(**RICH)
    params, x = self.inputs(config, request.node.name)
    rng = np.random.default_rng(seed_of(request.node.name))
    mesh = mesh_of(2, 4)
    placement = self.placement(config)
    layer = jax.jit(
      lambda p, x, m: moe_apply(p, x, config=config, mesh=mesh, token_mask=m, placement=placement)[
        0
      ]
    )
    physical = self.physical(params, config)
    masks = [rank_mask(rng.integers(0, ROWS_PER_RANK + 1, 8), ROWS_PER_RANK) for _ in range(6)]
    jax.block_until_ready(layer(physical, x, masks[0]))
    poisoned = jax.block_until_ready([poison(x, m) for m in masks])  # compiled outside the count
    with count_compiles() as compiles:
      got = [layer(physical, x, m) for x, m in zip(poisoned, masks, strict=True)]
      jax.block_until_ready(got)
    assert compiles == [], f"{len(compiles)} compilations for new token patterns"
    logical = dataclasses.replace(config, num_redundant_experts=0)
    for y, mask in zip(got, masks, strict=True):
      chex.assert_trees_all_close(y, reference_moe(params, x, logical, mask), **tolerance())


# Options whose exchange differs by scheme (biases, zero experts that are never sent, every
# expert chosen) run under both; the rest are shared out, as on the ragged_dot path.
BOTH_SCHEMES = ("gpt_oss", "longcat", "all-experts")


class TestAllGather(LayerContract):
  scheme = "all_gather"
  options = (*BOTH_SCHEMES, "softmax", "grouped", "llama4", "qwen2_moe", "inkling")
  fast_options = options


class TestAllToAll(LayerContract):
  scheme = "all_to_all"
  options = (
    *BOTH_SCHEMES,
    "sigmoid-renorm-scaled",
    "gelu-top1",
    "gelu_tanh",
    "phimoe",
    "nemotron_h",
    "muse_spark",
  )
  fast_options = options[len(BOTH_SCHEMES) :]


def test_every_option_is_in_the_fast_tier_once():
  fast = [*TestAllGather.fast_options, *TestAllToAll.fast_options]
  assert sorted(fast) == sorted(OPTIONS)


def test_every_option_runs_on_the_tile_loop():
  assert set(TestAllGather.options) | set(TestAllToAll.options) == set(OPTIONS)


class TestAllToAllCapacity(LayerContract):
  """all_to_all with receive buffers below the worst case (`receive_capacity_factor` 0.5:
  8 rows per chunk of 4, against 16 or 32): some chunks fit and the others overflow and run
  again in sub-chunks, and every check of the contract holds either way."""

  scheme = "all_to_all"
  meshes = ((2, 4), (1, 8), (4, 2))
  options = ("gelu-top1", "phimoe", "longcat")

  def config(self, **overrides) -> MoEConfig:
    return dataclasses.replace(super().config(**overrides), receive_capacity_factor=0.5)

  def test_some_chunks_fit_and_the_others_run_in_sub_chunks(self, request):
    """The counts: on the 2x4 mesh with full ranks (3 chunks each, the last holding one row),
    some chunks overflowed, not all; with every row to experts 0..K-1 on the 1x8 mesh (one
    expert per device), the two full chunks (8 sources x C rows to each of devices 0..K-1,
    against 8), not the third (one row from each source: 8 fit), and only those K devices
    received past their capacity."""
    config = self.config(**RICH)
    params, x = self.inputs(config, request.node.name)
    _, aux = self.apply(params, x, config, mesh_of(2, 4))
    assert 0 < int(np.sum(aux.overflowed_chunks)) < int(np.sum(aux.chunks_run)), aux
    to_the_first = jnp.tile(jnp.arange(config.top_k, dtype=jnp.int32), (x.shape[0], 1))
    _, aux = self.apply(params, x, config, mesh_of(1, 8), expert_ids=to_the_first)
    chex.assert_trees_all_equal(np.asarray(aux.chunks_run), np.full(8, 3))
    chex.assert_trees_all_equal(np.asarray(aux.overflowed_chunks), np.full(8, 2))
    past = 2 * (8 * config.chunk_size - 8) * (np.arange(8) < config.top_k)
    chex.assert_trees_all_equal(np.asarray(aux.overflowed_rows), past)


class RaggedDotPath(LayerContract):
  """The XLA path a GPU takes for few local experts (sort + ragged_dot), forced on the CPU.
  expert_backend="xla" keeps its traces apart from the other classes' in the jit cache.
  Each option runs on this path under one scheme (the two schemes share the options out:
  the expert path sees what arrives, whichever scheme sent it)."""

  expert_backend = "xla"
  meshes = (None, (2, 4))

  @pytest.fixture(autouse=True)
  def _as_on_a_gpu(self, monkeypatch):
    # Plans as a GPU does, run on the CPU (a GPU `Target` would also take its collectives).
    monkeypatch.setattr(platform, "on_cpu", lambda: False)
    assert plan.plan_experts(self.config(), num_rows=64, local_experts=2).path == "ragged_dot"


class TestRaggedDotAllGather(RaggedDotPath):
  scheme = "all_gather"
  options = ("softmax", "grouped", "all-experts", "llama4", "qwen2_moe")


class TestRaggedDotAllToAll(RaggedDotPath):
  scheme = "all_to_all"
  options = ("sigmoid-renorm-scaled", "gelu-top1", "gelu_tanh", "phimoe", "longcat", "muse_spark")


@pytest.mark.filterwarnings("ignore:expert_backend='pallas' on a CPU:UserWarning")
@pytest.mark.filterwarnings("ignore:expert_backend='pallas' falls back:UserWarning")
class PallasPath(LayerContract):
  """The Pallas kernels (in their interpreter on a CPU); options they cannot run take the
  tile loop, with a warning. The kernels' options are shared out between the schemes, as
  on the ragged_dot path."""

  expert_backend = "pallas"
  meshes = ((2, 4),)


class TestPallasAllGather(PallasPath):
  scheme = "all_gather"
  options = ("softmax", "llama4", "qwen2_moe", "muse_spark")


class TestPallasAllToAll(PallasPath):
  scheme = "all_to_all"
  options = ("gelu-top1", "phimoe", "longcat")


class Replicated(LayerContract):
  """Redundant experts: 8 spare slots on 8 experts, placed by `eplb.rebalance` from a skewed
  load so that hot experts have replicas on several devices; every check runs on the
  physical weights and compares with the logical reference."""

  redundant_experts = 8
  meshes = (None, (1, 8), (2, 4))  # every shape: tests/test_redundant_experts.py
  options = ("gpt_oss", "llama4", "qwen2_moe", "longcat")  # RICH covers grouped top-k

  def placement(self, config: MoEConfig) -> eplb.Placement:
    load = np.random.default_rng(7).zipf(1.5, config.num_experts).astype(float)
    return eplb.rebalance(load, num_physical=config.num_physical_experts, num_devices=8)

  def test_placement_replicates_across_devices(self):
    """The placement under test is not a trivial one: some expert has replicas on two devices."""
    config = self.config()
    placement = self.placement(config)
    slots_per_device = config.num_physical_experts // 8
    devices = [
      set(id_spaces.owner_device(row[row >= 0], slots_per_device, 8).tolist())
      for row in placement.logical_to_physical
    ]
    assert max(map(len, devices)) >= 2, placement

  def test_physical_counts_follow_the_replica_rule(self, request):
    """Choice k of local row l of expert e goes to replica (l*K + k) mod count[e], counted
    only for valid rows: checked against NumPy on one device."""
    config = self.config()
    params, x = self.inputs(config, request.node.name)
    mask = rank_mask([5, 9, 0, 9, 3, 1, 9, 7], ROWS_PER_RANK)
    _, aux = self.apply(params, poison(x, mask), config, None, token_mask=mask)
    placement = self.placement(config)
    logits = np.asarray(x, np.float64) @ np.asarray(params.router_kernel, np.float64)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, : config.top_k]  # [T, K]
    position = np.arange(ids.size).reshape(ids.shape)
    replica = position % placement.replica_counts[ids]
    slots = placement.logical_to_physical[ids, replica][np.asarray(mask)]
    expected = np.bincount(slots.ravel(), minlength=config.num_physical_experts)
    chex.assert_trees_all_equal(np.asarray(aux.physical_counts), expected.astype(np.int32))
    per_expert = np.bincount(placement.physical_to_logical, weights=expected, minlength=8)
    chex.assert_trees_all_equal(np.asarray(aux.expert_counts), per_expert.astype(np.int32))

  def test_one_executable_across_placements(self, request):
    config = self.config(**RICH)
    params, x = self.inputs(config, request.node.name)
    mesh = mesh_of(2, 4)
    layer = jax.jit(lambda p, x, pl: moe_apply(p, x, config=config, mesh=mesh, placement=pl)[0])
    rng = np.random.default_rng(seed_of(request.node.name))
    placements = [eplb.initial_placement(8, 8)] + [
      eplb.rebalance(rng.random(8), num_physical=16, num_devices=4) for _ in range(3)
    ]
    laid_out = [eplb.place(params, placement, config) for placement in placements]
    jax.block_until_ready(layer(laid_out[0], x, placements[0]))
    with count_compiles() as compiles:
      got = [layer(p, x, pl) for p, pl in zip(laid_out, placements, strict=True)]
      jax.block_until_ready(got)
    assert compiles == [], f"{len(compiles)} compilations for new placements"
    want = reference_moe(params, x, dataclasses.replace(config, num_redundant_experts=0))
    for y in got:
      chex.assert_trees_all_close(y, want, **tolerance())


class TestReplicatedAllToAll(Replicated):
  """all_to_all, whose packing sees the physical ids; all_gather with replicas:
  tests/test_redundant_experts.py (equality with the unreplicated layer)."""

  scheme = "all_to_all"
