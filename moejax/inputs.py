"""The layer's inputs checked against its config at trace time, each argument named when
wrong: one set of checks for the fast path (`moejax.moe_apply`) and the oracle
(`moejax.reference_moe`), which shares no other code with it."""

from __future__ import annotations

import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.params import MoEParams, check_params


def check_inputs(params, x, token_mask, router_logits, config) -> None:
  """The layer's inputs against its config (types, dtypes, shapes), each named when wrong:
  for `moe_apply` and `reference_moe` alike."""
  if not isinstance(config, MoEConfig):
    raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
  if not isinstance(params, MoEParams):
    raise TypeError(
      f"params must be a moejax.MoEParams (e.g. `layer.moe_params()`), got {type(params).__name__}"
    )
  check_params(params, config)
  for name, value in (("x", x), ("token_mask", token_mask), ("router_logits", router_logits)):
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
  if router_logits is not None:
    expected = (*x.shape[:-1], config.num_router_outputs)
    if router_logits.shape != expected:
      raise ValueError(f"router_logits has shape {router_logits.shape}; expected {expected}")
    if not jnp.issubdtype(jnp.result_type(router_logits), jnp.floating):
      raise TypeError(f"router_logits must be floating, got dtype {jnp.result_type(router_logits)}")
