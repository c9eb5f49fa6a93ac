"""`MoEParams`: the layer's weights as a pytree, their shapes (the checkpoint format) and checks."""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.experimental.layout import Layout, with_layout_constraint

from kernels_pallas.fused_moe import Fp8Matrix
from kernels_pallas.gmm_fp8 import Fp8Weight
from kernels_pallas.quantized import BlockScaled, is_block_scaled
from moejax.config import MoEConfig
from moejax.lora import ExpertLoRA, SharedLoRA, scaled


class MoEParams(NamedTuple):
  """Weights of one MoE layer. Names and shapes are the checkpoint format.

  Attributes:
    router_kernel: [D, E + Z] (Z = `num_zero_experts`, usually 0), or None with
      `config.external_router`.
    w_gate_up: [E, D, 2F] (L for D with `config.latent_size`, in every expert parameter);
      gate = `[..., :F]`, up = `[..., F:]`. With redundant experts
      (`config.num_redundant_experts` R > 0) this and every expert parameter holds the
      P = E + R physical slots, [P, ...] (`moejax.eplb.place`).
    w_down: [E, F, D].
    routing_bias: [E + Z] selection bias, or None unless `config.use_routing_bias`.
    shared_w_gate_up: [D, 2Fs], or None without shared experts.
    shared_w_down: [Fs, D], or None without shared experts.
    router_bias: [E + Z] bias of the router's logits, or None unless `config.router_bias`.
    b_gate_up: [E, 2F] expert biases, or None unless `config.expert_bias`.
    b_down: [E, D], or None unless `config.expert_bias`.
    shared_gate_kernel: [D, 1], or None unless `config.shared_expert_gate`.
    output_bias: [D] added to each real token's output, or None unless `config.output_bias`.
    latent_in: [D, L] the projection of a token's row into the experts' latent width, or None
      unless `config.latent_size`.
    latent_out: [L, D] the projection of what returns back to D, or None likewise.
    lora: the routed experts' `moejax.lora.ExpertLoRA` adapters, or None unless
      `config.lora_rank`.
    shared_lora: the shared experts' `moejax.lora.SharedLoRA`, or None unless
      `config.lora_rank` and shared experts.
    shared_router_kernel: [D, S] the router's columns of the S shared experts, or None unless
      `config.shared_expert_scores`.

  With `config.expert_quant`, `w_gate_up` and `w_down` are `BlockScaled` (values of the
  shapes above, their scales per block): constants for autodiff, never trained.
  """

  router_kernel: jax.Array | None = None
  w_gate_up: jax.Array | BlockScaled | None = None  # required: `moejax.inputs.check_params` says so
  w_down: jax.Array | BlockScaled | None = None
  routing_bias: jax.Array | None = None
  shared_w_gate_up: jax.Array | None = None
  shared_w_down: jax.Array | None = None
  router_bias: jax.Array | None = None
  b_gate_up: jax.Array | None = None
  b_down: jax.Array | None = None
  shared_gate_kernel: jax.Array | None = None
  output_bias: jax.Array | None = None
  latent_in: jax.Array | None = None
  latent_out: jax.Array | None = None
  lora: ExpertLoRA | None = None
  shared_lora: SharedLoRA | None = None
  shared_router_kernel: jax.Array | None = None


# The adapter fields of `MoEParams` (pytrees of arrays, checked by `moejax.lora`).
ADAPTER_PARAMS = ("lora", "shared_lora")
# Parameters with a leading expert axis [E, ...], split over the mesh's expert axis, in
# `ExpertWeights`' order.
EXPERT_PARAMS = ("w_gate_up", "w_down", "b_gate_up", "b_down")
# Every `MoEParams` field whose leaves have a leading physical-expert axis [P, ...]: the
# expert parameters and the routed experts' adapters, laid out alike on a mesh.
PER_EXPERT_FIELDS = (*EXPERT_PARAMS, "lora")
# Parameters that start at zero in a new layer (the others are matrices, fan-in initialised).
BIAS_PARAMS = ("routing_bias", "router_bias", "b_gate_up", "b_down", "output_bias")


# The router's parameters, stored in float32 whatever `config.param_dtype`
# (`moejax.call_record.Expected.dtype`):
# routing runs in float32, transformers keeps a router's weight and selection bias in float32
# for about twenty families, and a selection bias rounded to bfloat16 sends tokens to other
# experts than the checkpoint's model does.
ROUTER_PARAMS = ("router_kernel", "router_bias", "routing_bias", "shared_router_kernel")
# Expert matrices that `config.expert_quant` stores as `BlockScaled`.
QUANTIZED_PARAMS = ("w_gate_up", "w_down")
# The shared experts' parameters, in `SharedWeights`' order.
SHARED_PARAMS = ("shared_w_gate_up", "shared_w_down", "shared_gate_kernel")
# The matrices every device uses whole, split along dim 0 over all devices with
# `config.shared_fsdp`.
SHARED_FSDP_PARAMS = ("router_kernel", *SHARED_PARAMS)


class ExpertWeights(NamedTuple):
  """The routed experts' weights as the chunk loop, the tile loop and the kernels compute
  with them: one value that travels whole (and, in the backward pass, the type of their
  gradients and gradient seeds: a None field has none).

  Attributes:
    w_gate_up: [El, D, 2F] this device's experts, in the compute dtype, or `BlockScaled`
      (quantized: a constant, then `w_down` is too).
    w_down: [El, F, D].
    b_gate_up: [El, 2F] biases, or None without `config.expert_bias`.
    b_down: [El, D], or None.
    lora: the `ExpertLoRA` adapters [El, ...] in the compute dtype with the scale folded
      into each B (`moejax.lora.scaled`), or None without adapters.
    fp8: (w_gate_up's, w_down's) `kernels_pallas.gmm_fp8.Fp8Weight` (the Hopper fp8 kernels)
      or `kernels_pallas.fused_moe.Fp8Matrix` (the fused path), the matrices quantized once
      per pass for the fp8 kernels (`moejax.experts.with_fp8_blocks`; constants, whose
      products give the float matrices their gradients), or None.
  """

  w_gate_up: jax.Array | BlockScaled
  w_down: jax.Array | BlockScaled
  b_gate_up: jax.Array | None = None
  b_down: jax.Array | None = None
  lora: ExpertLoRA | None = None
  fp8: tuple[Fp8Weight, Fp8Weight] | tuple[Fp8Matrix, Fp8Matrix] | None = None

  def of_expert(self, expert: jax.Array, dtype) -> ExpertWeights:
    """One expert's weights ([D, 2F], [F, D], [2F], [D], its adapters) in `dtype`: slices, a
    quantized matrix dequantized (only this expert's values and scales are read)."""
    take = lambda w: None if w is None else jax.tree.map(lambda a: a[expert], w)
    matrix = lambda w: as_stored(w[expert]).dequantize(dtype) if is_block_scaled(w) else w[expert]
    return ExpertWeights(
      matrix(self.w_gate_up),
      matrix(self.w_down),
      b_gate_up=take(self.b_gate_up),
      b_down=take(self.b_down),
      lora=take(self.lora),
    )

  @property
  def quantized(self) -> bool:
    """Whether the matrices are `BlockScaled` (constants: no gradient is computed for them)."""
    return is_block_scaled(self.w_gate_up)


def as_stored(w: BlockScaled) -> BlockScaled:
  """`w` with every leaf held to the row-major layout it is stored in.

  XLA:GPU gives a 4-bit matrix (mxfp4, int4_group, nvfp4) its input dimension minor for the
  decode, and would give that layout to the array it is sliced from: in a loop over stacked
  layers (`lax.scan` over stacked `MoEParams`, as deep models run), a transposed copy of
  every layer's expert weights made before the loop. Held here, at the slice a decode reads,
  only that slice is laid out anew (measured on a compile-only H200: the copy is gone, no
  temp is added; docs/measurements.md, "Checked without a GPU").
  """
  pin = lambda leaf: with_layout_constraint(leaf, Layout(tuple(range(leaf.ndim))))
  return jax.tree.map(pin, w)


class SharedWeights(NamedTuple):
  """The shared experts (fused into one MLP of width Fs) in the compute dtype.

  Attributes:
    w_gate_up: [D, 2Fs].
    w_down: [Fs, D].
    gate_kernel: [D, 1] with `config.shared_expert_gate`, else None.
    lora: the `SharedLoRA` adapters (scale folded into each B), or None.
  """

  w_gate_up: jax.Array
  w_down: jax.Array
  gate_kernel: jax.Array | None = None
  lora: SharedLoRA | None = None


class TokenSideWeights(NamedTuple):
  """The weights a chunk uses where its tokens live, in the compute dtype.

  Attributes:
    shared: the `SharedWeights`, or None without shared experts.
    latent_out: [L, D] with `config.latent_size`, else None.
  """

  shared: SharedWeights | None = None
  latent_out: jax.Array | None = None


def compute_weights(params: MoEParams, config: MoEConfig) -> tuple[ExpertWeights, TokenSideWeights]:
  """The routed experts' weights and those used where the tokens live, as the chunk loop
  computes with them.

  The one place that decides a weight's compute form: a float weight is cast to
  `config.dtype`; a `BlockScaled` one keeps its format as a unit (the expert path expands it
  tile by tile) and is a constant for autodiff (`stop_gradient` on values and scales).
  """

  def compute_form(value):
    if is_block_scaled(value):
      return jax.tree.map(jax.lax.stop_gradient, value)
    return None if value is None else value.astype(config.dtype)

  adapters = lambda value: None if value is None else scaled(value, config, config.dtype)
  experts = ExpertWeights(
    *(compute_form(getattr(params, name)) for name in EXPERT_PARAMS), adapters(params.lora)
  )
  shared = None
  if config.has_shared_experts:
    matrices = (compute_form(getattr(params, name)) for name in SHARED_PARAMS)
    shared = SharedWeights(*matrices, adapters(params.shared_lora))
  return experts, TokenSideWeights(shared, compute_form(params.latent_out))


def expert_arrays(params: MoEParams) -> list[tuple[str, str | None, jax.Array]]:
  """The per-expert parameters' arrays as (name, part, array): part None for a float weight,
  each of `BlockScaled.parts()` for a quantized one, the field ("gate_up_a", ...) for the
  adapters. Where moved weights are written back (`MoELayer.rebalance`,
  `moejax.linen.rebalance`), each array goes to its own variable.

  >>> import jax.numpy as jnp
  >>> params = MoEParams(jnp.ones((4, 2)), jnp.ones((2, 4, 6)), jnp.ones((2, 3, 4)))
  >>> [(name, part) for name, part, _ in expert_arrays(params)]
  [('w_gate_up', None), ('w_down', None)]
  """
  arrays = []
  for name in EXPERT_PARAMS:
    value = getattr(params, name)
    if is_block_scaled(value):
      arrays += [(name, part, leaf) for part, leaf in value.parts().items()]
    elif value is not None:
      arrays.append((name, None, value))
  if params.lora is not None:
    fields = zip(ExpertLoRA._fields, params.lora, strict=True)
    arrays += [("lora", field, value) for field, value in fields]
  return arrays
