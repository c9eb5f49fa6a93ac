"""A plain, obviously correct MoE layer: every expert on every token, float32, no mesh, no chunks.

The oracle of the tests. It shares no routing or expert code with the fast path: routing is
spelled out with sorts and per-group loops, and the experts run densely over all tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.quantized import is_block_scaled
from moejax import meshes
from moejax.call_record import call_record
from moejax.config import MoEConfig
from moejax.expert_placement import Placement
from moejax.inputs import check_call
from moejax.params import PER_EXPERT_FIELDS, MoEParams

_HIGHEST = jax.lax.Precision.HIGHEST


def _hidden(
  gate: jax.Array, up: jax.Array, activation, config: MoEConfig, limit: float
) -> jax.Array:
  """The gated MLP's hidden layer, each activation written out (`limit`: the clamps'); a
  caller's own function, as it is."""
  if callable(activation):
    return activation(gate, up)
  if activation == "swiglu_clamped_after":
    return jnp.minimum(gate / (1.0 + jnp.exp(-gate)), limit) * jnp.clip(up, -limit, limit)
  if activation in ("swiglu_oai", "swiglu_clamped"):
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    if activation == "swiglu_oai":
      return (up + 1.0) * gate / (1.0 + jnp.exp(-config.swiglu_alpha * gate))
  if activation == "swiglu_softcapped":
    cap = lambda x, c: c * jnp.tanh(x / c)
    up = cap(up, config.up_softcap)
    return cap(gate, config.gate_softcap) / (1.0 + jnp.exp(-gate)) * up
  if activation in ("silu", "swiglu_clamped"):
    act = gate / (1.0 + jnp.exp(-gate))
  elif activation == "relu":
    act = jnp.maximum(gate, 0.0)
  elif activation == "gelu":
    act = 0.5 * gate * (1.0 + jax.scipy.special.erf(gate / jnp.sqrt(2.0)))
  else:  # gelu_tanh
    act = 0.5 * gate * (1.0 + jnp.tanh(jnp.sqrt(2.0 / jnp.pi) * (gate + 0.044715 * gate**3)))
  return act * up


def _rms_norm(rows: jax.Array, eps: float) -> jax.Array:
  """Each row divided by its root mean square (eps added to the mean square), no scale."""
  return rows / jnp.sqrt(jnp.mean(rows * rows, axis=-1, keepdims=True) + eps)


def _mlp(
  x,
  w_gate_up,
  w_down,
  config: MoEConfig,
  b_gate_up=None,
  b_down=None,
  *,
  activation=None,
  limit=None,
) -> jax.Array:
  """[T, D] -> [T, D] gated MLP in float32 (biases optional), with `activation` and its
  clamp `limit` (default the routed experts': `config.activation`, `config.swiglu_limit`)."""
  half = w_gate_up.shape[-1] // 2
  gate = jnp.matmul(x, w_gate_up[:, :half], precision=_HIGHEST)
  up = jnp.matmul(x, w_gate_up[:, half:], precision=_HIGHEST)
  if b_gate_up is not None:
    gate, up = gate + b_gate_up[None, :half], up + b_gate_up[None, half:]
  limit = config.swiglu_limit if limit is None else limit
  hidden = _hidden(gate, up, activation or config.activation, config, limit)
  out = jnp.matmul(hidden, w_down, precision=_HIGHEST)
  return out if b_down is None else out + b_down[None, :]


def _sparsemixer_routing(
  logits: jax.Array, eps: float, given_ids: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
  """PhiMoE's inference routing, as its modeling code writes it (with the division); given
  ids replace its two argmax picks."""
  ranked = jnp.argsort(-logits, axis=-1, stable=True) if given_ids is None else given_ids
  ids, weights = [], []
  candidates = logits
  for _ in range(2):
    best = ranked[:, len(ids)]
    top = jnp.take_along_axis(logits, best[:, None], axis=-1)
    factor = jnp.maximum(jnp.abs(logits), top)
    dropped = ((top - logits) / factor) > 2 * eps
    kept = jnp.where(dropped, -jnp.inf, candidates)
    gates = jnp.exp(kept - top) / jnp.sum(jnp.exp(kept - top), axis=-1, keepdims=True)
    ids.append(best)
    weights.append(jnp.take_along_axis(gates, best[:, None], axis=-1)[:, 0])
    candidates = jnp.where(jnp.arange(logits.shape[-1])[None, :] == best[:, None], -jnp.inf, logits)
  return jnp.stack(ids, axis=-1), jnp.stack(weights, axis=-1)


def _usable(given_ids: jax.Array, num_outputs: int) -> jax.Array:
  """[T, K] bool: a given id is in range and no earlier choice of its token repeats it."""
  columns = []
  for k in range(given_ids.shape[1]):
    ok = (given_ids[:, k] >= 0) & (given_ids[:, k] < num_outputs)
    for j in range(k):
      ok = ok & (given_ids[:, j] != given_ids[:, k])
    columns.append(ok)
  return jnp.stack(columns, axis=-1)


def reference_routing(
  logits: jax.Array,
  config: MoEConfig,
  routing_bias: jax.Array | None,
  given_ids: jax.Array | None = None,
  given_weights: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """[T, E + Z] float32 logits -> (expert ids [T, K], weights [T, K]), vLLM's semantics; with
  `given_ids` [T, K] those ids (routing replay): unusable ones (out of range, repeated) get
  id E + Z and weight 0; with `given_weights` [T, K] too, those weights as they are."""
  if given_ids is None:
    return _chosen_routing(logits, config, routing_bias)
  usable = _usable(given_ids, config.num_router_outputs)
  safe_ids = jnp.where(usable, given_ids, 0)
  ids = jnp.where(usable, given_ids, config.num_router_outputs)
  if given_weights is not None:
    return ids, jnp.where(usable, given_weights, 0.0)
  if config.scoring == "sparsemixer":
    _, weights = _sparsemixer_routing(logits, config.sparsemixer_eps, safe_ids)
  else:
    weights = jnp.take_along_axis(_scores(logits, config), safe_ids, axis=-1)
  weights = jnp.where(usable, weights, 0.0)
  if config.renormalize:
    total = weights.sum(-1, keepdims=True)
    weights = jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), 0.0)
  return ids, weights * config.routed_scaling_factor


def _scores(logits: jax.Array, config: MoEConfig) -> jax.Array:
  """Softmax, sigmoid or sqrt(softplus) scores, written out."""
  if config.scoring == "softmax":
    scores = jnp.exp(logits - logits.max(-1, keepdims=True))
    return scores / scores.sum(-1, keepdims=True)
  if config.scoring == "sqrtsoftplus":
    return jnp.sqrt(jnp.logaddexp(0.0, logits))
  return 1.0 / (1.0 + jnp.exp(-logits))


def _chosen_routing(
  logits: jax.Array, config: MoEConfig, routing_bias: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
  """The router's own choice: (expert ids [T, K], weights [T, K])."""
  if config.scoring == "sparsemixer":
    ids, weights = _sparsemixer_routing(logits, config.sparsemixer_eps, None)
    return ids, weights * config.routed_scaling_factor
  scores = _scores(logits, config)
  choice = logits if config.routing_bias_on == "logits" else scores
  choice = choice if routing_bias is None else choice + routing_bias[None, :]
  groups = config.num_expert_groups
  if groups > 1:
    size = config.num_experts // groups
    group_scores = []
    for g in range(groups):
      members = jnp.sort(choice[:, g * size : (g + 1) * size], axis=-1)
      group_scores.append(members[:, -2:].sum(-1) if config.sums_group_top2 else members[:, -1])
    ranked_groups = jnp.argsort(-jnp.stack(group_scores, axis=-1), axis=-1)
    kept = ranked_groups[:, : config.topk_groups]  # [T, topk_groups]
    expert_group = jnp.arange(config.num_experts) // size  # [E]
    in_kept = (expert_group[None, :, None] == kept[:, None, :]).any(-1)  # [T, E]
    choice = jnp.where(in_kept, choice, 0.0 if config.dropped_groups == "zeroed" else -jnp.inf)
  ids = jnp.argsort(-choice, axis=-1, stable=True)[:, : config.top_k]
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if config.renormalize:
    weights = weights / weights.sum(-1, keepdims=True)
  return ids, weights * config.routed_scaling_factor


def _with_shared_scores(tokens, logits, ids, p: MoEParams, config: MoEConfig):
  """`config.shared_expert_scores`: (the routed weights [T, K], the shared experts' [T, S]),
  each score over the chosen experts' and the shared experts' scores summed, scaled."""
  scores = _scores(logits, config)
  outputs = scores.shape[-1]
  chosen = jnp.take_along_axis(scores, jnp.minimum(ids, outputs - 1), axis=-1)
  chosen = jnp.where(ids < outputs, chosen, 0.0)  # ids routed nowhere
  shared = _scores(jnp.matmul(tokens, p.shared_router_kernel, precision=_HIGHEST), config)
  total = chosen.sum(-1, keepdims=True) + shared.sum(-1, keepdims=True)
  scale = config.routed_scaling_factor / total
  return chosen * scale, shared * scale


def _scored_shared_experts(tokens, p: MoEParams, config: MoEConfig, weights) -> jax.Array:
  """The S shared experts one by one, each output times its weight [T, S], summed."""
  fs = p.shared_w_down.shape[0]
  width = fs // config.num_shared_experts
  out = jnp.zeros_like(tokens)
  for s in range(config.num_shared_experts):
    columns = slice(s * width, (s + 1) * width)
    w_gate_up = jnp.concatenate(
      [p.shared_w_gate_up[:, columns], p.shared_w_gate_up[:, fs:][:, columns]], axis=-1
    )
    expert = _mlp(
      tokens,
      w_gate_up,
      p.shared_w_down[columns],
      config,
      activation=config.shared_activation or config.activation,
      limit=config.shared_swiglu_limit,
    )
    out = out + weights[:, s : s + 1] * expert
  return out


def _logical(params: MoEParams, placement: Placement) -> MoEParams:
  """`params` with each per-expert field [P, ...] cut to its experts' first replicas [E, ...]."""
  first = jnp.asarray(placement.logical_to_physical)[:, 0]  # [E]
  per_expert = {name: getattr(params, name) for name in PER_EXPERT_FIELDS}
  # A BlockScaled's values, scales and global scale all lead with P: one take each.
  return params._replace(**jax.tree.map(lambda a: a[first], per_expert))


def reference_moe(
  params: MoEParams,
  x: jax.Array,
  config: MoEConfig,
  token_mask: jax.Array | None = None,
  router_logits: jax.Array | None = None,
  placement: Placement | None = None,
  expert_ids: jax.Array | None = None,
  combine_weights: jax.Array | None = None,
) -> jax.Array:
  """The MoE layer computed densely in float32.

  Args:
    params: `MoEParams`; `BlockScaled` expert weights are dequantized first, and LoRA
      adapters added to their weights (W + s · A @ B, per expert).
    x: [..., D] tokens.
    config: the layer's config.
    token_mask: [...] bool or None.
    router_logits: [..., E + Z] or None (then computed from `params.router_kernel` and
      `params.router_bias`).
    placement: with `config.num_redundant_experts` R > 0 (required then, rejected
      otherwise, as `moe_apply` takes it), the `moejax.eplb.Placement` of the P = E + R
      physical slots in `params` (`layer.placement.get_value()` after a `rebalance`): each
      expert computes with the weights of its first replica.
    expert_ids: [..., K] given logical expert ids (routing replay, as `moe_apply` takes
      them), or None for the router's choice.
    combine_weights: [..., K] the given ids' weights, as `moe_apply` takes them, or None.

  Returns:
    [..., D] float32; rows whose mask is False are 0. Inputs split over an explicit mesh
    axis are made whole first (`meshes.gathered`): the reference computes densely.
  """
  args = (params, x, token_mask, router_logits, expert_ids, combine_weights, placement)
  check_call(call_record(config), *args)
  params, x, token_mask, router_logits, expert_ids, combine_weights = meshes.gathered(
    (params, x, token_mask, router_logits, expert_ids, combine_weights)
  )
  if placement is not None:
    params = _logical(params, placement)
  f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
  as_float = lambda a: a.dequantize(jnp.float32) if is_block_scaled(a) else f32(a)
  p = jax.tree.map(as_float, params, is_leaf=is_block_scaled)
  if p.lora is not None:
    adapted = lambda w, a, b: w + config.lora_scale * jnp.matmul(a, b, precision=_HIGHEST)
    p = p._replace(
      w_gate_up=adapted(p.w_gate_up, p.lora.gate_up_a, p.lora.gate_up_b),
      w_down=adapted(p.w_down, p.lora.down_a, p.lora.down_b),
    )
    if p.shared_lora is not None:
      shared = p.shared_lora
      p = p._replace(
        shared_w_gate_up=adapted(p.shared_w_gate_up, shared.gate_up_a, shared.gate_up_b),
        shared_w_down=adapted(p.shared_w_down, shared.down_a, shared.down_b),
      )
  tokens = f32(x).reshape(-1, config.hidden_size)
  mask = jnp.ones(tokens.shape[0], bool) if token_mask is None else token_mask.reshape(-1)
  tokens = jnp.where(mask[:, None], tokens, 0.0)
  if router_logits is None and p.router_kernel is None:  # routed by the caller alone
    logits = jnp.zeros((tokens.shape[0], config.num_router_outputs), jnp.float32)
  elif router_logits is None:
    logits = jnp.matmul(tokens, p.router_kernel, precision=_HIGHEST)
    if p.router_bias is not None:
      logits = logits + p.router_bias[None, :]
  else:
    logits = f32(router_logits).reshape(tokens.shape[0], -1)
  if config.router_logit_softcap:
    cap = config.router_logit_softcap
    logits = cap * jnp.tanh(logits / cap)
  logits = jnp.where(mask[:, None], logits, 0.0)
  given = (
    None if expert_ids is None else jnp.asarray(expert_ids, jnp.int32).reshape(-1, config.top_k)
  )
  weighed = None if combine_weights is None else f32(combine_weights).reshape(-1, config.top_k)
  ids, weights = reference_routing(logits, config, p.routing_bias, given, weighed)
  shared_weights = None
  if config.shared_expert_scores:
    weights, shared_weights = _with_shared_scores(tokens, logits, ids, p, config)
  if config.apply_router_weight_on_input:  # K = 1: expert(w * x), unweighted output
    expert_in = weights * tokens
    scale = lambda e: (ids == e).astype(jnp.float32)  # [T, 1]
  else:
    expert_in = tokens
    scale = lambda e: jnp.sum(jnp.where(ids == e, weights, 0.0), axis=-1, keepdims=True)
  if p.latent_in is not None:  # the experts work in the latent width
    expert_in = jnp.matmul(expert_in, p.latent_in, precision=_HIGHEST)
    if config.latent_norm_eps is not None:
      expert_in = _rms_norm(expert_in, config.latent_norm_eps)
  y = jnp.zeros_like(expert_in)
  for e in range(config.num_router_outputs):
    if e < config.num_experts:
      biases = (None, None) if p.b_gate_up is None else (p.b_gate_up[e], p.b_down[e])
      out = _mlp(expert_in, p.w_gate_up[e], p.w_down[e], config, *biases)
      if config.expert_output_norm_eps is not None:
        out = _rms_norm(out, config.expert_output_norm_eps)
    elif config.zero_expert_output == "input":  # a zero-computation expert returns its input
      out = expert_in
    else:  # or nothing
      out = jnp.zeros_like(expert_in)
    y = y + scale(e) * out
  if p.latent_out is not None:
    y = jnp.matmul(y, p.latent_out, precision=_HIGHEST)
  if shared_weights is not None:  # each shared expert by its own weight
    y = y + _scored_shared_experts(tokens, p, config, shared_weights) * config.shared_scaling_factor
  elif config.has_shared_experts:
    shared = _mlp(
      tokens,
      p.shared_w_gate_up,
      p.shared_w_down,
      config,
      activation=config.shared_activation or config.activation,
      limit=config.shared_swiglu_limit,
    )
    if p.shared_gate_kernel is not None:
      gate = jnp.matmul(tokens, p.shared_gate_kernel, precision=_HIGHEST)
      shared = shared / (1.0 + jnp.exp(-gate))
    y = y + shared * config.shared_scaling_factor
  if p.output_bias is not None:
    y = y + p.output_bias[None, :]
  y = jnp.where(mask[:, None], y, 0.0)
  return y.reshape(*x.shape[:-1], config.hidden_size)
