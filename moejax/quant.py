"""Quantized expert weights: float experts to `BlockScaled` and back.

`quantize_experts` stores `w_gate_up` and `w_down` in a checkpoint format
(`MoEConfig.expert_quant`), rounding to nearest:

- "fp8_block": float8_e4m3fn values, one float32 scale per (bi, bo) block, scale = the
  block's largest magnitude / 448 (e4m3's largest finite value), as DeepSeek-V3 quantizes.
- "mxfp4": float4_e2m1fn values, one power-of-two float8_e8m0fnu scale per 32 values along
  the input axis, scale = 2^(floor(log2 amax) - 2) with values clamped to ±6 (OCP MX v1.0,
  e2m1's largest exponent is 2).
- "int4_group": int4 values, one bfloat16 scale per group of inputs (blocks (group, 1)),
  scale = amax / 7.5 rounded to bfloat16, values round(w / scale) clamped to [-8, 7], as
  compressed-tensors quantizes symmetric INT4 (its range 15 over 2).
- "nvfp4": float4_e2m1fn values, one float8_e4m3fn scale per 16 inputs (blocks (16, 1)) and
  a float32 global scale per matrix, in compressed-tensors' arithmetic: g = 448 * 6 / the
  matrix's largest magnitude (as (1 / amax) * 2688), scale = g * (the block's amax / 6)
  rounded to e4m3, values = w / (scale / g) clamped to ±6 and rounded to e2m1; the global
  scale stored is 1 / g (a multiplier, as ModelOpt's `weight_scale_2`), once per column.

Each format is a rule in `_RULES`: (the blocks, their largest magnitudes) -> (scales, values,
global scale or None).

A block of zeros gets scale 1 (so does an all-zero matrix's global scale).
`dequantize_experts` is the inverse map to float weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.quantized import FORMATS, BlockScaled, is_block_scaled
from moejax.config import MoEConfig
from moejax.params import QUANTIZED_PARAMS, MoEParams, check_params

_E4M3_MAX = 448.0
_E2M1_MAX = 6.0
_E2M1_MAX_EXPONENT = 2
_INT4_HALF_RANGE = 7.5  # (7 - (-8)) / 2: compressed-tensors' symmetric scale divisor
_NVFP4_GLOBAL = _E4M3_MAX * _E2M1_MAX  # the global scale maps a matrix's amax to e4m3's max


def _blocks(w: jax.Array, block: tuple[int, int]) -> jax.Array:
  """[..., in, out] -> [..., in/bi, bi, out/bo, bo], zero padded to whole blocks. One axis is
  split at a time: an explicitly sharded weight's leading axes keep their sharding."""
  *lead, rows, cols = w.shape
  pad_rows, pad_cols = -rows % block[0], -cols % block[1]
  w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, pad_rows), (0, pad_cols)])
  w = w.reshape(*lead, (rows + pad_rows) // block[0], block[0], cols + pad_cols)
  return w.reshape(*lead, (rows + pad_rows) // block[0], block[0], -1, block[1])


def _divide(a: jax.Array, b: jax.Array) -> jax.Array:
  """a / b (b broadcast to a's shape) rounded as one IEEE division. XLA rewrites division by a
  constant or a broadcast value into multiplication by its reciprocal, an ulp off in half the
  cases; an opaque full-shape divisor keeps the division."""
  return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def quantize(w: jax.Array, expert_quant: str, block: tuple[int, int]) -> BlockScaled:
  """One float weight [..., in, out] in the named format (round to nearest).

  >>> w = quantize(jnp.array([[1.0, -3.0], [0.5, 2.0]]), "fp8_block", (2, 2))
  >>> w.scales.tolist(), w.values.astype(jnp.float32).tolist()  # 3 / 448; 149.3 -> 144
  ([[0.006696428...]], [[144.0, -448.0], [72.0, 288.0]])
  """
  form = FORMATS[expert_quant]
  *lead, rows, cols = w.shape
  blocks = _blocks(jnp.asarray(w, jnp.float32), block)
  amax = jnp.max(jnp.abs(blocks), axis=(-3, -1), keepdims=True)
  scale, values, global_scale = _RULES[expert_quant](blocks, amax)
  values = values.reshape(*blocks.shape[:-2], -1)  # one axis merged at a time, as `_blocks`
  values = values.reshape(*lead, -1, values.shape[-1])[..., :rows, :cols]
  scale = scale[..., 0, :, 0].astype(form.scales)
  if global_scale is not None:  # one per matrix, kept per column
    global_scale = jnp.broadcast_to(global_scale.reshape(*lead, 1), (*lead, cols))
  return BlockScaled(values.astype(form.values), scale, block, global_scale)


def _fp8_block(blocks: jax.Array, amax: jax.Array):
  scale = jnp.where(amax > 0, _divide(amax, jnp.float32(_E4M3_MAX)), 1.0)
  return scale, _divide(blocks, scale), None


def _mxfp4(blocks: jax.Array, amax: jax.Array):
  exponent = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - _E2M1_MAX_EXPONENT
  scale = jnp.where(amax > 0, jnp.exp2(exponent), 1.0)
  return scale, jnp.clip(blocks / scale, -_E2M1_MAX, _E2M1_MAX), None  # a power of two: exact


def _int4_group(blocks: jax.Array, amax: jax.Array):
  scale = jnp.where(amax > 0, _divide(amax, jnp.float32(_INT4_HALF_RANGE)), 1.0)
  scale = scale.astype(jnp.bfloat16).astype(jnp.float32)  # as stored
  return scale, jnp.clip(jnp.round(_divide(blocks, scale)), -8, 7), None


def _nvfp4(blocks: jax.Array, amax: jax.Array):
  matrix_amax = jnp.max(amax, axis=(-4, -2), keepdims=True)
  # compressed-tensors' global scale g = 448 * 6 / amax, rounded as torch computes a number
  # over a tensor: the tensor's reciprocal times the number.
  inverse = (1 / matrix_amax) * jnp.float32(_NVFP4_GLOBAL)
  inverse = jnp.where(jnp.isfinite(inverse), inverse, 1.0)  # an all-zero matrix
  scale = inverse * _divide(amax, jnp.float32(_E2M1_MAX))
  scale = jnp.clip(scale, -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
  scale = jnp.where(scale > 0, scale, 1.0)
  values = _divide(blocks, _divide(scale, inverse))
  return scale, jnp.clip(values, -_E2M1_MAX, _E2M1_MAX), 1 / inverse


_RULES = {"fp8_block": _fp8_block, "mxfp4": _mxfp4, "int4_group": _int4_group, "nvfp4": _nvfp4}


def quantize_experts(
  params: MoEParams, config: MoEConfig, expert_quant: str
) -> tuple[MoEParams, MoEConfig]:
  """`params` with `w_gate_up` and `w_down` quantized, and the config that reads them.

  Args:
    params: float parameters of `config` (not quantized already).
    config: their config.
    expert_quant: "fp8_block" or "int4_group" (blocks of `config.quant_block_size`),
      "mxfp4" or "nvfp4".

  Returns:
    (params, config with `expert_quant` set); the other parameters unchanged.

  Raises:
    ValueError: an unknown format, sizes the format cannot block (named by the config), or
      params that do not fit `config`.
  """
  check_params(params, config)
  if config.expert_quant is not None:
    raise ValueError(f"params are quantized already (expert_quant={config.expert_quant!r})")
  quantized = dataclasses.replace(config, expert_quant=expert_quant)
  weights = {
    name: quantize(getattr(params, name), expert_quant, quantized.quant_block)
    for name in QUANTIZED_PARAMS
  }
  return params._replace(**weights), quantized


def dequantize_experts(params: MoEParams, config: MoEConfig) -> tuple[MoEParams, MoEConfig]:
  """Float expert weights (in `config.param_dtype`) and the config without `expert_quant`."""
  check_params(params, config)
  weights = {
    name: getattr(params, name).dequantize(config.param_dtype)
    for name in QUANTIZED_PARAMS
    if is_block_scaled(getattr(params, name))
  }
  return params._replace(**weights), dataclasses.replace(config, expert_quant=None)
