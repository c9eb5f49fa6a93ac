"""A plain, obviously correct MoE layer: every expert on every token, float32, no mesh, no chunks.

The oracle of the tests. It shares no routing or expert code with the fast path: routing is
spelled out with sorts and per-group loops, and the experts run densely over all tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.params import MoEParams

_HIGHEST = jax.lax.Precision.HIGHEST


def _mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, activation: str) -> jax.Array:
  """[T, D] -> [T, D] gated MLP in float32."""
  half = w_gate_up.shape[-1] // 2
  gate = jnp.matmul(x, w_gate_up[:, :half], precision=_HIGHEST)
  up = jnp.matmul(x, w_gate_up[:, half:], precision=_HIGHEST)
  if activation == "silu":
    act = gate / (1.0 + jnp.exp(-gate))
  else:
    act = 0.5 * gate * (1.0 + jax.scipy.special.erf(gate / jnp.sqrt(2.0)))
  return jnp.matmul(act * up, w_down, precision=_HIGHEST)


def reference_routing(
  logits: jax.Array, config: MoEConfig, routing_bias: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
  """[T, E] float32 logits -> (expert ids [T, K], weights [T, K]), vLLM's semantics."""
  if config.scoring == "softmax":
    scores = jnp.exp(logits - logits.max(-1, keepdims=True))
    scores = scores / scores.sum(-1, keepdims=True)
  else:
    scores = 1.0 / (1.0 + jnp.exp(-logits))
  choice = scores if routing_bias is None else scores + routing_bias[None, :]
  groups = config.num_expert_groups
  if groups > 1:
    size = config.num_experts // groups
    group_scores = []
    for g in range(groups):
      members = jnp.sort(choice[:, g * size : (g + 1) * size], axis=-1)
      group_scores.append(members[:, -2:].sum(-1) if routing_bias is not None else members[:, -1])
    ranked_groups = jnp.argsort(-jnp.stack(group_scores, axis=-1), axis=-1)
    kept = ranked_groups[:, : config.topk_groups]  # [T, topk_groups]
    expert_group = jnp.arange(config.num_experts) // size  # [E]
    in_kept = (expert_group[None, :, None] == kept[:, None, :]).any(-1)  # [T, E]
    choice = jnp.where(in_kept, choice, -jnp.inf)
  ids = jnp.argsort(-choice, axis=-1, stable=True)[:, : config.top_k]
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if config.renormalize:
    weights = weights / weights.sum(-1, keepdims=True)
  return ids, weights * config.routed_scaling_factor


def reference_moe(
  params: MoEParams,
  x: jax.Array,
  config: MoEConfig,
  token_mask: jax.Array | None = None,
  router_logits: jax.Array | None = None,
) -> jax.Array:
  """The MoE layer computed densely in float32.

  Args:
    params: `MoEParams`.
    x: [..., D] tokens.
    config: the layer's config.
    token_mask: [...] bool or None.
    router_logits: [..., E] or None (then computed from `params.router_kernel`).

  Returns:
    [..., D] float32; rows whose mask is False are 0.
  """
  f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
  p = jax.tree.map(f32, params)
  tokens = f32(x).reshape(-1, config.hidden_size)
  mask = jnp.ones(tokens.shape[0], bool) if token_mask is None else token_mask.reshape(-1)
  tokens = jnp.where(mask[:, None], tokens, 0.0)
  if router_logits is None:
    logits = jnp.matmul(tokens, p.router_kernel, precision=_HIGHEST)
  else:
    logits = f32(router_logits).reshape(tokens.shape[0], -1)
  logits = jnp.where(mask[:, None], logits, 0.0)
  ids, weights = reference_routing(logits, config, p.routing_bias)
  every_expert = jnp.stack(
    [
      _mlp(tokens, p.w_gate_up[e], p.w_down[e], config.activation)
      for e in range(config.num_experts)
    ]
  )  # [E, T, D]
  chosen = every_expert[ids, jnp.arange(tokens.shape[0])[:, None]]  # [T, K, D]
  y = jnp.sum(weights[..., None] * chosen, axis=1)
  if config.has_shared_experts:
    y = y + _mlp(tokens, p.shared_w_gate_up, p.shared_w_down, config.activation)
  y = jnp.where(mask[:, None], y, 0.0)
  return y.reshape(*x.shape[:-1], config.hidden_size)
