"""tunix's Qwen3 `MoELayer` (an NNX module), run by moejax.

`MoELayer` has the parameters tunix's has, under the same names and shapes (`router` an
`nnx.Linear` [D, E] without bias, `gate_proj` and `up_proj` [E, D, F], `down_proj` [E, F, D],
with the same sharding metadata), so tunix's checkpoint loaders and its Qwen3 model take it
as they are, and the same call (x [B, T, D] -> [B, T, D]; `use_megablox` accepted, moejax
choosing its own path): routing as tunix routes (the softmax of the router's float32 logits,
the top K renormalized to sum 1, cast to the compute dtype), the experts through
`moejax.moe_mlp` (its chunk loop, exchange and expert paths). A Qwen3 MoE model built after

    from moejax.integrations import tunix as moejax_tunix
    tunix.models.qwen3.model.MoELayer = moejax_tunix.MoELayer

runs every MoE block on moejax. The mesh is the call's (`jax.set_mesh`; none: one device):
the experts split over the axis tunix puts them on (`ShardingConfig.exp_weight_edf[0]`,
"fsdp" by default), the tokens over every axis. Tested against tunix's own layer
(`use_megablox=False`, its dense path), forward and gradients, on one device and 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from moejax import meshes
from moejax.functional import moe_mlp


class MoELayer(nnx.Module):
  """tunix's Qwen3 MoE block (`tunix.models.qwen3.model.MoELayer`) on moejax.

  Args:
    config: tunix's Qwen3 `ModelConfig` (read: embed_dim, hidden_dim, num_experts,
      num_experts_per_tok, dtype, param_dtype, shd_config).
    rngs: the parameters' random streams, drawn as tunix draws them.
  """

  def __init__(self, config, *, rngs: nnx.Rngs):
    self.shd_config = config.shd_config
    self.experts_per_tok = config.num_experts_per_tok
    self.num_experts = config.num_experts
    self.router = nnx.Linear(
      in_features=config.embed_dim,
      out_features=config.num_experts,
      use_bias=False,
      rngs=rngs,
      dtype=config.dtype,
      param_dtype=config.param_dtype,
    )
    normal = nnx.initializers.normal(dtype=config.param_dtype)
    edf = (config.num_experts, config.embed_dim, config.hidden_dim)
    efd = (config.num_experts, config.hidden_dim, config.embed_dim)
    self.gate_proj = nnx.Param(
      normal(rngs.params(), edf), out_sharding=config.shd_config.exp_weight_edf
    )
    self.up_proj = nnx.Param(
      normal(rngs.params(), edf), out_sharding=config.shd_config.exp_weight_edf
    )
    self.down_proj = nnx.Param(
      normal(rngs.params(), efd), out_sharding=config.shd_config.exp_weight_efd
    )
    self.dtype = config.dtype

  def __call__(self, x: jax.Array, use_megablox: bool = True) -> jax.Array:
    """x [B, T, D] -> [B, T, D] in the compute dtype. `use_megablox` is tunix's switch between
    its kernel and its dense path; moejax runs its own (`moejax.plan_call` says which)."""
    del use_megablox
    scores = self.router(x).astype(jnp.float32)  # [B, T, E]
    weights, expert_ids = jax.lax.top_k(jax.nn.softmax(scores, axis=-1), self.experts_per_tok)
    weights = (weights / jnp.sum(weights, axis=-1, keepdims=True)).astype(self.dtype)
    mesh = meshes.of_call(None)
    expert_axis = self.shd_config.exp_weight_edf[0]
    expert_axis, data_axis = meshes.expert_and_token_axes(mesh, expert_axis)
    cast = lambda w: jnp.astype(w[...], self.dtype)
    y, _ = moe_mlp(
      x.astype(self.dtype),
      expert_ids.astype(jnp.int32),
      weights,
      cast(self.gate_proj),
      cast(self.down_proj),
      w_up=cast(self.up_proj),
      mesh=mesh,
      data_axis=data_axis,
      expert_axis=expert_axis,
    )
    return y
