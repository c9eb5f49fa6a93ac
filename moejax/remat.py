"""The layer's natural boundaries, named for `jax.checkpoint` / `nnx.remat` policies.

Each name marks a value with `jax.ad_checkpoint.checkpoint_name`. Under a remat policy
built from these names (`jax.checkpoint_policies.save_only_these_names(...)`,
`save_any_names_but_these`, ...), the named values are saved for the backward pass and
everything else inside the layer is recomputed from them; without remat JAX saves what
autodiff needs, as always. The chunk loop's own custom VJP saves only its inputs (the
routed rows) and the weights as given, and recomputes each chunk's exchange and experts in
its backward pass, whatever the policy.
"""

from __future__ import annotations

from typing import TypeVar

from jax.ad_checkpoint import checkpoint_name

# [L, E + Z] per device: the router's logits, padding rows zeroed.
ROUTER_LOGITS = "moejax_router_logits"
# The chunk loop's inputs, per device: rows [L, D] in the compute dtype, their physical
# expert ids [L, K] and routing weights [L, K]: what its backward pass dispatches again.
ROUTED_ROWS = "moejax_routed_rows"
# [..., D] in x's dtype: the layer's output.
LAYER_OUTPUT = "moejax_layer_output"

CHECKPOINT_NAMES = (ROUTER_LOGITS, ROUTED_ROWS, LAYER_OUTPUT)

Tree = TypeVar("Tree")


def named(value: Tree, name: str) -> Tree:
  """`value` (every leaf of a pytree) marked with `name`, one of `CHECKPOINT_NAMES`."""
  return checkpoint_name(value, name)
