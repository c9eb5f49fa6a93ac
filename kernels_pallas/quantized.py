"""`BlockScaled`: a weight stored in a narrow dtype with one scale per block, as checkpoints
ship it (fine-grained fp8: float8_e4m3fn values, a float32 scale per 128x128 block; MXFP4:
float4_e2m1fn values, a power-of-two float8_e8m0fnu scale per 32 values along the
contraction axis; INT4: int4 values, a bfloat16 scale per group of inputs; NVFP4:
float4_e2m1fn values, a float8_e4m3fn scale per 16 inputs and a float32 global scale).

One value travels through the layer and into the kernels (no separate scale arguments):
`values`, `scales` (and NVFP4's `global_scale`) are its pytree leaves, `block` its static aux
data. Indexing the leading axis (`w[e]`, `w[1:3]`) indexes every leaf, so a tile loop slices
one expert's quantized weights and dequantizes only that slice.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.formats import FORMATS


@jax.tree_util.register_pytree_node_class
class BlockScaled:
  """`values` [..., in, out] with `scales` [..., ceil(in/bi), ceil(out/bo)] for blocks
  `block` = (bi, bo): the weight is `values * scales`, each scale broadcast over its block
  (times `global_scale`, where the format has one).

  Attributes:
    values: the quantized values (float8_e4m3fn, float4_e2m1fn, ...).
    scales: one multiplier per block (float32, float8_e8m0fnu, ...), as DeepSeek's
      `weight_scale_inv` is used: dequantized = values * scale.
    block: (bi, bo) static block shape over the last two axes.
    global_scale: None, or float32 [..., out]: a second multiplier per column (NVFP4's
      per-matrix scale, ModelOpt's `weight_scale_2`; kept per column so that a fused
      [gate | up] matrix keeps each half's own, and with the other leaves' rank less one,
      so that its dim 1 splits as theirs does): dequantized = values * (scales * global).

  >>> w = BlockScaled(jnp.ones((2, 4, 6), jnp.float8_e4m3fn), jnp.full((2, 2, 1), 0.5), (2, 6))
  >>> w.shape, w[1].shape, float(w.dequantize()[1, 3, 5])
  ((2, 4, 6), (4, 6), 0.5)
  """

  def __init__(self, values, scales, block: tuple[int, int], global_scale=None):
    self.values = values
    self.scales = scales
    self.block = tuple(int(b) for b in block)
    self.global_scale = global_scale

  def tree_flatten(self):
    return (self.values, self.scales, self.global_scale), self.block

  @classmethod
  def tree_unflatten(cls, block, leaves):
    values, scales, global_scale = leaves
    return cls(values, scales, block, global_scale)

  def parts(self) -> dict[str, jax.Array]:
    """The leaves by name ("values", "scales", and "global_scale" where present): how a
    module stores them, one variable each."""
    parts = {"values": self.values, "scales": self.scales}
    return parts if self.global_scale is None else {**parts, "global_scale": self.global_scale}

  @classmethod
  def from_parts(cls, parts: dict, block: tuple[int, int]) -> BlockScaled:
    """The inverse of `parts`."""
    return cls(parts["values"], parts["scales"], block, parts.get("global_scale"))

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the weight (that of `values`)."""
    return tuple(self.values.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def __getitem__(self, index) -> BlockScaled:
    """Indexes the leading (expert) axes of every leaf; the last two axes stay whole."""
    return jax.tree.map(lambda leaf: leaf[index], self)

  def __repr__(self) -> str:
    more = "" if self.global_scale is None else f", global_scale={_describe(self.global_scale)}"
    return (
      f"BlockScaled(values={_describe(self.values)}, scales={_describe(self.scales)}, "
      f"block={self.block}{more})"
    )

  def expected_scales_shape(self) -> tuple[int, ...]:
    """[..., ceil(in/bi), ceil(out/bo)]: the scale shape `values` and `block` imply."""
    *lead, rows, cols = self.shape
    return (*lead, math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))

  def expected_global_shape(self) -> tuple[int, ...]:
    """[..., out]: the shape of a `global_scale`."""
    return (*self.shape[:-2], self.shape[-1])

  def pad(self, axis: int, size: int) -> BlockScaled:
    """Zero values appended along `axis` (-2 or -1, or its positive index) up to `size`; the
    scales grow to cover them (with 1: a zero value is zero under any scale)."""
    axis = axis % self.ndim
    block = self.block[axis - self.ndim + 2]
    values = _pad_axis(self.values, axis, size, 0)
    scales = _pad_axis(self.scales, axis, -(-size // block), 1)
    global_scale = self.global_scale
    if global_scale is not None and axis == self.ndim - 1:
      global_scale = _pad_axis(global_scale, axis - 1, size, 1)
    return BlockScaled(values, scales, self.block, global_scale)

  def split_columns(self, parts: int) -> list[BlockScaled]:
    """The weight cut into `parts` equal column ranges ([gate | up] halves for 2); each range
    must hold whole scale blocks."""
    cols, block_cols = self.shape[-1], self.block[1]
    if cols % parts or (cols // parts) % block_cols:
      raise ValueError(
        f"cannot split {cols} columns into {parts} parts of whole {block_cols}-column blocks"
      )
    leaves, structure = jax.tree.flatten(self)
    split = [jnp.split(leaf, parts, axis=-1) for leaf in leaves]
    return [jax.tree.unflatten(structure, column) for column in zip(*split, strict=True)]

  @staticmethod
  def concatenate_columns(parts: list[BlockScaled]) -> BlockScaled:
    """The inverse of `split_columns`: the parts side by side (each of whole scale blocks)."""
    return jax.tree.map(lambda *leaves: jnp.concatenate(leaves, axis=-1), *parts)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """values.astype(float32) * scales (* global_scale), each scale broadcast over its
    block; in `dtype`."""
    *_, rows, cols = self.shape
    scales = jnp.asarray(self.scales).astype(jnp.float32)
    scales = jnp.repeat(jnp.repeat(scales, self.block[0], axis=-2), self.block[1], axis=-1)
    scales = scales[..., :rows, :cols]
    if self.global_scale is not None:
      scales = scales * jnp.asarray(self.global_scale, jnp.float32)[..., None, :]
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
    matches = (
      jnp.dtype(w.values.dtype) == form.values
      and form.takes_scales(w.scales.dtype)
      and form.global_scale == (w.global_scale is not None)
      and form.block in (None, w.block)
    )
    if matches:
      return name
  raise ValueError(f"{w!r} is in none of the formats {sorted(FORMATS)}")


def from_qarray(q) -> BlockScaled:
  """A qwix `QArray` rhs [G, in, out] as the `BlockScaled` it is, so that tokamax-style
  callers pass their quantized weights to `gmm` / `moe_mlp` as they are.

  Symmetric, one scale tile per group: fp8 (float8_e4m3fn values, their scales widened to
  float32, any tile) becomes fp8_block; qwix's "mxfp4" (float4_e2m1fn values, power-of-two
  scales per 32 inputs) becomes mxfp4 with its scales as float8_e8m0fnu, its "nvfp4"
  (e4m3-valued scales per 16 inputs, no matrix scale) nvfp4 with e4m3 scales and a global
  scale of 1 (both exact).

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
  if q.qtype == "nvfp4" and block == FORMATS["nvfp4"].block:
    ones = jnp.ones((*values.shape[:-2], values.shape[-1]), jnp.float32)
    return BlockScaled(values, scales.astype(FORMATS["nvfp4"].scales), block, ones)
  if jnp.dtype(values.dtype) == FORMATS["fp8_block"].values:
    return BlockScaled(values, scales.astype(jnp.float32), block)
  raise ValueError(
    f"a QArray of qtype {q.qtype!r} ({jnp.dtype(values.dtype)} values, tiles {block}) is in "
    f"none of the formats {sorted(FORMATS)}"
  )


def is_qarray(a) -> bool:
  """Whether `a` is a qwix `QArray` (checked by its fields: qwix need not be installed)."""
  return all(hasattr(a, name) for name in ("qvalue", "scale", "zero_point", "qtype"))
