"""Batch invariance (`MoEConfig.batch_invariant`): a token's output, expert ids and weights are
bit-identical whatever else is in the call (other tokens, their number, its position,
padding, the mask, the chunk size), on one device and on a mesh, for every path and
quantized format the CPU runs. Bit equality, no tolerance."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import MoEConfig, moe_apply, quant
from moejax.testing import poison, random_params
from tests.helpers import BASE, RICH, mesh_of, seed_of

SIZES = (1, 7, 300)  # a decode step, a few tokens, more than two of the router's blocks
COMPOSITIONS = 2  # random calls per size (other tokens, position, mask): one program each

INVARIANT = MoEConfig(**{**BASE, **RICH}, batch_invariant=True)
CASES = {
  "tile_loop-f32-one_device": (dict(), None),
  "tile_loop-bf16-all_to_all": (dict(dtype=jnp.bfloat16, dispatch="all_to_all"), (2, 4)),
  "tile_loop-f32-all_gather": (dict(dispatch="all_gather", chunk_size="auto"), (4, 2)),
  "pallas-bf16-all_to_all": (
    dict(
      dtype=jnp.bfloat16,
      dispatch="all_to_all",
      expert_backend="pallas",
      num_expert_groups=1,
      topk_groups=1,
    ),
    (2, 4),
  ),
}
FORMATS = ("fp8_block", "mxfp4", "nvfp4", "int4_group")


def probe_results(config: MoEConfig, params, mesh, seed: int) -> list[tuple[np.ndarray, ...]]:
  """(y, expert ids, expert weights) of one probe token in calls of every size in `SIZES`,
  each among other random tokens, at a random position, with a random mask and NaN-poisoned
  padding."""
  rng = np.random.default_rng(seed)
  probe = rng.normal(size=config.hidden_size).astype(np.float32)
  found = []
  for size in SIZES:
    for _ in range(COMPOSITIONS):
      x = rng.normal(size=(size, config.hidden_size)).astype(np.float32)
      at = rng.integers(size)
      x[at] = probe
      mask = rng.random(size) < 0.7
      mask[at] = True
      x = jnp.asarray(x).astype(config.dtype)
      y, aux = moe_apply(
        params, poison(x, jnp.asarray(mask)), config=config, mesh=mesh, token_mask=mask
      )
      found.append(
        tuple(
          np.asarray(a[at]) for a in (y.astype(jnp.float32), aux.expert_ids, aux.expert_weights)
        )
      )
  return found


def assert_all_identical(found: list[tuple[np.ndarray, ...]]) -> None:
  for result in found[1:]:
    for name, got, want in zip(("y", "ids", "weights"), result, found[0], strict=True):
      assert got.tobytes() == want.tobytes(), f"{name} not bit-identical: {got} vs {want}"


@pytest.mark.parametrize("case", list(CASES))
def test_a_tokens_output_does_not_depend_on_the_rest_of_the_call(case, request):
  fields, mesh_shape = CASES[case]
  config = dataclasses.replace(INVARIANT, **fields)
  seed = seed_of(request.node.name)
  params = random_params(config, jax.random.key(seed))
  params = params._replace(routing_bias=0.1 * jax.random.normal(jax.random.key(seed), (8,)))
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "expert_backend='pallas' on a CPU")
    found = probe_results(config, params, mesh, seed)
    if case == "tile_loop-f32-one_device":  # and whatever the chunk size
      other_chunk = dataclasses.replace(config, chunk_size=16)
      found += probe_results(other_chunk, params, mesh, seed)[:: COMPOSITIONS * 2]
  assert_all_identical(found)


@pytest.mark.parametrize(
  "expert_quant",
  [pytest.param(f, marks=() if f == "fp8_block" else pytest.mark.slow) for f in FORMATS],
)
def test_quantized_experts_are_batch_invariant(expert_quant, request):
  seed = seed_of(request.node.name)
  float_config = dataclasses.replace(
    INVARIANT, dtype=jnp.bfloat16, hidden_size=32, intermediate_size=32, dispatch="all_to_all"
  )
  params = random_params(float_config, jax.random.key(seed))
  params, config = quant.quantize_experts(params, float_config, expert_quant)
  assert_all_identical(probe_results(config, params, mesh_of(2, 4), seed))


def test_gradients_are_bit_identical_run_to_run(request):
  seed = seed_of(request.node.name)
  config = dataclasses.replace(INVARIANT, dispatch="all_to_all")
  params = random_params(config, jax.random.key(seed))
  x = jax.random.normal(jax.random.key(seed + 1), (40, 16))
  mesh = mesh_of(2, 4)
  loss = lambda p, x: jnp.sum(jnp.sin(moe_apply(p, x, config=config, mesh=mesh)[0]))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))
  first, second = grads(params, x), grads(params, x)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert any(float(jnp.abs(leaf).max()) > 0 for leaf in jax.tree.leaves(first))
