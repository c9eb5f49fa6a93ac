"""MaxText's `RoutedMoE` (an NNX module) with its experts run by moejax.

`on_moejax(RoutedMoE)` is MaxText's own class with one change: the expert computation of its
dense and sparse paths (`dense_matmul`, `sparse_matmul`) is `moejax.moe_mlp`. Everything else
is MaxText's: the parameters (`gate.kernel` and its routed bias, `wi_0`, `wi_1`, `wo`,
`per_expert_scale`) under the same names, shapes and sharding, so its checkpoints load as
they are; the routing (`get_topk`: softmax or sigmoid scores, expert groups, the routed bias,
`routed_scaling_factor`, renormalization); the load-balance loss and the routed bias updates;
the call's arguments and its `(output, lb_loss, bias_updates)`. A MaxText model built after

    from maxtext.layers import moe
    from moejax.integrations import maxtext as moejax_maxtext
    moe.RoutedMoE = moejax_maxtext.on_moejax(moe.RoutedMoE)

runs every routed MoE block on moejax (its chunk loop, exchange and expert paths): the experts
split over MaxText's "expert" mesh axis, the tokens over every other axis. The activation is
MaxText's: `mlp_activations` ("silu" | "gelu" | "relu", "linear") by name, so moejax's kernels
take it; any other (GPT-OSS's clamped one, DeepSeek's limits) as MaxText's own
`apply_ffn_activation`, which moejax's XLA tile loop runs. MaxText configurations this does
not take are refused when the layer is built (`mlp_bias`, `capacity_factor` > 0, quantization,
`te_moe_block`, Llama 4's scores applied to the inputs, a tuple of expert axes). Tested against
MaxText's own dense path (`sparse_matmul=False`), forward and gradients, on one device and 8.

Importing this module imports nothing of MaxText: the class comes in as the argument.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from moejax import meshes
from moejax.functional import moe_mlp

# MaxText's `mlp_activations[0]` (a jax.nn name: "gelu" is jax.nn.gelu's tanh form) -> moejax's.
_NAMED_ACTIVATIONS = {"silu": "silu", "gelu": "gelu_tanh", "relu": "relu"}
# Decoder blocks whose `apply_ffn_activation` is not `act(gate) * up` (clamps, GPT-OSS's form).
_OWN_ACTIVATION_BLOCKS = ("gpt_oss", "deepseek", "deepseek4")


def on_moejax(routed_moe: type) -> type:
  """`routed_moe` (MaxText's `maxtext.layers.moe.RoutedMoE`) with its experts on moejax.

  Raises (when a layer of the returned class is built):
    ValueError: a configuration the drop-in does not take, named.
  """

  class RoutedMoE(routed_moe):
    __doc__ = f"MaxText's RoutedMoE, its experts run by `moejax.moe_mlp`.\n\n{routed_moe.__doc__}"

    def __init__(self, config, *args, **kwargs):
      super().__init__(config, *args, **kwargs)
      _check_supported(self)

    def dense_matmul(
      self,
      inputs,
      gate_logits,
      pre_bias_logits,
      w0_kernel,
      w1_kernel,
      wo_kernel,
      w0_bias,
      w1_bias,
      wo_bias,
      input_ids=None,
      forced_routed_experts=None,
    ):
      """MaxText's dense/sparse matmul on moejax: inputs [B, S, M] -> (output [B, S, M],
      load-balance loss or None, routed bias updates or None)."""
      del w0_bias, w1_bias, wo_bias  # None: `mlp_bias` is refused when the layer is built
      weights, expert_ids = self.get_topk(
        gate_logits,
        pre_bias_logits,
        self.rngs,
        input_ids=input_ids,
        forced_routed_experts=forced_routed_experts,
      )
      routed_ids = expert_ids
      if forced_routed_experts is not None:  # ids outside [0, E) are unused slots
        used = (expert_ids >= 0) & (expert_ids < self.num_experts)
        routed_ids, weights = jnp.where(used, expert_ids, 0), jnp.where(used, weights, 0)
      expert_axis, data_axis = meshes.expert_and_token_axes(
        self.mesh, self._expert_parallelism_name
      )
      batch, length, width = inputs.shape
      output, _ = moe_mlp(
        inputs.reshape(batch * length, width),
        routed_ids.reshape(batch * length, -1).astype(jnp.int32),
        weights.reshape(batch * length, -1).astype(self.dtype),
        w0_kernel.astype(self.dtype),
        wo_kernel.astype(self.dtype),
        w_up=w1_kernel.astype(self.dtype),
        activation=_activation(self),
        mesh=self.mesh,
        data_axis=data_axis,
        expert_axis=expert_axis,
      )
      loss, bias_updates = _router_statistics(self, gate_logits, pre_bias_logits, expert_ids)
      return output.reshape(inputs.shape), loss, bias_updates

    sparse_matmul = dense_matmul

  RoutedMoE.__name__ = RoutedMoE.__qualname__ = routed_moe.__name__
  RoutedMoE.__module__ = __name__
  return RoutedMoE


def _check_supported(layer: Any) -> None:
  """Raises ValueError naming the first MaxText setting of `layer` the drop-in does not take."""
  config = layer.config
  refused = {
    "mlp_bias=True (moejax.moe_mlp takes no expert biases)": config.mlp_bias,
    "capacity_factor > 0 (MaxText's dropping; moejax is dropless or drops by its own rule)": (
      config.capacity_factor > 0
    ),
    "quantization (quant=...; moejax quantizes through its own MoEConfig)": (
      layer.quant is not None or layer.weight_quant is not None
    ),
    "te_moe_block=True (Transformer Engine's block)": config.te_moe_block,
    "decoder_block=llama4 (its router scores scale the inputs)": (_block_name(config) == "llama4"),
    f"an expert axis group {layer._expert_parallelism_name} (one mesh axis expected)": (
      not isinstance(layer._expert_parallelism_name, str)
    ),
  }
  for what, found in refused.items():
    if found:
      raise ValueError(f"moejax's MaxText RoutedMoE does not take {what}")


def _block_name(config: Any) -> str:
  return getattr(config.decoder_block, "value", str(config.decoder_block))


def _activation(layer: Any):
  """moejax's name for MaxText's activation where it is `act(gate) * up`, else MaxText's own
  `apply_ffn_activation` as a `(gate, up) -> hidden` function."""
  config = layer.config
  gate, up = config.mlp_activations
  plain = up == "linear" and _block_name(config) not in _OWN_ACTIVATION_BLOCKS
  named = _NAMED_ACTIVATIONS.get(gate) if plain else None
  return named if named is not None else layer.apply_ffn_activation


def _router_statistics(
  layer: Any, gate_logits: jax.Array, pre_bias_logits: jax.Array | None, expert_ids: jax.Array
) -> tuple[jax.Array | None, jax.Array | None]:
  """(load-balance loss, routed bias updates) as MaxText's dense path computes them, each
  None where its configuration turns it off."""
  from maxtext.layers import moe  # MaxText is there: its layer called this

  config = layer.config
  loss = None
  wants_loss = config.model_call_mode != "inference" and not layer.is_hash_routing
  if wants_loss and config.load_balance_loss_weight > 0.0:
    if moe.uses_megatron_seq_aux_loss(config):
      loss = layer.megatron_seq_aux_loss(
        pre_bias_logits if pre_bias_logits is not None else gate_logits
      )
    else:
      probabilities = jax.nn.softmax(gate_logits.astype(jnp.float32), axis=-1)
      loss = layer.load_balance_loss(expert_ids, probabilities.astype(layer.dtype))
  bias_updates = None
  if layer.should_update_load_balance():
    if getattr(config, "gradient_accumulation_steps", 1) > 1:
      bias_updates = moe.calculate_expert_counts(expert_ids, config.num_experts, axis_names=None)
    else:
      bias_updates = moe.calculate_load_balance_updates(
        expert_ids, config.num_experts, config.routed_bias_update_rate, axis_names=None
      )
  return loss, bias_updates
