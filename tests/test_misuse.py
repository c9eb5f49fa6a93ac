"""Hardening: a NaN or Inf in a real token stays in that token; property-based checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moejax import MoEConfig, moe_apply, reference_moe
from moejax.testing import poison, random_params, rank_mask
from tests.helpers import SMALL_SHARED, assert_close, mesh_of, seed_of

CONFIG = SMALL_SHARED


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf], ids=["nan", "inf"])
def test_a_bad_real_token_only_affects_itself(bad, request):
  key = jax.random.key(seed_of(request.node.name))
  params = random_params(CONFIG, key)
  x = jax.random.normal(jax.random.fold_in(key, 1), (48, 16))
  probe = jax.random.normal(jax.random.fold_in(key, 2), (48, 16))
  mask = rank_mask([6, 6, 3, 0, 6, 2, 6, 6], 6)
  victim = 13  # a real token on rank 2
  x_bad = x.at[victim, 5].set(bad)
  others = np.asarray(mask).copy()
  others[victim] = False
  mesh = mesh_of(2, 4)

  def loss(x):
    y, _ = moe_apply(params, x, config=CONFIG, mesh=mesh, token_mask=mask)
    return jnp.sum(y * probe), y

  (_, y), dx = jax.value_and_grad(loss, has_aux=True)(x_bad)
  (_, y_clean), dx_clean = jax.value_and_grad(loss, has_aux=True)(x)
  assert not np.all(np.isfinite(np.asarray(y[victim])))
  assert_close(np.asarray(y)[others], np.asarray(y_clean)[others], what="other tokens' outputs")
  assert_close(np.asarray(dx)[others], np.asarray(dx_clean)[others], what="other tokens' grads")


SETTINGS = settings(
  max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@st.composite
def layer_cases(draw):
  """A random config, mesh, chunk size and per-rank token counts (empty ranks included)."""
  experts = draw(st.sampled_from([4, 8]))
  groups = draw(st.sampled_from([g for g in (1, 2, 4) if experts % g == 0]))
  kept = draw(st.integers(1, groups))
  bias = draw(st.booleans()) and experts // groups >= 2
  config = MoEConfig(
    num_experts=experts,
    top_k=draw(st.integers(1, min(3, kept * experts // groups))),
    hidden_size=8,
    intermediate_size=draw(st.sampled_from([8, 12])),
    chunk_size=draw(st.integers(1, 9)),
    activation=draw(st.sampled_from(["silu", "gelu"])),
    scoring=draw(st.sampled_from(["softmax", "sigmoid"])),
    renormalize=draw(st.booleans()),
    num_expert_groups=groups,
    topk_groups=kept,
    use_routing_bias=bias,
    routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
    num_shared_experts=(shared := draw(st.integers(0, 1))),
    shared_intermediate_size=8 * shared,
  )
  mesh_shape = draw(st.sampled_from([(1, 1), (2, 4), (4, 2), (8, 1), (1, 4), (2, 2)]))
  ranks = mesh_shape[0] * mesh_shape[1]
  rows = draw(st.integers(1, 7))
  counts = draw(st.lists(st.integers(0, rows), min_size=ranks, max_size=ranks))
  return config, mesh_shape, rows, counts, draw(st.integers(0, 2**31 - 1))


@pytest.mark.slow
@SETTINGS
@given(layer_cases())
def test_random_configs_match_reference(case):
  config, mesh_shape, rows, counts, seed = case
  if config.num_experts % mesh_shape[1]:
    mesh_shape = (mesh_shape[0] * mesh_shape[1], 1)
  key = jax.random.key(seed)
  params = random_params(config, key)
  if config.use_routing_bias:
    params = params._replace(routing_bias=jax.random.normal(key, (config.num_experts,)))
  ranks = mesh_shape[0] * mesh_shape[1]
  x = jax.random.normal(jax.random.fold_in(key, 1), (ranks * rows, 8))
  mask = rank_mask(counts, rows)
  y, aux = moe_apply(
    params, poison(x, mask), config=config, mesh=mesh_of(*mesh_shape), token_mask=mask
  )
  assert_close(y, reference_moe(params, x, config, mask), what=f"y {config} mesh {mesh_shape}")
  assert np.all(np.asarray(y)[~np.asarray(mask)] == 0)
  assert int(aux.expert_counts.sum()) == config.top_k * int(mask.sum())
  # The same tokens on one device, in one chunk, give the same output.
  single, _ = moe_apply(
    params, x, config=MoEConfig(**{**config.__dict__, "chunk_size": 256}), token_mask=mask
  )
  assert_close(y, single, what="independent of mesh and chunk size")
