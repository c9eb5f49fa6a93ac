"""The layer's inputs checked against its config at trace time, each argument named when
wrong: one set of checks for the fast path (`moejax.moe_apply`) and the oracle
(`moejax.reference_moe`), which shares no other code with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import MoEConfig
from moejax.params import MoEParams, check_params


def check_inputs(
  params, x, token_mask, router_logits, config, expert_ids=None, combine_weights=None
) -> None:
  """The layer's inputs against its config (types, dtypes, shapes), each named when wrong:
  for `moe_apply` and `reference_moe` alike. Given `expert_ids` outside a trace (concrete
  values) must also be in range and distinct per valid token (`check_expert_id_values`);
  `combine_weights` come with them, one per id."""
  if not isinstance(config, MoEConfig):
    raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
  if not isinstance(params, MoEParams):
    raise TypeError(
      f"params must be a moejax.MoEParams (e.g. `layer.moe_params()`), got {type(params).__name__}"
    )
  check_params(params, config)
  named = (("x", x), ("token_mask", token_mask), ("router_logits", router_logits))
  for name, value in (*named, ("expert_ids", expert_ids), ("combine_weights", combine_weights)):
    if value is not None and not hasattr(value, "shape"):
      raise TypeError(f"{name} must be an array (JAX or NumPy), got {type(value).__name__}")
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"x must be a floating array, got dtype {jnp.result_type(x)}")
  if x.ndim < 1 or x.shape[-1] != config.hidden_size:
    raise ValueError(f"x has shape {x.shape}; expected [..., hidden_size={config.hidden_size}]")
  if token_mask is not None:
    if token_mask.shape != x.shape[:-1]:
      raise ValueError(
        f"token_mask has shape {token_mask.shape}; expected x.shape[:-1]={x.shape[:-1]}"
      )
    if jnp.result_type(token_mask) != jnp.bool_:
      raise TypeError(f"token_mask must be bool, got dtype {jnp.result_type(token_mask)}")
  if router_logits is None and config.external_router and combine_weights is None:
    raise ValueError(
      "router_logits is None, but this layer has no router (external_router=True): pass the "
      f"logits of its router, [..., {config.num_router_outputs}]"
    )
  if router_logits is not None:
    expected = (*x.shape[:-1], config.num_router_outputs)
    if router_logits.shape != expected:
      raise ValueError(f"router_logits has shape {router_logits.shape}; expected {expected}")
    if not jnp.issubdtype(jnp.result_type(router_logits), jnp.floating):
      raise TypeError(f"router_logits must be floating, got dtype {jnp.result_type(router_logits)}")
  if expert_ids is not None:
    expected = (*x.shape[:-1], config.top_k)
    if expert_ids.shape != expected:
      raise ValueError(
        f"expert_ids has shape {expert_ids.shape}; expected [..., top_k] = {expected}"
      )
    if not jnp.issubdtype(jnp.result_type(expert_ids), jnp.integer):
      raise TypeError(
        f"expert_ids must be integer (int32), got dtype {jnp.result_type(expert_ids)}"
      )
    check_expert_id_values(expert_ids, token_mask, config)
  if combine_weights is not None:
    _check_combine_weights(combine_weights, expert_ids, config)


def _check_combine_weights(combine_weights, expert_ids, config) -> None:
  """`combine_weights` beside the `expert_ids` they weigh: floating, of their shape."""
  if expert_ids is None:
    raise ValueError(
      "combine_weights is given without expert_ids: pass the ids they weigh, [..., top_k]"
    )
  if combine_weights.shape != expert_ids.shape:
    raise ValueError(
      f"combine_weights has shape {combine_weights.shape}; expected expert_ids' shape "
      f"{expert_ids.shape}"
    )
  if not jnp.issubdtype(jnp.result_type(combine_weights), jnp.floating):
    raise TypeError(
      f"combine_weights must be floating, got dtype {jnp.result_type(combine_weights)}"
    )
  if config.shared_expert_scores:
    raise ValueError(
      "combine_weights cannot weigh this layer's shared experts, which the router scores "
      "(shared_expert_scores=True): route with the router, or use a config without it"
    )


def check_expert_id_values(expert_ids, token_mask, config) -> None:
  """Concrete `expert_ids` (outside a trace): each valid token's K ids in [0, E + Z) and
  distinct, else a ValueError naming the first bad token. Traced ones are not read (no host
  sync): under `jit` an invalid id routes nowhere and is counted
  (`moejax.MoEAux.invalid_expert_ids`)."""
  if isinstance(expert_ids, jax.core.Tracer) or isinstance(token_mask, jax.core.Tracer):
    return
  ids = np.asarray(expert_ids).reshape(-1, config.top_k)
  mask = np.ones(len(ids), bool) if token_mask is None else np.asarray(token_mask).reshape(-1)
  outputs = config.num_router_outputs
  out_of_range = ((ids < 0) | (ids >= outputs)).any(-1)
  ranked = np.sort(ids, axis=-1)
  repeated = (ranked[:, 1:] == ranked[:, :-1]).any(-1)
  for bad, what in ((out_of_range, f"outside [0, {outputs})"), (repeated, "repeated")):
    found = np.flatnonzero(bad & mask)
    if found.size:
      token = np.unravel_index(found[0], np.shape(expert_ids)[:-1])
      raise ValueError(
        f"expert_ids: token {tuple(int(i) for i in token)} has ids {ids[found[0]].tolist()}, "
        f"{what} ({found.size} such tokens); each token takes top_k={config.top_k} distinct "
        f"expert ids in [0, num_experts + num_zero_experts = {outputs})"
      )
