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

# A decode step, a few tokens, more than two of the router's blocks, past 512 (where routing
# outside fixed blocks once varied) and a large call.
SIZES = (1, 7, 300, 513, 2048)
LARGE = 8192
COMPOSITIONS = 2  # random calls per size (other tokens, position, mask): one program each
OTHER_CHUNK_SIZES_AT = (176, 513)  # the sizes each further chunk size is probed at

INVARIANT = MoEConfig(**{**BASE, **RICH}, batch_invariant=True)
# name: (config fields, mesh shape or None, sizes, chunk sizes)
CASES = {
  "tile_loop-f32-one_device": (dict(), None, (*SIZES, LARGE), (4, 16, 25, 64)),
  "tile_loop-bf16-all_to_all": (
    dict(dtype=jnp.bfloat16, dispatch="all_to_all"),
    (2, 4),
    (*SIZES, LARGE),
    (4, 25),
  ),
  "tile_loop-bf16-all_gather": (
    dict(dtype=jnp.bfloat16, dispatch="all_gather"),
    (2, 4),
    SIZES,
    (4, 16, 20),
  ),
  "tile_loop-f32-all_gather": (dict(dispatch="all_gather"), (4, 2), SIZES, ("auto",)),
  "pallas-bf16-all_to_all": (
    dict(
      dtype=jnp.bfloat16,
      dispatch="all_to_all",
      expert_backend="pallas",
      num_expert_groups=1,
      topk_groups=1,
    ),
    (2, 4),
    SIZES[:4],  # interpreted: slow per row
    (4,),
  ),
  "fused-f32-one_device": (  # interpreted, in the slow tier
    dict(expert_backend="fused", intermediate_size=32),
    None,
    SIZES[:4],
    (4,),
  ),
  "fused-fp8-one_device": (  # fp8_deepseek's 128-wide groups; interpreted, slow tier
    dict(
      expert_backend="fused",
      compute_quant="fp8_deepseek",
      hidden_size=128,
      intermediate_size=128,
    ),
    None,
    SIZES[:4],
    (4,),
  ),
}
SLOW_CASES = ("fused-f32-one_device", "fused-fp8-one_device")
FORMATS = ("fp8_block", "mxfp4", "nvfp4", "int4_group")


def probe_results(
  config: MoEConfig, params, mesh, seed: int, sizes=SIZES, chunk_sizes=(None,)
) -> list[tuple[np.ndarray, ...]]:
  """(y, expert ids, expert weights) of one probe token in calls of every size in `sizes`
  (the first chunk size's; each further one's at `OTHER_CHUNK_SIZES_AT`), each among other
  random tokens, at a random position, with a random mask and NaN-poisoned padding."""
  rng = np.random.default_rng(seed)
  probe = rng.normal(size=config.hidden_size).astype(np.float32)
  found = []
  for index, chunk_size in enumerate(chunk_sizes):
    chunked = config if chunk_size is None else dataclasses.replace(config, chunk_size=chunk_size)
    for size in sizes if index == 0 else OTHER_CHUNK_SIZES_AT:
      for _ in range(COMPOSITIONS):
        x = rng.normal(size=(size, config.hidden_size)).astype(np.float32)
        at = rng.integers(size)
        x[at] = probe
        mask = rng.random(size) < 0.7
        mask[at] = True
        x = jnp.asarray(x).astype(config.dtype)
        y, aux = moe_apply(
          params, poison(x, jnp.asarray(mask)), config=chunked, mesh=mesh, token_mask=mask
        )
        outputs = (y.astype(jnp.float32), aux.expert_ids, aux.expert_weights)
        found.append(tuple(np.asarray(a[at]) for a in outputs))
  return found


def assert_all_identical(found: list[tuple[np.ndarray, ...]]) -> None:
  for result in found[1:]:
    for name, got, want in zip(("y", "ids", "weights"), result, found[0], strict=True):
      assert got.tobytes() == want.tobytes(), f"{name} not bit-identical: {got} vs {want}"


@pytest.mark.parametrize(
  "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES]
)
def test_a_tokens_output_does_not_depend_on_the_rest_of_the_call(case, request):
  fields, mesh_shape, sizes, chunk_sizes = CASES[case]
  config = dataclasses.replace(INVARIANT, **fields)
  seed = seed_of(request.node.name)
  params = random_params(config, jax.random.key(seed))
  params = params._replace(routing_bias=0.1 * jax.random.normal(jax.random.key(seed), (8,)))
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "expert_backend='(pallas|fused)' on a CPU")
    found = probe_results(config, params, mesh, seed, sizes, chunk_sizes)
  assert len(found) == COMPOSITIONS * (len(sizes) + 2 * (len(chunk_sizes) - 1))
  assert_all_identical(found)


@pytest.mark.parametrize(
  "expert_quant, mesh_shape",
  [
    pytest.param("fp8_block", None, id="fp8_block-one_device"),  # where they once varied
    pytest.param("fp8_block", (2, 4), id="fp8_block-2x4"),
    *(
      pytest.param(f, (2, 4), id=f"{f}-2x4", marks=pytest.mark.slow)
      for f in FORMATS
      if f != "fp8_block"
    ),
  ],
)
def test_quantized_experts_are_batch_invariant(expert_quant, mesh_shape, request):
  seed = seed_of(request.node.name)
  float_config = dataclasses.replace(
    INVARIANT, dtype=jnp.bfloat16, hidden_size=32, intermediate_size=32, dispatch="all_to_all"
  )
  params = random_params(float_config, jax.random.key(seed))
  params, config = quant.quantize_experts(params, float_config, expert_quant)
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
  assert_all_identical(probe_results(config, params, mesh, seed))


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
