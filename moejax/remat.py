"""The layer's natural boundaries, named for `jax.checkpoint` / `nnx.remat` policies.

Each name marks a value with `jax.ad_checkpoint.checkpoint_name`. Under a remat policy
built from these names (`jax.checkpoint_policies.save_only_these_names(...)`,
`save_any_names_but_these`, ...), the named values are saved for the backward pass and
everything else inside the layer is recomputed from them; without remat JAX saves what
autodiff needs, as always. The chunk loop's own custom VJP saves its inputs (the routed
rows) and the weights as given, and recomputes each chunk's exchange and experts in its
backward pass; with `MoEConfig.save_dispatched_rows` it also saves each chunk's dispatched
rows, and a policy decides whether they are kept (no exchange is repeated) or dropped (the
forward pass runs again to make them).

No name marks a chunk's expert output: the backward pass needs the experts' hidden
activations, not their output (the combine is linear, and the routing weights' gradient is
computed from the hidden activations, `moejax.tiles`), so saving it would save nothing.
"""

from __future__ import annotations

from typing import TypeVar

import jax
from jax.ad_checkpoint import checkpoint_name

# [L, E + Z] per device: the router's logits, padding rows zeroed.
ROUTER_LOGITS = "moejax_router_logits"
# The chunk loop's inputs, per device: rows [L, D] in the compute dtype, their physical
# expert ids [L, K] and routing weights [L, K]: what its backward pass dispatches again.
ROUTED_ROWS = "moejax_routed_rows"
# What each chunk's outbound exchange delivered to this device, [chunks, ...] (rows in the
# compute dtype, their local expert ids and weights, the scheme's return routing): kept only
# with `MoEConfig.save_dispatched_rows`, and then the backward pass sends no chunk again.
DISPATCHED_ROWS = "moejax_dispatched_rows"
# [..., D] in x's dtype: the layer's output.
LAYER_OUTPUT = "moejax_layer_output"

CHECKPOINT_NAMES = (ROUTER_LOGITS, ROUTED_ROWS, DISPATCHED_ROWS, LAYER_OUTPUT)

# Remat policies by name (the commands' --remat): no remat, recompute everything, or save
# `CHECKPOINT_NAMES` and recompute the rest.
REMAT_POLICIES = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "names": jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES),
}

Tree = TypeVar("Tree")


def named(value: Tree, name: str) -> Tree:
  """`value` (every leaf of a pytree) marked with `name`, one of `CHECKPOINT_NAMES`."""
  return checkpoint_name(value, name)
