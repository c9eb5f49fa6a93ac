"""Routing against the reference's independent implementation, for every option."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import MoEConfig
from moejax.reference import reference_routing
from moejax.routing import (
  load_balancing_loss,
  route,
  router_logits,
  router_stats,
  router_z_loss,
)
from tests.helpers import assert_close, seed_of, tolerance

GROUPS = (
  dict(),
  dict(use_routing_bias=True),
  dict(num_expert_groups=4, topk_groups=2),
  dict(num_expert_groups=4, topk_groups=2, use_routing_bias=True),
  # The group score chosen, not taken from the bias: Mistral 4's, and the other way round.
  dict(num_expert_groups=4, topk_groups=2, group_score="top2_sum"),
  dict(num_expert_groups=4, topk_groups=2, use_routing_bias=True, group_score="max"),
  # Kolibri-1's bias on the logits; A.X-K2's dropped groups at 0, reachable by top-k where
  # biased scores are negative.
  dict(use_routing_bias=True, routing_bias_on="logits"),
  dict(num_expert_groups=4, topk_groups=2, use_routing_bias=True, dropped_groups="zeroed"),
)


def in_fast_tier(scoring: str, renormalize: bool, scale: float, group: int) -> bool:
  """A quarter of the combinations: each scoring with each group choice, renormalize and the
  scaling factor each both ways with each scoring."""
  scaled = (group // 2 == 1) != (scoring == "sigmoid")
  return renormalize == (group % 2 == 1) and (scale == 2.5) == scaled


OPTIONS = [
  pytest.param(
    dict(scoring=scoring, renormalize=renorm, routed_scaling_factor=scale, **GROUPS[group]),
    marks=() if in_fast_tier(scoring, renorm, scale, group) else pytest.mark.slow,
  )
  for scoring, renorm, scale, group in itertools.product(
    ("softmax", "sigmoid", "sqrtsoftplus"), (False, True), (1.0, 2.5), range(len(GROUPS))
  )
]


@pytest.mark.parametrize(
  "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_route_matches_reference(options, request):
  config = MoEConfig(num_experts=16, top_k=3, hidden_size=8, intermediate_size=8, **options)
  k1, k2, k3 = jax.random.split(jax.random.key(seed_of(request.node.name)), 3)
  logits = jax.random.normal(k1, (64, 16)) * 2.0
  bias = jax.random.normal(k2, (16,)) if config.use_routing_bias else None
  if config.dropped_groups == "zeroed":
    bias = bias - 2.0  # kept experts below 0: the dropped ones' 0 wins some choices
  mask = jax.random.bernoulli(k3, 0.7, (64,))
  got = route(logits, mask, config, bias)
  ids, weights = reference_routing(logits, config, bias)
  valid = np.asarray(mask)
  # Compare as sets: top-k order among the chosen is not part of the contract.
  got_order = np.argsort(np.asarray(got.expert_ids), axis=-1)
  ref_order = np.argsort(np.asarray(ids), axis=-1)
  got_ids = np.take_along_axis(np.asarray(got.expert_ids), got_order, -1)
  ref_ids = np.take_along_axis(np.asarray(ids), ref_order, -1)
  np.testing.assert_array_equal(got_ids[valid], ref_ids[valid])
  assert_close(
    np.take_along_axis(np.asarray(got.weights), got_order, -1)[valid],
    np.take_along_axis(np.asarray(weights), ref_order, -1)[valid],
    what="weights",
  )


def test_grouped_topk_stays_in_kept_groups(request):
  config = MoEConfig(
    num_experts=16, top_k=4, hidden_size=8, intermediate_size=8, num_expert_groups=8, topk_groups=2
  )
  logits = jax.random.normal(jax.random.key(seed_of(request.node.name)), (128, 16))
  ids = np.asarray(route(logits, jnp.ones(128, bool), config, None).expert_ids)
  groups_used = {len(set(row // 2)) for row in ids}
  assert groups_used <= {1, 2}, groups_used


def test_bias_selects_but_does_not_weight(request):
  config = MoEConfig(
    num_experts=8, top_k=1, hidden_size=8, intermediate_size=8, use_routing_bias=True
  )
  logits = jax.random.normal(jax.random.key(seed_of(request.node.name)), (32, 8))
  bias = jnp.zeros(8).at[5].set(100.0)  # forces expert 5
  got = route(logits, jnp.ones(32, bool), config, bias)
  assert np.all(np.asarray(got.expert_ids) == 5)
  assert_close(got.weights[:, 0], jax.nn.softmax(logits)[:, 5], what="unbiased weights")


def test_padding_routes_nowhere_even_if_nan(request):
  config = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8)
  logits = jax.random.normal(jax.random.key(seed_of(request.node.name)), (16, 8))
  mask = jnp.arange(16) % 3 != 0
  logits = jnp.where(mask[:, None], logits, jnp.nan)
  got = route(logits, mask, config, None)
  pad = ~np.asarray(mask)
  assert np.all(np.asarray(got.expert_ids)[pad] == 8)
  assert np.all(np.asarray(got.weights)[pad] == 0)
  assert np.all(np.isfinite(np.asarray(got.weights)))


def test_aux_losses_match_formulas(request):
  config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
  k1, k2 = jax.random.split(jax.random.key(seed_of(request.node.name)))
  logits = jax.random.normal(k1, (40, 4))
  mask = jax.random.bernoulli(k2, 0.6, (40,))
  routing = route(logits, mask, config, None)
  stats = router_stats(logits, routing, mask)
  valid = np.asarray(mask)
  ids = np.asarray(routing.expert_ids)[valid]
  counts = np.bincount(ids.reshape(-1), minlength=4)
  np.testing.assert_array_equal(np.asarray(stats.expert_counts), counts)
  probs = np.asarray(jax.nn.softmax(logits))[valid]
  expected_lb = 4 * np.sum(counts / (valid.sum() * 2) * probs.mean(0))
  assert_close(load_balancing_loss(stats, 2), expected_lb, what="load balancing loss")
  log_z = np.log(np.exp(np.asarray(logits)[valid]).sum(-1))
  assert_close(router_z_loss(stats), np.mean(log_z**2), what="z-loss")


def test_aux_losses_are_zero_without_tokens():
  config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
  logits = jnp.full((8, 4), jnp.nan)
  mask = jnp.zeros(8, bool)
  stats = router_stats(logits, route(logits, mask, config, None), mask)
  assert float(load_balancing_loss(stats, 2)) == 0.0
  assert float(router_z_loss(stats)) == 0.0


def test_router_matmul_runs_at_full_float32_precision():
  """A GPU's default float32 matmul is TF32, which flipped top-k choices on an H200 (7% layer
  error); XLA:CPU has no TF32, so the precision itself is what this test can check."""
  x = jax.random.normal(jax.random.key(0), (4, 8), jnp.bfloat16)
  kernel = jax.random.normal(jax.random.key(1), (8, 3))
  jaxpr = str(jax.make_jaxpr(router_logits)(x, kernel))
  assert "dot_general" in jaxpr and "Precision.HIGHEST" in jaxpr
  chex.assert_trees_all_close(
    router_logits(x, kernel), x.astype(jnp.float32) @ kernel, **tolerance(comparison="reordered")
  )


def test_sqrt_softplus_scores_have_finite_gradients_where_softplus_underflows():
  """A logit of -200 underflows softplus to 0 in float32: the score is ~0 and its gradient
  finite (not sqrt's infinite derivative at 0 times 0)."""
  config = MoEConfig(
    num_experts=4, top_k=2, hidden_size=8, intermediate_size=8, scoring="sqrtsoftplus"
  )
  logits = jnp.array([[-200.0, 0.5, 2.0, -1.0]])
  score_sum = lambda z: route(z, jnp.ones(1, bool), config, None).scores.sum()
  gradient = jax.grad(score_sum)(logits)
  assert np.all(np.isfinite(np.asarray(gradient))), gradient
  chex.assert_trees_all_close(
    gradient[0, 2], jax.nn.sigmoid(2.0) / (2 * jnp.sqrt(jax.nn.softplus(2.0))), rtol=1e-6
  )
