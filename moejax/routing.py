"""Routing: router logits -> scores -> top-k expert ids and weights, and the router's aux losses.

Everything here runs in float32, whatever the layer's compute dtype (Switch Transformer's
selective precision, Fedus et al. 2021, section 2.4): top-k is decided by small score gaps.

Routing replay: given expert ids (`route(..., given_ids=)`) replace the top-k choice; the
weights stay the live router's, so its gradient still flows. An id outside [0, E + Z), or
one a token already chose, routes nowhere with weight 0 and is counted
(`RouterStats.invalid_choices`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.id_spaces import padding_id


class Routing(NamedTuple):
  """Where each token goes.

  Attributes:
    expert_ids: [T, K] int32 chosen experts, in [0, E + Z) (ids from E are zero-computation
      experts); padding tokens hold E + Z, an id no expert owns.
    weights: [T, K] float32 combine weights; 0 for padding tokens.
    scores: [T, E + Z] float32 scores of the logits (`config.scoring`; softmax for sparsemixer);
      0 for padding tokens.
    invalid: [T, K] bool, given ids (routing replay) of valid tokens that route nowhere;
      all False when the router chose.
    shared_weights: [T, S] float32 each shared expert's weight (`config.shared_expert_scores`:
      its score, renormalized with the chosen experts' and scaled as they are; 0 for padding
      tokens), else None.
  """

  expert_ids: jax.Array
  weights: jax.Array
  scores: jax.Array
  invalid: jax.Array
  shared_weights: jax.Array | None = None


class RouterStats(NamedTuple):
  """Sums over a set of tokens, to be added across devices before they become losses.

  Attributes:
    expert_counts: [E + Z] int32 tokens routed to each expert (each of a token's K choices
      counts).
    score_sums: [E + Z] float32 sum of each expert's score over the valid tokens.
    z_sum: [] float32 sum over valid tokens of logsumexp(logits)**2.
    num_tokens: [] int32 valid tokens.
    invalid_choices: [] int32 given expert ids (routing replay) that routed nowhere: out of
      range, or a token's repeat of an earlier choice; 0 when the router chose.
  """

  expert_counts: jax.Array
  score_sums: jax.Array
  z_sum: jax.Array
  num_tokens: jax.Array
  invalid_choices: jax.Array


def router_logits(
  x: jax.Array,
  router_kernel: jax.Array,
  router_bias: jax.Array | None = None,
) -> jax.Array:
  """The router: [T, D] tokens x [D, E + Z] kernel (+ [E + Z] bias) -> [T, E + Z] float32
  logits, at full precision (`float32_product`).
  """
  logits = float32_product(x, router_kernel)
  return logits if router_bias is None else logits + router_bias.astype(jnp.float32)[None, :]


@jax.custom_vjp
def float32_product(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [T, D] @ kernel [D, N] -> [T, N], both cast to float32, at full precision; its
  gradient keeps x and the kernel as given (x's float32 copy would be twice bf16's bytes).

  HIGHEST, because a GPU's default float32 matmul rounds its inputs to TF32, which flips the
  top-k between near-tied experts (measured on an H200: 7% output error vs the reference).
  """
  return _float32_dot(x, kernel)


def _float32_dot(a: jax.Array, b: jax.Array) -> jax.Array:
  f32 = jnp.float32
  return jnp.dot(a.astype(f32), b.astype(f32), precision=jax.lax.Precision.HIGHEST)


def _float32_product_fwd(x, kernel):
  return _float32_dot(x, kernel), (x, kernel)


def _float32_product_bwd(residuals, d_out):
  x, kernel = residuals  # as given: the kernel the same on every device (`shard_map`), once
  return jax.vjp(_float32_dot, x, kernel)[1](d_out)  # the casts again, not the product


float32_product.defvjp(_float32_product_fwd, _float32_product_bwd)


def route(
  logits: jax.Array,
  token_mask: jax.Array,
  config: MoEConfig,
  routing_bias: jax.Array | None,
  given_ids: jax.Array | None = None,
  shared_logits: jax.Array | None = None,
  given_weights: jax.Array | None = None,
) -> Routing:
  """Chooses K experts per token, as vLLM's `FusedMoE` select_experts does, or takes the given
  ones (routing replay).

  Args:
    logits: [T, E + Z] router logits (cast to float32). Padding rows may hold anything in the
      forward pass; for finite gradients they must be finite (the layer zeroes them once,
      before routing).
    token_mask: [T] bool, True for real tokens.
    config: the layer's config (scoring, groups, renormalize, scaling).
    routing_bias: [E + Z] selection bias, or None when `config.use_routing_bias` is off.
    given_ids: [T, K] int32 expert ids to route to instead of the top-k choice (groups and
      the selection bias then choose nothing), or None. Their weights are the router's
      scores at those ids (for sparsemixer its weight rule around each given pick),
      renormalized and scaled as the config says. Invalid ids (see the module docstring)
      get weight 0 and route nowhere.
    shared_logits: [T, S] the shared experts' logits (`config.shared_expert_scores`), or
      None: their scores join the renormalization and weigh them.
    given_weights: [T, K] the combine weights of `given_ids`, used as they are (no
      renormalization, no scaling; 0 for invalid ids), or None: the router's scores.

  Returns:
    The `Routing` of the T tokens. Padding tokens route to no expert with weight 0.
  """
  logits = logits.astype(jnp.float32)
  valid = None
  if given_ids is not None:
    valid = _valid_choices(given_ids, config.num_router_outputs)
    given_ids = jnp.where(valid, given_ids, 0)
  if config.scoring == "sparsemixer":
    scores = jax.nn.softmax(logits, axis=-1)
    expert_ids, weights = _sparsemixer(logits, config.sparsemixer_eps, given_ids)
  elif given_ids is not None:
    scores = _scores(logits, config)
    expert_ids = given_ids
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
  else:
    scores = _scores(logits, config)
    choice = logits if config.routing_bias_on == "logits" else scores
    if routing_bias is not None:
      choice = choice + routing_bias.astype(jnp.float32)[None, :]
    if config.num_expert_groups > 1:
      choice = _keep_best_groups(choice, config)
    _, expert_ids = jax.lax.top_k(choice, config.top_k)  # [T, K]
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # unbiased scores, [T, K]
  if given_weights is not None:
    weights = given_weights.astype(jnp.float32)
  mask = token_mask[:, None]
  invalid = jnp.zeros(weights.shape, bool)
  if valid is not None:
    weights = jnp.where(valid, weights, 0.0)
    expert_ids = jnp.where(valid, expert_ids, padding_id(config))
    invalid = mask & ~valid
  shared = None if shared_logits is None else _scores(shared_logits.astype(jnp.float32), config)
  if config.renormalize and given_weights is None:
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if shared is not None:
      total = total + jnp.sum(shared, axis=-1, keepdims=True)
    total = jnp.where(total > 0, total, 1.0)  # 0 only when no choice is valid
    weights = weights / total
    shared = None if shared is None else shared / total
  scale = 1.0 if given_weights is not None else config.routed_scaling_factor
  scaled = lambda w: jnp.where(mask, w * scale, 0.0)
  return Routing(
    expert_ids=jnp.where(mask, expert_ids, padding_id(config)).astype(jnp.int32),
    weights=scaled(weights),
    scores=jnp.where(mask, scores, 0.0),
    invalid=invalid,
    shared_weights=None if shared is None else scaled(shared),
  )


def _scores(logits: jax.Array, config: MoEConfig) -> jax.Array:
  """[T, E + Z] float32 scores of the logits: `config.scoring`'s softmax, sigmoid or
  sqrt(softplus) (softplus held at float32's smallest normal number, where it underflows
  below a logit of about -87: sqrt's derivative there would be infinite, its gradient NaN)."""
  if config.scoring == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  if config.scoring == "sqrtsoftplus":
    return jnp.sqrt(jnp.maximum(jax.nn.softplus(logits), jnp.finfo(jnp.float32).tiny))
  return jax.nn.sigmoid(logits)


def _valid_choices(given_ids: jax.Array, num_outputs: int) -> jax.Array:
  """[T, K] bool: each given id in [0, num_outputs) and not a repeat of an earlier choice of
  its token."""
  in_range = (given_ids >= 0) & (given_ids < num_outputs)
  k = given_ids.shape[-1]
  earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [K, K]: j < i
  same = given_ids[:, :, None] == given_ids[:, None, :]  # [T, K, K]
  repeats = jnp.any(same & earlier[None], axis=-1)
  return in_range & ~repeats


def _sparsemixer(
  logits: jax.Array, eps: float, given_ids: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """PhiMoE's sparsemixer top-2, inference form: (ids [T, 2], weights [T, 2]).

  Pick 1 is the argmax; its weight is the softmax over the logits s with
  (max - s) <= 2 eps * max(|s|, max), read at pick 1. Pick 2 is the argmax without pick 1,
  weighted the same way over the logits other than pick 1. Compared, not divided, so a row of
  zeros (0/0) keeps every logit. With `given_ids` ([T, 2], in range) the picks are those
  ids, each weighted by the same rule around its own logit.
  """

  def pick(candidates: jax.Array, given: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    best = jnp.argmax(candidates, axis=-1) if given is None else given  # [T]
    top = jnp.take_along_axis(candidates, best[:, None], axis=-1)  # [T, 1]
    outside = (top - logits) > 2 * eps * jnp.maximum(jnp.abs(logits), top)
    weights = jax.nn.softmax(jnp.where(outside, -jnp.inf, candidates), axis=-1)
    return best, jnp.take_along_axis(weights, best[:, None], axis=-1)[:, 0]

  column = lambda k: None if given_ids is None else given_ids[:, k]
  first, first_weight = pick(logits, column(0))
  without_first = jnp.where(
    jnp.arange(logits.shape[-1])[None, :] == first[:, None], -jnp.inf, logits
  )
  second, second_weight = pick(without_first, column(1))
  return jnp.stack([first, second], axis=-1), jnp.stack([first_weight, second_weight], axis=-1)


def _keep_best_groups(choice: jax.Array, config: MoEConfig) -> jax.Array:
  """Masks the experts outside each token's `topk_groups` best groups: to -inf, or to 0 with
  `config.dropped_groups="zeroed"`.

  A group scores as its best expert, or as the sum of its best two (`config.group_score`:
  DeepSeek-V3's grouped top-k, by default with the routing bias).

  Args:
    choice: [T, E] selection scores.
    config: gives G = num_expert_groups, the kept count topk_groups and the group score.

  Returns:
    [T, E] selection scores with the dropped groups' experts masked.
  """
  tokens, experts = choice.shape
  grouped = choice.reshape(tokens, config.num_expert_groups, -1)  # [T, G, E/G]
  if config.sums_group_top2:
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
  else:
    group_scores = jnp.max(grouped, axis=-1)  # [T, G]
  _, kept = jax.lax.top_k(group_scores, config.topk_groups)  # [T, topk_groups]
  group_kept = jnp.zeros(group_scores.shape, bool).at[jnp.arange(tokens)[:, None], kept].set(True)
  expert_kept = jnp.repeat(group_kept, experts // config.num_expert_groups, axis=-1)  # [T, E]
  dropped = 0.0 if config.dropped_groups == "zeroed" else -jnp.inf
  return jnp.where(expert_kept, choice, dropped)


def router_stats(logits: jax.Array, routing: Routing, token_mask: jax.Array) -> RouterStats:
  """Per-expert loads and the sums behind the aux losses, over the valid tokens.

  Args:
    logits: [T, E + Z] router logits; padding rows as in `route`.
    routing: the tokens' `Routing` (padding already routed nowhere).
    token_mask: [T] bool.

  Returns:
    `RouterStats` of these tokens; add them over devices with `jax.lax.psum`.
  """
  num_experts = logits.shape[-1]
  # Padding holds id E + Z: one-hot over E + Z classes drops it.
  one_hot = jax.nn.one_hot(routing.expert_ids, num_experts, dtype=jnp.int32)  # [T, K, E]
  log_z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [T]
  return RouterStats(
    expert_counts=jnp.sum(one_hot, axis=(0, 1)),
    score_sums=jnp.sum(routing.scores, axis=0),
    z_sum=jnp.sum(jnp.where(token_mask, log_z, 0.0) ** 2),
    num_tokens=jnp.sum(token_mask, dtype=jnp.int32),
    invalid_choices=jnp.sum(routing.invalid, dtype=jnp.int32),
  )


def load_balancing_loss(stats: RouterStats, top_k: int) -> jax.Array:
  """Switch Transformer's auxiliary loss, E * sum_e f_e * P_e (1.0 when perfectly balanced).

  f_e is the fraction of the T·K routing choices that went to expert e, P_e the mean score of
  expert e over the valid tokens. Only P_e carries gradient.

  Args:
    stats: `RouterStats` summed over all devices.
    top_k: K.

  Returns:
    [] float32; 0 when there are no valid tokens.
  """
  num_experts = stats.expert_counts.shape[0]
  tokens = jnp.maximum(stats.num_tokens, 1).astype(jnp.float32)
  fraction = stats.expert_counts.astype(jnp.float32) / (tokens * top_k)  # [E]
  mean_score = stats.score_sums / tokens  # [E]
  return num_experts * jnp.sum(fraction * mean_score)


def router_z_loss(stats: RouterStats) -> jax.Array:
  """ST-MoE's router z-loss, mean over valid tokens of logsumexp(logits)**2 (Zoph et al. 2022).

  Args:
    stats: `RouterStats` summed over all devices.

  Returns:
    [] float32; 0 when there are no valid tokens.
  """
  return stats.z_sum / jnp.maximum(stats.num_tokens, 1).astype(jnp.float32)


def load_max_over_mean(expert_counts: jax.Array) -> jax.Array:
  """The most-loaded expert's count over the mean count: 1.0 when balanced, 0 when nothing
  was routed.

  Args:
    expert_counts: [E] int32 (token, choice) pairs per routed expert.

  Returns:
    [] float32.
  """
  counts = expert_counts.astype(jnp.float32)
  mean = jnp.mean(counts)
  return jnp.where(mean > 0, jnp.max(counts) / jnp.where(mean > 0, mean, 1.0), 0.0)
