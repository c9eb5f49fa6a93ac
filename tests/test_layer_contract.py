"""The layer's contract, one test base run by every dispatch scheme x expert path.

`LayerContract` holds the cases every implementation must pass: every mesh and token pattern
(empty, full and uneven ranks, NaN-poisoned padding) against `reference_moe` with gradients,
every routing and model-family option, the adversarial full exchange buffer, and one
executable for every token pattern. A new scheme, path or feature is a subclass.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import MoEConfig, experts, moe_apply, reference_moe
from tests.helpers import (
  BASE,
  MESHES,
  OPTIONS,
  RICH,
  check_against_reference,
  count_compiles,
  mesh_id,
  mesh_of,
  poison,
  random_params,
  rank_mask,
  seed_of,
  tolerance,
)

ROWS_PER_RANK = 9
UNEVEN = [0, 4, 9, 2, 0, 7, 1, 9]  # ranks 0 and 4 empty, ranks 2 and 7 full


def pytest_generate_tests(metafunc):
  """Each subclass names its meshes and options (class attributes)."""
  if "mesh_shape" in metafunc.fixturenames:
    metafunc.parametrize("mesh_shape", metafunc.cls.meshes, ids=mesh_id)
  if "option" in metafunc.fixturenames:
    metafunc.parametrize("option", metafunc.cls.options)


class LayerContract:
  """What every dispatch scheme and expert path must do."""

  scheme: str
  expert_backend = "auto"
  meshes = MESHES
  options = tuple(OPTIONS)

  def config(self, **overrides) -> MoEConfig:
    fields = {**BASE, **overrides}
    return MoEConfig(**fields, dispatch=self.scheme, expert_backend=self.expert_backend)

  def inputs(self, config: MoEConfig, name: str):
    key = jax.random.key(seed_of(name))
    params = random_params(config, key)
    if config.use_routing_bias:
      outputs = config.num_router_outputs
      params = params._replace(routing_bias=0.1 * jax.random.normal(key, (outputs,)))
    x = 2.0 * jax.random.normal(jax.random.fold_in(key, 1), (8 * ROWS_PER_RANK, 16))
    return params, x

  def test_matches_reference_on_every_token_pattern(self, mesh_shape, request):
    config = self.config(**RICH)
    params, x = self.inputs(config, request.node.name)
    mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
    seed = seed_of(request.node.name)
    for counts in ([0] * 8, [ROWS_PER_RANK] * 8):
      mask = rank_mask(counts, ROWS_PER_RANK)
      check_against_reference(params, x, config, mesh, mask, seed=seed, grads=False)
    check_against_reference(params, x, config, mesh, rank_mask(UNEVEN, ROWS_PER_RANK), seed=seed)

  def test_expert_counts_match_numpy(self, request):
    config = self.config()
    params, x = self.inputs(config, request.node.name)
    mask = rank_mask(UNEVEN, ROWS_PER_RANK)
    _, aux = moe_apply(params, poison(x, mask), config=config, mesh=mesh_of(2, 4), token_mask=mask)
    logits = np.asarray(x, np.float64) @ np.asarray(params.router_kernel, np.float64)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, : config.top_k][np.asarray(mask)]
    chex.assert_trees_all_equal(
      np.asarray(aux.expert_counts), np.bincount(ids.ravel(), minlength=8)
    )

  def test_option_matches_reference(self, option, request):
    config = self.config(**OPTIONS[option])
    params, x = self.inputs(config, request.node.name)
    mask = rank_mask(UNEVEN, ROWS_PER_RANK)
    check_against_reference(params, x, config, mesh_of(2, 4), mask, seed=seed_of(request.node.name))

  def test_every_token_to_one_devices_experts(self, request):
    """Every row routes to expert 0, on expert rank 0, which receives C rows from each of its
    S sources: all_to_all's [S, C] buffer full, nothing dropped."""
    config = self.config(top_k=1, num_shared_experts=1, shared_intermediate_size=8)
    params, x = self.inputs(config, request.node.name)
    noise = jax.random.normal(jax.random.key(seed_of(request.node.name)), (x.shape[0], 8))
    logits = noise + jnp.array([[30.0, 0, 0, 0, 0, 0, 0, 0]])
    y, aux = moe_apply(params, x, config=config, mesh=mesh_of(1, 8), router_logits=logits)
    chex.assert_trees_all_close(
      y, reference_moe(params, x, config, router_logits=logits), **tolerance()
    )
    chex.assert_trees_all_equal(np.asarray(aux.expert_counts), np.eye(8, dtype=int)[0] * x.shape[0])
    # all_to_all sends each row once, to device 0; all_gather sends every chunk everywhere.
    sent = {
      "all_to_all": np.full(8, ROWS_PER_RANK),
      "all_gather": np.asarray(aux.chunks_run) * config.chunk_size * 8,
    }
    chex.assert_trees_all_equal(np.asarray(aux.dispatch_rows), sent[self.scheme])

  def test_one_executable_for_every_token_pattern(self, request):
    config = self.config(**RICH)
    params, x = self.inputs(config, request.node.name)
    rng = np.random.default_rng(seed_of(request.node.name))
    mesh = mesh_of(2, 4)
    layer = jax.jit(lambda p, x, m: moe_apply(p, x, config=config, mesh=mesh, token_mask=m)[0])
    masks = [rank_mask(rng.integers(0, ROWS_PER_RANK + 1, 8), ROWS_PER_RANK) for _ in range(6)]
    jax.block_until_ready(layer(params, x, masks[0]))
    with count_compiles() as compiles:
      got = [layer(params, poison(x, m), m) for m in masks]
      jax.block_until_ready(got)
    assert compiles == [], f"{len(compiles)} compilations for new token patterns"
    for y, mask in zip(got, masks, strict=True):
      chex.assert_trees_all_close(y, reference_moe(params, x, config, mask), **tolerance())


class TestAllGather(LayerContract):
  scheme = "all_gather"


class TestAllToAll(LayerContract):
  scheme = "all_to_all"


class RaggedDotPath(LayerContract):
  """The XLA path a GPU takes for few local experts (sort + ragged_dot), forced on the CPU.
  expert_backend="xla" keeps its traces apart from the other classes' in the jit cache."""

  expert_backend = "xla"
  meshes = (None, (2, 4))

  @pytest.fixture(autouse=True)
  def _as_on_a_gpu(self, monkeypatch):
    monkeypatch.setattr(experts, "on_cpu", lambda: False)
    assert experts.expert_path(self.config(), num_rows=64, local_experts=2) == "ragged_dot"


class TestRaggedDotAllGather(RaggedDotPath):
  scheme = "all_gather"


class TestRaggedDotAllToAll(RaggedDotPath):
  scheme = "all_to_all"


@pytest.mark.filterwarnings("ignore:expert_backend='pallas' on a CPU:UserWarning")
@pytest.mark.filterwarnings("ignore:expert_backend='pallas' falls back:UserWarning")
class PallasPath(LayerContract):
  """The Pallas kernels (in their interpreter on a CPU); options they cannot run take the
  tile loop, with a warning."""

  expert_backend = "pallas"
  meshes = ((2, 4),)
  options = ("softmax", "gelu-top1", "llama4", "phimoe", "qwen2_moe", "longcat")


class TestPallasAllGather(PallasPath):
  scheme = "all_gather"


class TestPallasAllToAll(PallasPath):
  scheme = "all_to_all"
