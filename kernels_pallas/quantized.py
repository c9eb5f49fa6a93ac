"""`BlockScaled`: a weight stored in a narrow dtype with one scale per block, as checkpoints
ship it (fine-grained fp8: float8_e4m3fn values, a float32 scale per 128x128 block; MXFP4:
float4_e2m1fn values, a power-of-two float8_e8m0fnu scale per 32 values along the
contraction axis; INT4: int4 values, a bfloat16 scale per group of inputs).

One value travels through the layer and into the kernels (no separate scale arguments):
`values` and `scales` are its pytree leaves, `block` its static aux data. Indexing the leading
axis (`w[e]`, `w[1:3]`) indexes both leaves, so a tile loop slices one expert's quantized
weights and dequantizes only that slice.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_pytree_node_class
class BlockScaled:
  """`values` [..., in, out] with `scales` [..., ceil(in/bi), ceil(out/bo)] for blocks
  `block` = (bi, bo): the weight is `values * scales`, each scale broadcast over its block.

  Attributes:
    values: the quantized values (float8_e4m3fn, float4_e2m1fn, ...).
    scales: one multiplier per block (float32, float8_e8m0fnu, ...), as DeepSeek's
      `weight_scale_inv` is used: dequantized = values * scale.
    block: (bi, bo) static block shape over the last two axes.

  >>> w = BlockScaled(jnp.ones((2, 4, 6), jnp.float8_e4m3fn), jnp.full((2, 2, 1), 0.5), (2, 6))
  >>> w.shape, w[1].shape, float(w.dequantize()[1, 3, 5])
  ((2, 4, 6), (4, 6), 0.5)
  """

  def __init__(self, values, scales, block: tuple[int, int]):
    self.values = values
    self.scales = scales
    self.block = tuple(int(b) for b in block)

  def tree_flatten(self):
    return (self.values, self.scales), self.block

  @classmethod
  def tree_unflatten(cls, block, leaves):
    return cls(*leaves, block)

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the weight (that of `values`)."""
    return tuple(self.values.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def __getitem__(self, index) -> BlockScaled:
    """Indexes the leading (expert) axes of both leaves; the last two axes stay whole."""
    return BlockScaled(self.values[index], self.scales[index], self.block)

  def __repr__(self) -> str:
    return (
      f"BlockScaled(values={_describe(self.values)}, scales={_describe(self.scales)}, "
      f"block={self.block})"
    )

  def expected_scales_shape(self) -> tuple[int, ...]:
    """[..., ceil(in/bi), ceil(out/bo)]: the scale shape `values` and `block` imply."""
    *lead, rows, cols = self.shape
    return (*lead, math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))

  def pad(self, axis: int, size: int) -> BlockScaled:
    """Zero values appended along `axis` (-2 or -1, or its positive index) up to `size`; the
    scales grow to cover them (with 1: a zero value is zero under any scale)."""
    axis = axis % self.ndim
    block = self.block[axis - self.ndim + 2]
    values = _pad_axis(self.values, axis, size, 0)
    return BlockScaled(values, _pad_axis(self.scales, axis, -(-size // block), 1), self.block)

  def split_columns(self, parts: int) -> list[BlockScaled]:
    """The weight cut into `parts` equal column ranges ([gate | up] halves for 2); each range
    must hold whole scale blocks."""
    cols, block_cols = self.shape[-1], self.block[1]
    if cols % parts or (cols // parts) % block_cols:
      raise ValueError(
        f"cannot split {cols} columns into {parts} parts of whole {block_cols}-column blocks"
      )
    values = jnp.split(self.values, parts, axis=-1)
    scales = jnp.split(self.scales, parts, axis=-1)
    return [BlockScaled(v, s, self.block) for v, s in zip(values, scales, strict=True)]

  @staticmethod
  def concatenate_columns(parts: list[BlockScaled]) -> BlockScaled:
    """The inverse of `split_columns`: the parts side by side (each of whole scale blocks)."""
    values = jnp.concatenate([p.values for p in parts], axis=-1)
    return BlockScaled(values, jnp.concatenate([p.scales for p in parts], -1), parts[0].block)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """values.astype(float32) * scales, each scale broadcast over its block; in `dtype`."""
    *_, rows, cols = self.shape
    scales = jnp.asarray(self.scales).astype(jnp.float32)
    scales = jnp.repeat(jnp.repeat(scales, self.block[0], axis=-2), self.block[1], axis=-1)
    scales = scales[..., :rows, :cols]
    return (jnp.asarray(self.values).astype(jnp.float32) * scales).astype(dtype)


def _pad_axis(a, axis: int, size: int, fill) -> jax.Array:
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, size - a.shape[axis])
  return jnp.pad(a, widths, constant_values=jnp.asarray(fill, a.dtype))


def _describe(a) -> str:
  return f"{np.dtype(a.dtype).name}{list(a.shape)}"


def is_block_scaled(a) -> bool:
  """Whether `a` is a `BlockScaled` weight (else a plain array, or None)."""
  return isinstance(a, BlockScaled)


class QuantFormat(NamedTuple):
  """A checkpoint format of `BlockScaled` weights.

  Attributes:
    values: dtype of the quantized values.
    scales: dtype of the scales (what quantizing writes).
    block: the fixed (bi, bo) block, or None where the checkpoint chooses it.
    other_scales: further scale dtypes checkpoints of the format store (kept as stored).
  """

  values: jnp.dtype
  scales: jnp.dtype
  block: tuple[int, int] | None
  other_scales: tuple[jnp.dtype, ...] = ()

  def takes_scales(self, dtype) -> bool:
    """Whether `dtype` is one of the format's scale dtypes."""
    return jnp.dtype(dtype) in (self.scales, *self.other_scales)


# The formats by name: DeepSeek-V3's fine-grained fp8, OCP MXFP4 (GPT-OSS), and symmetric
# INT4 with a scale per group of inputs (compressed-tensors' pack-quantized: Kimi-K2-Thinking,
# K2.5; blocks (group, 1)).
FORMATS = {
  "fp8_block": QuantFormat(jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32), None),
  "mxfp4": QuantFormat(jnp.dtype(jnp.float4_e2m1fn), jnp.dtype(jnp.float8_e8m0fnu), (32, 1)),
  "int4_group": QuantFormat(
    jnp.dtype(jnp.int4), jnp.dtype(jnp.bfloat16), None, (jnp.dtype(jnp.float32),)
  ),
}


def format_of(w) -> str | None:
  """The `FORMATS` name of a `BlockScaled` weight, None for a plain array.

  >>> format_of(BlockScaled(jnp.ones((2, 64, 8), jnp.float4_e2m1fn),
  ...                       jnp.ones((2, 2, 8), jnp.float8_e8m0fnu), (32, 1)))
  'mxfp4'

  Raises:
    ValueError: a `BlockScaled` of dtypes or a block no format has.
  """
  if not is_block_scaled(w):
    return None
  for name, form in FORMATS.items():
    same_values = jnp.dtype(w.values.dtype) == form.values
    if same_values and form.takes_scales(w.scales.dtype) and form.block in (None, w.block):
      return name
  raise ValueError(f"{w!r} is in none of the formats {sorted(FORMATS)}")


def from_qarray(q) -> BlockScaled:
  """A qwix `QArray` rhs [G, in, out] as the `BlockScaled` it is, so that tokamax-style
  callers pass their quantized weights to `gmm` / `moe_mlp` as they are.

  Symmetric, one scale tile per group: fp8 (float8_e4m3fn values, their scales widened to
  float32, any tile) becomes fp8_block; qwix's "mxfp4" (float4_e2m1fn values, power-of-two
  scales per 32 inputs) becomes mxfp4 with its scales as float8_e8m0fnu (exact).

  Raises:
    ValueError: an asymmetric QArray, scales shared across groups, or another format.
  """
  tiles = tuple(getattr(q, "scale_tile_shape", ()))
  if q.zero_point is not None or len(tiles) != 3 or tiles[0] != 1:
    raise ValueError(
      f"a QArray rhs must be symmetric with one scale tile per group; got tiles {tiles} and "
      f"zero_point {'set' if q.zero_point is not None else None}"
    )
  block = tiles[1:]
  values, scales = q.qvalue, q.scale
  if q.qtype == "mxfp4" and block == FORMATS["mxfp4"].block:
    return BlockScaled(values, scales.astype(FORMATS["mxfp4"].scales), block)
  if jnp.dtype(values.dtype) == FORMATS["fp8_block"].values:
    return BlockScaled(values, scales.astype(jnp.float32), block)
  raise ValueError(
    f"a QArray of qtype {q.qtype!r} ({jnp.dtype(values.dtype)} values, tiles {block}) is in "
    f"none of the formats {sorted(FORMATS)}"
  )


def is_qarray(a) -> bool:
  """Whether `a` is a qwix `QArray` (checked by its fields: qwix need not be installed)."""
  return all(hasattr(a, name) for name in ("qvalue", "scale", "zero_point", "qtype"))
