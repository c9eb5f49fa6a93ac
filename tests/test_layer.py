"""The layer against the dense reference: meshes, token patterns, chunk sizes, NaN padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import MoEConfig, moe_apply, reference_moe
from moejax.testing import poison, random_params, rank_mask
from tests.helpers import SCHEMES, assert_close, mesh_of, seed_of, slow

ROWS_PER_RANK = 12


def small_config(**overrides) -> MoEConfig:
  base = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32, chunk_size=5)
  return MoEConfig(**{**base, **overrides})


def patterns(ranks: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Per-rank valid counts: some ranks empty and one full, every rank empty, every rank full."""
  uneven = rng.integers(0, ROWS_PER_RANK + 1, size=ranks)
  uneven[0] = 0
  uneven[-1] = ROWS_PER_RANK
  if ranks > 2:
    uneven[ranks // 2] = 0
  return {
    "uneven": uneven,
    "all_empty": np.zeros(ranks, int),
    "all_full": np.full(ranks, ROWS_PER_RANK),
  }


def inputs(config: MoEConfig, ranks: int, name: str):
  key = jax.random.key(seed_of(name))
  k_params, k_x = jax.random.split(key)
  params = random_params(config, k_params)
  x = jax.random.normal(k_x, (ranks * ROWS_PER_RANK, config.hidden_size))
  return params, x, np.random.default_rng(seed_of(name))


def test_chunks_skip_only_when_the_whole_expert_group_is_empty():
  config = small_config(chunk_size=4)  # 3 chunks of 4 rows per rank
  params, x, _ = inputs(config, 8, "skip")
  # Data group 0: one rank with 5 tokens (chunks 0, 1), the others empty. Group 1: all empty.
  mask = rank_mask([0, 5, 0, 0, 0, 0, 0, 0], ROWS_PER_RANK)
  _, aux = moe_apply(params, x, config=config, mesh=mesh_of(2, 4), token_mask=mask)
  np.testing.assert_array_equal(np.asarray(aux.chunks_run), [2, 2, 2, 2, 0, 0, 0, 0])


@pytest.mark.parametrize("chunk_size", [slow(1), 5, 12, slow(64)])
def test_output_independent_of_chunk_size_and_mesh(chunk_size, request):
  config = small_config(chunk_size=chunk_size)
  params, x, rng = inputs(config, 8, "chunk-independence")  # same inputs for every chunk size
  mask = rank_mask(patterns(8, rng)["uneven"], ROWS_PER_RANK)
  expected = reference_moe(params, x, config, mask)
  for mesh_shape in [(2, 4), (8, 1)]:
    y, _ = moe_apply(params, x, config=config, mesh=mesh_of(*mesh_shape), token_mask=mask)
    assert_close(y, expected, what=f"y, chunk_size={chunk_size}, mesh={mesh_shape}")


ROUTING_OPTIONS = {
  "sigmoid-renorm-scaled": dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5),
  "grouped": dict(num_expert_groups=4, topk_groups=2, top_k=3),
  "grouped-bias-shared": dict(
    num_expert_groups=4,
    topk_groups=2,
    use_routing_bias=True,
    scoring="sigmoid",
    renormalize=True,
    num_shared_experts=2,
    shared_intermediate_size=24,
  ),
  "gelu-top1": dict(activation="gelu", top_k=1),
  "all-experts": dict(top_k=8, chunk_size=3),
}


def test_leading_dims_and_tokens_not_divisible_by_mesh(request):
  config = small_config(num_shared_experts=1, shared_intermediate_size=8)
  key = jax.random.key(seed_of(request.node.name))
  params = random_params(config, key)
  x = jax.random.normal(jax.random.fold_in(key, 1), (3, 7, config.hidden_size))  # T = 21
  mask = jax.random.bernoulli(jax.random.fold_in(key, 2), 0.7, (3, 7))
  for mesh in (None, mesh_of(2, 4)):
    y, _ = moe_apply(params, poison(x, mask), config=config, mesh=mesh, token_mask=mask)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, reference_moe(params, x, config, mask), what=f"y, mesh={mesh}")
  y, _ = moe_apply(params, x, config=config, mesh=mesh_of(4, 2))  # no mask: all real
  assert_close(y, reference_moe(params, x, config), what="y without mask")


@pytest.mark.parametrize(
  "param_dtype, scheme",
  [slow(jnp.float32, "all_gather"), slow(jnp.bfloat16, "all_gather"), (jnp.bfloat16, "all_to_all")],
)
def test_bfloat16_compute(param_dtype, scheme, request):
  config = small_config(dtype=jnp.bfloat16, param_dtype=param_dtype, dispatch=scheme)
  params, x, rng = inputs(config, 8, request.node.name)
  mask = rank_mask(patterns(8, rng)["uneven"], ROWS_PER_RANK)
  x = x.astype(jnp.bfloat16)
  y, _ = moe_apply(params, poison(x, mask), config=config, mesh=mesh_of(2, 4), token_mask=mask)
  assert y.dtype == jnp.bfloat16
  assert_close(y, reference_moe(params, x, config, mask), jnp.bfloat16, what="bf16 y")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_explicit_axes_mesh_from_make_mesh(scheme, request):
  config = small_config(dispatch=scheme)
  params, x, rng = inputs(config, 8, request.node.name)
  mask = rank_mask(patterns(8, rng)["uneven"], ROWS_PER_RANK)
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  expected = reference_moe(params, x, config, mask)  # outside the mesh context, on one device
  with jax.set_mesh(mesh):
    y, _ = moe_apply(params, x, config=config, mesh=mesh, token_mask=mask)
  assert_close(y, expected, what="y")


def test_custom_axis_names(request):
  config = small_config(data_axis="dp", expert_axis="ep")
  params, x, rng = inputs(config, 8, request.node.name)
  mask = rank_mask(patterns(8, rng)["uneven"], ROWS_PER_RANK)
  y, _ = moe_apply(
    params, x, config=config, mesh=mesh_of(4, 2, axis_names=("dp", "ep")), token_mask=mask
  )
  assert_close(y, reference_moe(params, x, config, mask), what="y")
