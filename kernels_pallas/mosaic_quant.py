"""Quantized rhs tiles in the Mosaic GPU kernel: bytes and scales in, a decoded tile out.

wgmma reads its B operand from shared memory, so each step of `gmm_mosaic`'s pipeline
decodes the quantized tile that TMA brought in (`kernels_pallas.dequant`), multiplies it by
its scales in registers and stores it, in lhs's dtype, to a tile of its own that the wgmma
then reads. Per format:

- fp8_block: the tile lies in one scale block (`fit_blocks`); its scale is one float32,
  read from global memory.
- mxfp4 (int4_group, nvfp4 alike): a byte holds two values of neighbouring columns (low
  nibble first), and every column has its own scale per 32 rows (nvfp4: 16). TMA brings the
  tile's scales too ([rows/bi, 2, cols/2]: by column parity, `KernelRhs.scales`); each
  parity's scales are broadcast over their rows. Read forward, the decoded tile is stored
  with its even columns first, then its odd ones: output columns, which `gmm_mosaic`
  interleaves back. Read transposed, those columns are the contraction's: each half is its
  own tile and wgmma, against the matching half of lhs (laid out by parity).

The paired path gives its row index and scales explicit layouts (the wgmma layout, and its
columns' reduction for a row of scales), which is what Mosaic's layout inference needs to
place the broadcast; the decoded bytes follow from them.

The interpreter cannot hand wgmma a transposed shared-memory tile
(`compat.mosaic_operands_transposed_in_smem`), so there a tile read transposed is decoded,
transposed in registers and stored as [K, N].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.compat import (
  mosaic_iota,
  mosaic_operands_transposed_in_smem,
  mosaic_registers,
)
from kernels_pallas.dequant import PAIRED, decode, kernel_form
from kernels_pallas.quantized import format_of


def swizzled(dtype, minor: int) -> tuple:
  """Shared-memory transforms of a tile whose minor dimension holds `minor` elements."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(minor * itemsize * 8)
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


@dataclasses.dataclass(frozen=True)
class QuantTiles:
  """How one kernel call loads, decodes and multiplies its quantized rhs tiles.

  Attributes:
    format: "fp8_block", or a paired one ("mxfp4", "int4_group", "nvfp4").
    block: the scale block (bi, bo) of the stored [in, out] weight.
    block_k, block_n: the kernel's contraction step and output columns per tile.
    transpose_rhs: the weight is read transposed (stored [N, K]).
    interpret: the kernel runs in the Mosaic GPU interpreter.
  """

  format: str
  block: tuple[int, int]
  block_k: int
  block_n: int
  transpose_rhs: bool
  interpret: bool

  @property
  def paired(self) -> bool:
    """Two values a byte (mxfp4, int4_group, nvfp4): a tile's stored columns come by
    parity."""
    return self.format in PAIRED

  @property
  def split_contraction(self) -> bool:
    """mxfp4 read transposed: the pairs run along the contraction, which is multiplied in
    two halves (even and odd columns of the stored tile), each its own wgmma. Within one
    tile the halves could not be sliced apart, and wgmma's transposed B operand needs the
    swizzle of its A operand, the lhs half."""
    return self.paired and self.transpose_rhs

  @property
  def transpose_in_registers(self) -> bool:
    """A tile read transposed is decoded into a [K, N] tile (where wgmma cannot take a
    transposed one: the interpreter)."""
    return self.transpose_rhs and not mosaic_operands_transposed_in_smem(self.interpret)

  @property
  def stored(self) -> tuple[int, int]:
    """(rows, columns) of the stored weight one tile spans."""
    bk, bn = self.block_k, self.block_n
    return (bn, bk) if self.transpose_rhs else (bk, bn)

  def lhs_specs(self, block_m: int, tile, k: int, dtype) -> list[plgpu.BlockSpec]:
    """The lhs tiles of a step: [bm, bk], or with `split_contraction` its even and odd
    halves [bm, bk/2] from lhs laid out by parity (`by_parity` over all K columns)."""
    width = self.block_k // 2 if self.split_contraction else self.block_k
    transforms = swizzled(dtype, width)
    offsets = (0, k // self.block_k) if self.split_contraction else (0,)
    return [
      plgpu.BlockSpec(
        (block_m, width), lambda kb, o=o: (tile, kb + o), transforms=transforms, delay_release=1
      )
      for o in offsets
    ]

  def rhs_specs(self, index) -> list[plgpu.BlockSpec]:
    """The BlockSpecs of one tile's bits (and mxfp4's scales); `index(step)` gives the
    stored tile's (row block, column block)."""
    rows, cols = self.stored
    width = cols // 2 if self.paired else cols
    bits = plgpu.BlockSpec(
      (rows, width), index, transforms=swizzled(jnp.uint8, width), delay_release=1
    )
    if not self.paired:
      return [bits]
    scales_index = lambda step: (index(step)[0], 0, index(step)[1])
    scales_shape = (rows // self.block[0], 2, width)
    return [bits, plgpu.BlockSpec(scales_shape, scales_index, delay_release=1)]

  def tile_scale(self, scales_gmem, group, tile_index) -> jax.Array:
    """fp8_block: the one scale of the stored tile at (row block, column block) `tile_index`."""
    (row_block, col_block), (rows, cols) = tile_index, self.stored
    return scales_gmem[group, row_block * rows // self.block[0], col_block * cols // self.block[1]]

  def tile_types(self, dtype) -> list[plgpu.SMEM]:
    """The shared-memory tiles the decoded values go to, as the wgmma reads them: one, or
    with `split_contraction` one per half."""
    rows, cols = self.stored
    cols //= 2 if self.split_contraction else 1
    shape = (cols, rows) if self.transpose_in_registers else (rows, cols)
    # mxfp4 read forward stores its halves side by side: swizzle within a half.
    minor = shape[1] // 2 if self.paired and not self.transpose_rhs else shape[1]
    tile = plgpu.SMEM(shape, dtype, transforms=swizzled(dtype, minor))
    return [tile] * (2 if self.split_contraction else 1)

  def decode_into(self, tile_smems, bits_smem, scales) -> None:
    """tile_smems <- the decoded tile times its scales, in their dtype.

    `scales`: fp8_block's one scale, or a paired format's [rows/bi, 2, cols/2] shared-memory
    tile.
    """
    for part, tile in enumerate(self._scaled_parts(bits_smem, scales)):
      tile = tile.astype(tile_smems[0].dtype)
      tile_smem = tile_smems[part] if self.split_contraction else tile_smems[0]
      if self.paired and not self.transpose_rhs:  # forward: halves side by side
        width = tile.shape[1]
        tile_smem = tile_smem.at[:, pl.ds(part * width, width)]
      tile_smem[...] = tile.T if self.transpose_in_registers else tile
    plgpu.commit_smem()

  def _scaled_parts(self, bits_smem, scales) -> list[jax.Array]:
    """The decoded tile times its scales: [rows, cols], or mxfp4's even and odd columns."""
    if not self.paired:
      return [decode(bits_smem[...], self.format) * scales]
    layout = plgpu.Layout.WGMMA
    bits = bits_smem[...]  # [rows, cols/2]; its layout follows from the iota and scales
    rows = mosaic_iota(bits.shape, 0, layout, self.interpret)
    parts = []
    for parity, values in enumerate(decode(bits, self.format)):
      scale = jnp.zeros(bits.shape, jnp.float32)
      for block_row in range(bits.shape[0] // self.block[0]):
        index = (block_row, parity)
        column_scales = mosaic_registers(scales, index, layout.reduce(0), self.interpret)
        row_scales = jax.lax.broadcast_in_dim(column_scales, bits.shape, [1])
        scale = jnp.where(rows // self.block[0] == block_row, row_scales, scale)
      parts.append(values * scale)
    return parts

  def multiply(self, acc_ref, lhs_smems, tile_smems) -> None:
    """acc += lhs tile @ the decoded rhs tile (one wgmma, or one per contraction half)."""
    read_transposed = self.transpose_rhs and not self.transpose_in_registers
    for lhs_smem, tile_smem in zip(lhs_smems, tile_smems, strict=True):
      plgpu.wgmma(acc_ref, lhs_smem, tile_smem.transpose((1, 0)) if read_transposed else tile_smem)


def fit_blocks(blocks, rhs, transpose_rhs: bool = False):
  """`blocks` adjusted so that every tile of `rhs` has the scales its format decodes (the
  same blocks read forward and `transpose_rhs`).

  fp8_block: block_k and block_n both divide the scale block's bi and bo (read forward and
  transposed, a tile spans either way round), so one scale covers a tile; both at least 32
  (a row of bytes needs 32+ for a swizzle). The paired formats (int4_group in its
  `kernel_form`; scale blocks of 32 or 16 rows): block_k = 64 and block_n a multiple of 64
  (a tile of bytes in the wgmma layout has 64-row multiples, and its rows of packed bytes
  need 32+).

  Raises:
    NotImplementedError: no such blocks fit the scale block.
  """
  del transpose_rhs
  rhs = kernel_form(rhs)
  if format_of(rhs) in PAIRED:
    block_n = max(64, blocks.block_n // 64 * 64)
    return dataclasses.replace(blocks, block_k=64, block_n=block_n)
  limit = math.gcd(*rhs.block)
  block_k = next((b for b in (64, 32) if b <= max(blocks.block_k, 32) and limit % b == 0), 0)
  block_n = next((b for b in range(max(blocks.block_n, 32), 31, -8) if limit % b == 0), 0)
  if not (block_k and block_n):
    raise NotImplementedError(f"mosaic needs tiles of >= 32 within a {rhs.block} scale block")
  return dataclasses.replace(blocks, block_k=block_k, block_n=block_n)
