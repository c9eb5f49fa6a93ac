"""Quantized expert weights: float experts to `BlockScaled` and back.

`quantize_experts` stores `w_gate_up` and `w_down` in a checkpoint format
(`MoEConfig.expert_quant`), by the format's rule (`kernels_pallas.formats`: how each
rounds, its scales and blocks). `dequantize_experts` is the inverse map to float weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.formats import FORMATS
from kernels_pallas.quantized import BlockScaled, is_block_scaled
from moejax.call_record import call_record
from moejax.config import MoEConfig
from moejax.inputs import check_params
from moejax.params import QUANTIZED_PARAMS, MoEParams


def _blocks(w: jax.Array, block: tuple[int, int]) -> jax.Array:
  """[..., in, out] -> [..., in/bi, bi, out/bo, bo], zero padded to whole blocks. One axis is
  split at a time: an explicitly sharded weight's leading axes keep their sharding."""
  *lead, rows, cols = w.shape
  pad_rows, pad_cols = -rows % block[0], -cols % block[1]
  w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, pad_rows), (0, pad_cols)])
  w = w.reshape(*lead, (rows + pad_rows) // block[0], block[0], cols + pad_cols)
  return w.reshape(*lead, (rows + pad_rows) // block[0], block[0], -1, block[1])


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
  scale, values, global_scale = form.rule(blocks, amax)
  values = values.reshape(*blocks.shape[:-2], -1)  # one axis merged at a time, as `_blocks`
  values = values.reshape(*lead, -1, values.shape[-1])[..., :rows, :cols]
  scale = scale[..., 0, :, 0].astype(form.scales)
  if global_scale is not None:  # one per matrix, kept per column
    global_scale = jnp.broadcast_to(global_scale.reshape(*lead, 1), (*lead, cols))
  return BlockScaled(values.astype(form.values), scale, block, global_scale)


def quantize_experts(
  params: MoEParams, config: MoEConfig, expert_quant: str
) -> tuple[MoEParams, MoEConfig]:
  """`params` with `w_gate_up` and `w_down` quantized, and the config that reads them.

  Args:
    params: float parameters of `config` (not quantized already).
    config: their config.
    expert_quant: "fp8_block" or "int4_group" (blocks of `config.quant_block_size`, else
      the format's default: `QuantFormat.block_for`), "mxfp4" or "nvfp4".

  Returns:
    (params, config with `expert_quant` set); the other parameters unchanged.

  Raises:
    ValueError: an unknown format, sizes the format cannot block (named by the config), or
      params that do not fit `config`.
  """
  check_params(params, call_record(config))
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
  check_params(params, call_record(config))
  weights = {
    name: getattr(params, name).dequantize(config.param_dtype)
    for name in QUANTIZED_PARAMS
    if is_block_scaled(getattr(params, name))
  }
  return params._replace(**weights), dataclasses.replace(config, expert_quant=None)
