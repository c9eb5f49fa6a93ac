"""`MoEParams`: the layer's weights as a pytree, their shapes (the checkpoint format) and checks."""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.experimental.layout import Layout, with_layout_constraint

from kernels_pallas.formats import FORMATS
from kernels_pallas.quantized import BlockScaled, is_block_scaled
from moejax.config import MoEConfig
from moejax.lora import (
  ExpertLoRA,
  SharedLoRA,
  check_adapters,
  expert_lora_shapes,
  scaled,
  shared_lora_shapes,
)


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
  w_gate_up: jax.Array | BlockScaled | None = None  # required: `check_params` says so
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


# The router's parameters, stored in float32 whatever `config.param_dtype` (`storage_dtype`):
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
  """

  w_gate_up: jax.Array | BlockScaled
  w_down: jax.Array | BlockScaled
  b_gate_up: jax.Array | None = None
  b_down: jax.Array | None = None
  lora: ExpertLoRA | None = None

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


def param_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
  """Shape of every parameter the config needs, keyed by `MoEParams` field name (expert
  parameters [P, ...], P = E + R physical experts)."""
  d, e, f = config.hidden_size, config.num_physical_experts, config.intermediate_size
  w = config.expert_width
  outputs = config.num_router_outputs
  shapes = {} if config.external_router else {"router_kernel": (d, outputs)}
  shapes.update(w_gate_up=(e, w, 2 * f), w_down=(e, f, w))
  if config.use_routing_bias:
    shapes["routing_bias"] = (outputs,)
  if config.has_shared_experts:
    fs = config.shared_intermediate_size
    shapes["shared_w_gate_up"] = (d, 2 * fs)
    shapes["shared_w_down"] = (fs, d)
  if config.router_bias:
    shapes["router_bias"] = (outputs,)
  if config.expert_bias:
    shapes["b_gate_up"] = (e, 2 * f)
    shapes["b_down"] = (e, w)
  if config.shared_expert_gate:
    shapes["shared_gate_kernel"] = (d, 1)
  if config.output_bias:
    shapes["output_bias"] = (d,)
  if config.latent_size:
    shapes["latent_in"] = (d, w)
    shapes["latent_out"] = (w, d)
  if config.shared_expert_scores:
    shapes["shared_router_kernel"] = (d, config.num_shared_experts)
  return shapes


def storage_dtype(name: str, config: MoEConfig) -> jax.numpy.dtype:
  """The dtype a parameter (a `MoEParams` field name) is stored in: float32 for the router's
  (`ROUTER_PARAMS`), else `config.param_dtype`.

  >>> config = MoEConfig(num_experts=4, top_k=1, hidden_size=8, intermediate_size=8,
  ...                    param_dtype="bfloat16")
  >>> storage_dtype("router_kernel", config).name, storage_dtype("w_down", config).name
  ('float32', 'bfloat16')
  """
  return jax.numpy.dtype(jax.numpy.float32 if name in ROUTER_PARAMS else config.param_dtype)


def check_params(params: MoEParams, config: MoEConfig) -> None:
  """Raises ValueError if a parameter is missing, unexpected, of the wrong shape, or of
  another format than `config.expert_quant` asks."""
  expected = param_shapes(config)
  check_adapters("lora", params.lora, expert_lora_shapes(config))
  check_adapters("shared_lora", params.shared_lora, shared_lora_shapes(config))
  for name in MoEParams._fields:
    if name in ADAPTER_PARAMS:
      continue
    value = getattr(params, name)
    if name not in expected:
      if value is not None:
        raise ValueError(f"params.{name} is given but the config does not use it")
      continue
    if value is None:
      raise ValueError(f"params.{name} is missing; expected shape {expected[name]}")
    if tuple(value.shape) != expected[name]:
      raise ValueError(f"params.{name} has shape {tuple(value.shape)}, expected {expected[name]}")
    _check_format(name, value, config)


def _check_format(name: str, value, config: MoEConfig) -> None:
  """A quantized parameter is a `BlockScaled` of the config's format; no other one is."""
  quantized = config.expert_quant is not None and name in QUANTIZED_PARAMS
  if not quantized:
    if is_block_scaled(value):
      raise ValueError(
        f"params.{name} is a BlockScaled but the config does not quantize it "
        f"(expert_quant={config.expert_quant!r})"
      )
    return
  if not is_block_scaled(value):
    raise ValueError(
      f"params.{name} must be a BlockScaled (values and scales) with "
      f"expert_quant={config.expert_quant!r}, got {type(value).__name__} "
      "(see moejax.quant.quantize_experts)"
    )
  form = FORMATS[config.expert_quant]
  scales_dtype = jax.numpy.result_type(value.scales)
  if not form.takes_scales(scales_dtype):
    expected = " or ".join(str(d) for d in (form.scales, *form.other_scales))
    raise ValueError(
      f"params.{name} has scales dtype {scales_dtype}, expected {expected} for "
      f"expert_quant={config.expert_quant!r}"
    )
  found = {
    "values dtype": (jax.numpy.result_type(value.values), form.values),
    "block": (value.block, config.quant_block),
    "scales shape": (tuple(value.scales.shape), value.expected_scales_shape()),
    "global_scale (dtype, shape)": (
      _dtype_and_shape(value.global_scale),
      ("float32", value.expected_global_shape()) if form.global_scale else None,
    ),
  }
  for what, (got, want) in found.items():
    if got != want:
      raise ValueError(
        f"params.{name} has {what} {got}, expected {want} for expert_quant={config.expert_quant!r}"
      )


def _dtype_and_shape(a) -> tuple[str, tuple[int, ...]] | None:
  return None if a is None else (str(jax.numpy.result_type(a)), tuple(a.shape))
