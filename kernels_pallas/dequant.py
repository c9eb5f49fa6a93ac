"""A `BlockScaled` rhs inside a kernel: integer bits in, exact float32 tiles out.

Kernels cannot count on their compiler to convert the narrow floats (Pallas Triton casts
float8_e4m3fn only on sm89+ and has no float4 or e8m0 type at all), so a quantized rhs
reaches a kernel as its integer bits, and each tile is decoded with shifts and masks into
exactly the float32 values `BlockScaled.dequantize` gives, then multiplied by its scales.

- fp8_block: the float8_e4m3fn values bitcast to uint8, one code per byte, same shape.
- mxfp4: the float4_e2m1fn values bitcast in pairs along the last axis to uint8 [..., out/2]:
  byte j of a row holds value 2j in its low nibble and value 2j+1 in its high one (the
  layout of JAX's float4 bitcast and of GPT-OSS's checkpoints).
- int4_group: the int4 values paired the same way (two's-complement nibbles); its scales
  come in 32-row blocks like mxfp4's (`kernel_form` repeats a coarser group's rows).
- nvfp4: float4_e2m1fn values paired as mxfp4's, scales in 16-row blocks: each e4m3 scale
  times its column's global scale, the product `BlockScaled.dequantize` multiplies by.

Scales go in as float32 (e8m0 scales are powers of two, bfloat16 ones widen: exact; nvfp4's
products are the float32 ones the format defines); they are 1/16 of the values or fewer, so
this copy is small next to the weights. A paired format's scale row is kept by column
parity ([..., 2, out/2]: the even columns' scales, then the odd ones'), so that a kernel
loads the scales of each nibble's columns contiguously.

>>> w = BlockScaled(jnp.array([[[0.5, -6.0]]], jnp.float4_e2m1fn),
...                 jnp.ones((1, 1, 2), jnp.float8_e8m0fnu), (32, 1))
>>> rhs = kernel_rhs(w)
>>> rhs.bits.tolist(), [h.tolist() for h in decode(rhs.bits, "mxfp4")]
([[[241]]], [[[[0.5]]], [[[-6.0]]]])
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.formats import FORMATS
from kernels_pallas.quantized import BlockScaled, format_of

# Formats whose bytes hold two values (neighbouring columns, low nibble first), with a scale
# per column and 32 (nvfp4: 16) rows: the kernels read them alike and decode them apart.
PAIRED = tuple(name for name, form in FORMATS.items() if form.paired)
_INT4_KERNEL_ROWS = 32  # rows of an int4_group scale as the kernels load it


def kernel_block(format: str, block: tuple[int, int]) -> tuple[int, int]:
  """The scale block (bi, bo) kernels load a weight of `format` and `block` in
  (`kernel_form`): int4_group's coarser groups as 32 rows, every other block as it is."""
  return (_INT4_KERNEL_ROWS, 1) if format == "int4_group" else tuple(block)


def kernel_form(w: BlockScaled) -> BlockScaled:
  """`w` as the kernels take it: an int4_group weight with groups coarser than 32 rows gets
  each scale repeated over its group's 32-row blocks (the same weight); others as they are."""
  block = kernel_block(format_of(w), w.block)
  if block == w.block:
    return w
  scales = jnp.repeat(w.scales, w.block[0] // block[0], axis=-2)
  return BlockScaled(w.values, scales, block)


class KernelRhs(NamedTuple):
  """A `BlockScaled` weight as a kernel loads it.

  Attributes:
    bits: uint8 [G, in, out] (fp8_block) or [G, in, out/2] (paired: two values a byte).
    scales: float32 [G, ceil(in/bi), ceil(out/bo)] (fp8_block) or [G, in/bi, 2, out/2]
      (paired: by column parity; nvfp4's times the global scale).
    format: its `FORMATS` name.
    block: (bi, bo).
  """

  bits: jax.Array
  scales: jax.Array
  format: str
  block: tuple[int, int]

  @property
  def values_per_byte(self) -> int:
    return 2 if self.format in PAIRED else 1


def kernel_rhs(w: BlockScaled) -> KernelRhs:
  """The bits and float32 scales of `w` (in its `kernel_form`; no float copy of its values
  is made)."""
  w = kernel_form(w)
  name = format_of(w)
  values = w.values
  if name in PAIRED:
    if values.shape[-1] % 2:
      raise ValueError(f"{name} values need an even number of columns, got {values.shape}")
    values = values.reshape(*values.shape[:-1], values.shape[-1] // 2, 2)
  bits = jax.lax.bitcast_convert_type(values, jnp.uint8)
  scales = w.scales.astype(jnp.float32)
  if w.global_scale is not None:
    scales = scales * w.global_scale[..., None, :]
  if name in PAIRED:
    scales = jnp.swapaxes(scales.reshape(*scales.shape[:-1], -1, 2), -1, -2)
  return KernelRhs(bits, scales, name, w.block)


def _minifloat(code: jax.Array, exponent_bits: int, mantissa_bits: int) -> jax.Array:
  """float32 value of IEEE-style codes (sign, exponent, mantissa; no inf; bias 2^(e-1) - 1).

  A normal code becomes a float32 bit pattern (the exponent rebased, the mantissa shifted
  up); a subnormal one is mantissa * 2^(1 - bias - mantissa_bits). Both are exact.
  """
  bias = (1 << (exponent_bits - 1)) - 1
  sign = code >> (exponent_bits + mantissa_bits)
  exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
  mantissa = code & ((1 << mantissa_bits) - 1)
  normal = jax.lax.bitcast_convert_type(
    (sign << 31) | ((exponent + 127 - bias) << 23) | (mantissa << (23 - mantissa_bits)),
    jnp.float32,
  )
  subnormal = mantissa.astype(jnp.float32) * (2.0 ** (1 - bias - mantissa_bits))
  subnormal = jnp.where(sign == 1, -subnormal, subnormal)
  return jnp.where(exponent == 0, subnormal, normal)


def decode(bits: jax.Array, format: str):
  """Exact float32 values of a tile of `KernelRhs.bits`.

  Returns:
    fp8_block: one array shaped like `bits`. The paired formats: (even, odd), each shaped
    like `bits`: the values of the low nibbles (columns 2j) and of the high nibbles (2j+1).
  """
  code = bits.astype(jnp.int32)
  if format == "fp8_block":  # float8_e4m3fn: 4 exponent bits, 3 mantissa bits, NaN = S.1111.111
    value = _minifloat(code, 4, 3)
    return jnp.where((code & 0x7F) == 0x7F, jnp.float32(jnp.nan), value)
  if format == "int4_group":  # two's-complement nibbles
    signed = lambda nibble: ((nibble ^ 8) - 8).astype(jnp.float32)
    return signed(code & 0xF), signed(code >> 4)
  return _minifloat(code & 0xF, 2, 1), _minifloat(code >> 4, 2, 1)  # mxfp4, nvfp4: e2m1


def by_parity(x: jax.Array, tile: int) -> jax.Array:
  """[M, N] with each `tile` columns reordered: the even ones first, then the odd ones (how
  kernels lay out columns that an mxfp4 byte pairs).

  >>> by_parity(jnp.arange(8)[None], 4).tolist()
  [[0, 2, 1, 3, 4, 6, 5, 7]]
  """
  m, n = x.shape
  return x.reshape(m, n // tile, tile // 2, 2).swapaxes(2, 3).reshape(m, n)


def from_parity(x: jax.Array, tile: int) -> jax.Array:
  """The inverse of `by_parity`."""
  m, n = x.shape
  return x.reshape(m, n // tile, 2, tile // 2).swapaxes(2, 3).reshape(m, n)
