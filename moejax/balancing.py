"""Load balancing during training: the aux-loss-free selection-bias update, and the
load-balancing loss over several calls together.

The bias update is DeepSeek-V3's (Liu et al. 2024, section 2.1.2; MaxText's
`routed_bias_update_rate`): after each step, every routed expert's selection bias moves by
`rate` toward the mean load, up when it got fewer (token, choice) pairs than the mean, down
when more. The bias only chooses experts (`MoEConfig.use_routing_bias`); it enters no weight
and gets no gradient, so the update is the only thing that moves it.

>>> bias = jnp.zeros(4)
>>> bias_update(bias, jnp.array([9, 1, 5, 5]), rate=0.01, num_experts=4).tolist()
[-0.009999999776482582, 0.009999999776482582, 0.0, 0.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import routing
from moejax.layer import MoELayer


def bias_update(
  routing_bias: jax.Array, expert_counts: jax.Array, *, rate: float, num_experts: int
) -> jax.Array:
  """The selection bias after one step of the aux-loss-free update.

  Args:
    routing_bias: [..., E + Z] the layer's selection bias (a stack's: [layers, E + Z]).
    expert_counts: [..., E + Z] (token, choice) pairs per expert in the step
      (`MoEAux.expert_counts`, summed over the step's calls of the layer).
    rate: how far a bias moves per step (DeepSeek-V3: 0.001).
    num_experts: E; the Z zero-computation experts' biases stay as they are.

  Returns:
    The new bias, with `routing_bias`'s shape and dtype: each routed expert's moved by
    `rate * sign(mean - count)` (mean over the E routed experts).
  """
  routing_bias = jnp.asarray(routing_bias)
  counts = jnp.asarray(expert_counts)[..., :num_experts].astype(jnp.float32)
  mean = jnp.mean(counts, axis=-1, keepdims=True)
  step = rate * jnp.sign(mean - counts)
  moved = routing_bias[..., :num_experts].astype(jnp.float32) + step
  return routing_bias.at[..., :num_experts].set(moved.astype(routing_bias.dtype))


def update_routing_biases(model: nnx.Module, intermediates: nnx.State, *, rate: float) -> int:
  """Applies `bias_update` to every `MoELayer` of `model` that sowed expert counts, in place:
  call it after the optimizer's update, with what `nnx.capture(model, nnx.Intermediate)`
  returned for the step (inside or outside `jit`).

  Args:
    model: the model (or a layer) whose layers ran.
    intermediates: the captured `nnx.Intermediate` state of the step; a layer called several
      times (micro-batches) moves by the sum of its calls' counts.
    rate: as `bias_update`'s.

  Returns:
    How many layers (stacks count once) were updated.

  Raises:
    ValueError: a layer that sowed counts has no selection bias (`use_routing_bias=False`).
  """
  counts_at = {}
  for path, variable in nnx.to_flat_state(intermediates):
    if path[-1] == "expert_counts":
      counts_at[tuple(path[:-1])] = sum(variable.get_value())
  updated = 0
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, MoELayer) or tuple(path) not in counts_at:
      continue
    if not node.config.use_routing_bias:
      where = "/".join(map(str, path)) or "the model"
      raise ValueError(
        f"update_routing_biases: the MoELayer at {where} has no selection bias; build it "
        "with MoEConfig(use_routing_bias=True)"
      )
    bias = node.routing_bias
    counts = counts_at[tuple(path)]
    bias.set_value(
      bias_update(bias.get_value(), counts, rate=rate, num_experts=node.config.num_experts)
    )
    updated += 1
  return updated


def global_load_balancing_loss(
  expert_counts: jax.Array, score_sums: jax.Array, num_tokens: jax.Array, *, top_k: int
) -> jax.Array:
  """Switch Transformer's load-balancing loss over the tokens of several calls together
  (micro-batches of one step): f_e from the counts of all of them, P_e from all their scores.

  One call's loss (`MoEAux.load_balancing_loss`) already counts its whole global batch: its
  sums run over every device of the mesh. With gradient accumulation each micro-batch's
  call sees only its own tokens; stack their `MoEAux` fields and pass them here.

  Args:
    expert_counts: [calls, E + Z] int32 (`MoEAux.expert_counts` of each call).
    score_sums: [calls, E + Z] float32 (`MoEAux.score_sums`, carries the gradient).
    num_tokens: [calls] int32 (`MoEAux.num_tokens`).
    top_k: K.

  Returns:
    [] float32, as `MoEAux.load_balancing_loss` of one call holding all the tokens.
  """
  stats = routing.RouterStats(
    expert_counts=jnp.sum(expert_counts, axis=0),
    score_sums=jnp.sum(score_sums, axis=0),
    z_sum=jnp.float32(0),
    num_tokens=jnp.sum(num_tokens),
    invalid_choices=jnp.int32(0),
  )
  return routing.load_balancing_loss(stats, top_k)
