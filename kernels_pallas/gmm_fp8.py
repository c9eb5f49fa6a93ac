"""FP8 grouped matmuls for Hopper (Mosaic GPU, wgmma on e4m3 operands): DeepSeek-V3's
block-scaled recipe (`moejax.compute_quant`'s "fp8_deepseek"), forward, dgrad and wgrad.

Each step of a kernel's contraction pipeline multiplies one 128-wide group of both operands on
the tensor cores (exact products of e4m3 values, summed in a fresh accumulator), then adds that
partial sum times the two groups' scales to a float32 total held in registers: the sums are
promoted to float32 at every 128 of the contraction, as DeepSeek-V3 does (the tensor cores'
fp8 sums keep ~14 bits). The operands are quantized in XLA first (`fp8_groups.quantize_groups`,
the emulated recipe's own function, so a kernel and the emulation see the same values).

wgmma reads 8-bit operands K-major only (the contraction is the minor axis of both shared-
memory tiles), so each kernel takes its operands laid out that way:

- `gmm_fp8`: out[rows of g] = q(lhs[rows of g]) @ q(rhs[g]), lhs in 1x128 groups along K,
  rhs [G, K, N] in 128x128 blocks, handed to the kernel as [G, N, K] (the forward's a @ W
  transposes W's fp8 values; the dgrad's g @ W^T, `transpose_rhs`, takes them as they are:
  the same blocks, the same values).
- `tgmm_fp8`: out[g] = q(lhs[rows of g])^T @ q(dout[rows of g]), both quantized per column in
  groups of 128 tokens of one group (the aligned row tiles: a group's last tile holds its
  remaining rows), handed over transposed (tokens minor).

A weight can be quantized once for many calls (`fp8_weight`: both products' layouts, as a
chunked layer's pass uses them for every chunk) and handed to `gmm_fp8` / `gmm_fp8_vjp`
instead of the float weight.

Rows are regrouped into tile-aligned buffers as in `gmm_mosaic` (`metadata.aligned_rows`).
The Mosaic GPU interpreter cannot hand wgmma a transposed tile
(`compat.mosaic_operands_transposed_in_smem`): there the B operands are given [K, N].

Each step waits for its wgmma before scaling its sum (one warpgroup, no ping-pong between two:
the tensor cores idle while the scales are applied); a kernel that overlaps the two is the
next step for speed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.compat import (
  mosaic_operands_transposed_in_smem,
  mosaic_registers,
  out_struct,
  vary_like,
)
from kernels_pallas.fp8_groups import GROUP, quantize_groups
from kernels_pallas.gmm_mosaic import each_used_tile, launch, store_tile
from kernels_pallas.metadata import aligned_rows, gather_rows, max_visits
from kernels_pallas.mosaic_quant import swizzled


@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
  """Block sizes of the fp8 kernels (the contraction step is the recipe's group, 128).

  Attributes:
    block_m: output rows per tile, 64 or 128 (one warpgroup's accumulator); tgmm: rows of
      the weight gradient (K) per tile.
    block_n: output columns per tile, dividing 128 (one weight scale block per tile).
    max_concurrent_steps: TMA pipeline depth, 1 to 4 (4 at the largest blocks: ~194 KiB of
      shared memory with the output tile).
  """

  block_m: int = 128
  block_n: int = 128
  max_concurrent_steps: int = 3

  def __post_init__(self) -> None:
    if self.block_m not in (64, 128):
      raise ValueError(f"block_m={self.block_m} must be 64 or 128 (one warpgroup's rows)")
    if self.block_n not in (32, 64, 128):
      raise ValueError(
        f"block_n={self.block_n} must divide the 128-wide scale blocks: 32, 64 or 128"
      )
    if not 1 <= self.max_concurrent_steps <= 4:  # 4 fit a Hopper's shared memory
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be in [1, 4]")


def _e4m3_tile(shape: tuple[int, int]) -> tuple:
  """The shared-memory transforms of an e4m3 tile: swizzled by its minor axis (one 128-wide
  group, 128 bytes, the widest swizzle; the interpreter's [K, N] tiles: block_n)."""
  return swizzled(jnp.float8_e4m3fn, shape[1])


_ROW, _COLUMN = 0, 1  # which axis of a [bm, bn] tile a vector of scales runs along


def _scaled(part: jax.Array, scales: jax.Array, axis: int, interpret: bool) -> jax.Array:
  """part [bm, bn] times a vector of scales along `axis` (read from a [1, len] shared-memory
  tile into the registers of the wgmma layout, reduced over the other axis)."""
  layout = plgpu.Layout.WGMMA.reduce(1 - axis)
  vector = mosaic_registers(scales, (0,), layout, interpret)
  return part * jax.lax.broadcast_in_dim(vector, part.shape, [axis])


def _group_product(acc_shape, lhs_smem, rhs_tile) -> jax.Array:
  """One 128-wide group's product on the tensor cores, in a fresh float32 accumulator."""

  def product(acc_ref):
    plgpu.wgmma(acc_ref, lhs_smem, rhs_tile)
    return acc_ref[...]  # waits for the wgmma

  return pl.run_scoped(product, plgpu.ACC(acc_shape, jnp.float32))


def _zeros(shape, interpret: bool) -> jax.Array:
  """A float32 total in the wgmma accumulator's layout."""
  zeros = jnp.zeros(shape, jnp.float32)
  return zeros if interpret else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)


def _gmm_fp8_kernel(
  tile_ends_gmem,
  lhs_gmem,
  lhs_scales_gmem,
  rhs_gmem,
  rhs_scales_gmem,
  out_gmem,
  *,
  blocks: Fp8Blocks,
  num_tiles: int,
  k_major: bool,
  interpret: bool,
):
  """out tile (t, n) = sum over K groups k of (lhs[t, k] @ rhs[group(t)][k, n]) * scales.

  Refs: tile_ends [G]; lhs [Ma, K] e4m3 (tile-aligned), lhs_scales [K/128, Ma]; rhs [G, N, K]
  e4m3 (`k_major`, else [G, K, N]), rhs_scales [G, N/128, K/128]; out [Ma, N].
  """
  bm, bn = blocks.block_m, blocks.block_n

  @each_used_tile(tile_ends_gmem, num_tiles, out_gmem.shape[1] // bn)
  def _(tile, col_block, group):
    weight_block = col_block * bn // GROUP

    def step(indices, lhs_smem, lhs_scales_smem, rhs_smem, total):
      (k,) = indices
      part = _group_product((bm, bn), lhs_smem, rhs_smem.transpose((1, 0)) if k_major else rhs_smem)
      part = _scaled(part, lhs_scales_smem, _ROW, interpret)
      return total + part * rhs_scales_gmem[group, weight_block, k]

    rhs_block, rhs_index = (
      ((bn, GROUP), lambda k: (col_block, k))
      if k_major
      else ((GROUP, bn), lambda k: (k, col_block))
    )
    total = plgpu.emit_pipeline(
      step,
      grid=(lhs_gmem.shape[1] // GROUP,),
      in_specs=[
        plgpu.BlockSpec((bm, GROUP), lambda k: (tile, k), transforms=_e4m3_tile((bm, GROUP))),
        plgpu.BlockSpec((1, bm), lambda k: (k, tile)),
        plgpu.BlockSpec(rhs_block, rhs_index, transforms=_e4m3_tile(rhs_block)),
      ],
      max_concurrent_steps=blocks.max_concurrent_steps,
      init_carry=_zeros((bm, bn), interpret),
    )(lhs_gmem, lhs_scales_gmem, rhs_gmem.at[group])
    store_tile(total, out_gmem.at[pl.ds(tile * bm, bm), pl.ds(col_block * bn, bn)])


class KernelRhs(NamedTuple):
  """A product's weight operand quantized in 128x128 blocks, laid out as `gmm_fp8`'s kernel
  reads it: [G, N, K] where wgmma takes fp8 operands K-major (on a GPU), else [G, K, N].

  Attributes:
    values: the e4m3 values as their bits, uint8 (an integer array: a constant for autodiff,
      which a chunked layer's backward pass carries no gradient for).
    scales: [G, N/128, K/128] float32, one per block (in either layout).
  """

  values: jax.Array
  scales: jax.Array


class Fp8Weight(NamedTuple):
  """A weight W [G, K, N] quantized once (128x128 blocks of the stored W) in the layouts both
  of its products read: `forward` for a @ W, `dgrad` for g @ W^T (`fp8_weight`)."""

  forward: KernelRhs
  dgrad: KernelRhs


def kernel_rhs(rhs: jax.Array, *, transpose_rhs: bool, interpret: bool) -> KernelRhs:
  """rhs [G, K, N] ([G, N, K] with `transpose_rhs`) quantized in 128x128 blocks of the stored
  array and laid out for `gmm_fp8`'s kernel (the same values either way: a dgrad reads the
  forward's blocks)."""
  values, scales = quantize_groups(rhs, (GROUP, GROUP))
  if not transpose_rhs:  # the forward's W [G, K, N]: as [G, N, K], the contraction minor
    values, scales = jnp.swapaxes(values, 1, 2), jnp.swapaxes(scales, 1, 2)
  if not mosaic_operands_transposed_in_smem(interpret):  # the interpreter's [K, N] tiles
    values = jnp.swapaxes(values, 1, 2)
  return KernelRhs(jax.lax.bitcast_convert_type(values, jnp.uint8), scales)


def fp8_weight(w: jax.Array, *, interpret: bool = False) -> Fp8Weight:
  """W [G, K, N] quantized once for both of its products (`Fp8Weight`), for a caller that
  multiplies by it many times (each chunk of a layer's pass)."""
  return Fp8Weight(
    kernel_rhs(w, transpose_rhs=False, interpret=interpret),
    kernel_rhs(w, transpose_rhs=True, interpret=interpret),
  )


def _check_sizes(**sizes: int) -> None:
  for name, size in sizes.items():
    if size % GROUP:
      raise ValueError(
        f"fp8_deepseek quantizes in groups of {GROUP}: {name}={size} must be a multiple of {GROUP}"
      )


@functools.partial(jax.jit, static_argnames=("blocks", "transpose_rhs", "out_dtype", "interpret"))
def gmm_fp8(
  lhs: jax.Array,
  rhs: jax.Array | KernelRhs,
  group_sizes: jax.Array,
  *,
  blocks: Fp8Blocks = Fp8Blocks(),
  transpose_rhs: bool = False,
  out_dtype=jnp.float32,
  interpret: bool = False,
) -> jax.Array:
  """Grouped matmul in fp8: out[rows of g] = q(lhs[rows of g]) @ q(rhs[g]) (`rhs[g]^T` with
  `transpose_rhs`), the recipe's forward (a @ W) and dgrad (g @ W^T).

  Args:
    lhs: [M, K] float; quantized in 1x128 groups along K.
    rhs: [G, K, N] float ([G, N, K] with `transpose_rhs`: the weight W [G, in, out] of a dgrad);
      quantized in 128x128 blocks of the stored weight. Or those blocks already quantized,
      `kernel_rhs(rhs, transpose_rhs=..., interpret=...)` with this call's flags.
    group_sizes: [G] int32, sum <= M.
    blocks: `Fp8Blocks`.
    transpose_rhs: multiply by rhs[g]^T.
    out_dtype: the output's dtype.
    interpret: run in the Mosaic GPU interpreter (CPU testing).

  Returns:
    [M, N]; rows outside every group are 0.

  Raises:
    ValueError: lhs and rhs of other contractions, or K or N not a multiple of 128.
  """
  num_rows, k = lhs.shape
  k_major = mosaic_operands_transposed_in_smem(interpret)
  prepared = isinstance(rhs, KernelRhs)
  shape = rhs.values.shape if prepared else rhs.shape
  if prepared:  # [G, N, K] K-major, else [G, K, N]
    groups, n, rhs_k = shape if k_major else (shape[0], shape[2], shape[1])
    layout = "laid out by kernel_rhs"
  else:
    groups, n, rhs_k = (shape[0], *shape[1:][:: 1 if transpose_rhs else -1])
    layout = "[G, N, K] (transpose_rhs)" if transpose_rhs else "[G, K, N]"
  if rhs_k != k:
    raise ValueError(f"lhs {lhs.shape} is [M, K] and rhs {shape} must be {layout}: K differs")
  _check_sizes(K=k, N=n)
  if not prepared:
    rhs = kernel_rhs(rhs, transpose_rhs=transpose_rhs, interpret=interpret)
  rows = aligned_rows(group_sizes, num_rows, blocks.block_m)
  num_tiles = max_visits(num_rows, groups, blocks.block_m)
  lhs_values, lhs_scales = quantize_groups(gather_rows(lhs, rows.row_source), (1, GROUP))
  values = jax.lax.bitcast_convert_type(rhs.values, jnp.float8_e4m3fn)
  kernel = plgpu.kernel(
    functools.partial(
      _gmm_fp8_kernel, blocks=blocks, num_tiles=num_tiles, k_major=k_major, interpret=interpret
    ),
    out_type=out_struct((num_tiles * blocks.block_m, n), jnp.dtype(out_dtype), like=lhs_values),
    **launch(interpret),
  )
  out = kernel(rows.tile_ends, lhs_values, lhs_scales.T, values, rhs.scales)
  return gather_rows(vary_like(out, lhs_values), rows.source_row)


def _tgmm_fp8_kernel(
  tile_starts_gmem,
  tile_counts_gmem,
  lhs_gmem,
  lhs_scales_gmem,
  dout_gmem,
  dout_scales_gmem,
  out_gmem,
  *,
  blocks: Fp8Blocks,
  num_groups: int,
  k_major: bool,
  interpret: bool,
):
  """out[g] tile (i, j) = sum over g's aligned tiles t of (lhs^T[i, t] @ dout[t, j]) * scales.

  Refs: tile_starts, tile_counts [G]; lhs^T [K, Ma] e4m3, lhs_scales [tiles, K]; dout^T
  [N, Ma] e4m3 (`k_major`, else dout [Ma, N]), dout_scales [tiles, N]; out [G, K, N].
  """
  bm, bn = blocks.block_m, blocks.block_n
  k_blocks, n_blocks = lhs_gmem.shape[0] // bm, out_gmem.shape[2] // bn

  @plgpu.nd_loop((num_groups, k_blocks * n_blocks), collective_axes="sm")
  def _tile_loop(loop_info: plgpu.NDLoopInfo):
    group, index = loop_info.index
    k_block, n_block = index // n_blocks, index % n_blocks
    first_tile, group_tiles = tile_starts_gmem[group], tile_counts_gmem[group]

    def step(_, lhs_smem, lhs_scales_smem, dout_smem, dout_scales_smem, total):
      part = _group_product(
        (bm, bn), lhs_smem, dout_smem.transpose((1, 0)) if k_major else dout_smem
      )
      part = _scaled(part, lhs_scales_smem, _ROW, interpret)
      return total + _scaled(part, dout_scales_smem, _COLUMN, interpret)

    dout_block, dout_index = (
      ((bn, GROUP), lambda t: (n_block, first_tile + t))
      if k_major
      else ((GROUP, bn), lambda t: (first_tile + t, n_block))
    )
    pipeline = plgpu.emit_pipeline(
      step,
      grid=(group_tiles,),
      in_specs=[
        plgpu.BlockSpec(
          (bm, GROUP), lambda t: (k_block, first_tile + t), transforms=_e4m3_tile((bm, GROUP))
        ),
        plgpu.BlockSpec((1, bm), lambda t: (first_tile + t, k_block)),
        plgpu.BlockSpec(dout_block, dout_index, transforms=_e4m3_tile(dout_block)),
        plgpu.BlockSpec((1, bn), lambda t: (first_tile + t, n_block)),
      ],
      max_concurrent_steps=blocks.max_concurrent_steps,
      init_carry=_zeros((bm, bn), interpret),
    )
    out_tile = out_gmem.at[group, pl.ds(k_block * bm, bm), pl.ds(n_block * bn, bn)]

    @pl.when(group_tiles > 0)
    def _():
      store_tile(pipeline(lhs_gmem, lhs_scales_gmem, dout_gmem, dout_scales_gmem), out_tile)

    @pl.when(group_tiles == 0)
    def _():
      store_tile(_zeros((bm, bn), interpret), out_tile)


@functools.partial(jax.jit, static_argnames=("blocks", "out_dtype", "interpret"))
def tgmm_fp8(
  lhs: jax.Array,
  dout: jax.Array,
  group_sizes: jax.Array,
  *,
  blocks: Fp8Blocks = Fp8Blocks(),
  out_dtype=jnp.float32,
  interpret: bool = False,
) -> jax.Array:
  """Transposed grouped matmul in fp8, the recipe's wgrad: out[g] = q(lhs[rows of g])^T @
  q(dout[rows of g]), each operand quantized per column in groups of 128 of the group's rows.

  Args:
    lhs: [M, K] float; K a multiple of block_m.
    dout: [M, N] float; N a multiple of block_n.
    group_sizes: [G] int32, sum <= M; rows past the sum are ignored.
    blocks: `Fp8Blocks` (block_m tiles K).
    out_dtype: the output's dtype.
    interpret: run in the Mosaic GPU interpreter (CPU testing).

  Returns:
    [G, K, N]; groups of size 0 give 0.

  Raises:
    ValueError: lhs and dout of other row counts, or K and N off the blocks.
  """
  num_rows, k = lhs.shape
  n = dout.shape[1]
  if dout.shape[0] != num_rows:
    raise ValueError(f"lhs {lhs.shape} and dout {dout.shape} must have the same rows [M, .]")
  if k % blocks.block_m or n % blocks.block_n:
    raise ValueError(f"K={k} and N={n} must be multiples of {blocks.block_m=}, {blocks.block_n=}")
  groups = group_sizes.shape[0]
  rows = aligned_rows(group_sizes, num_rows, GROUP)
  tile_counts = -(-group_sizes.astype(jnp.int32) // GROUP)
  lhs_values, lhs_scales = quantize_groups(gather_rows(lhs, rows.row_source), (GROUP, 1))
  dout_values, dout_scales = quantize_groups(gather_rows(dout, rows.row_source), (GROUP, 1))
  k_major = mosaic_operands_transposed_in_smem(interpret)
  if k_major:
    dout_values = dout_values.T  # [N, Ma]
  kernel = plgpu.kernel(
    functools.partial(
      _tgmm_fp8_kernel, blocks=blocks, num_groups=groups, k_major=k_major, interpret=interpret
    ),
    out_type=out_struct((groups, k, n), jnp.dtype(out_dtype), like=lhs_values),
    **launch(interpret),
  )
  out = kernel(
    rows.tile_ends - tile_counts, tile_counts, lhs_values.T, lhs_scales, dout_values, dout_scales
  )
  return vary_like(out, lhs_values)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def gmm_fp8_vjp(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  rhs_fp8: Fp8Weight | None,
  blocks: Fp8Blocks,
  interpret: bool,
) -> jax.Array:
  """Differentiable fp8 grouped matmul, the whole recipe: [M, K] x [G, K, N] -> [M, N] float32
  by `gmm_fp8`; d(lhs) its dgrad (`gmm_fp8` reading the weights' blocks transposed), d(rhs)
  `tgmm_fp8` (both operands in groups of 128 tokens), each in its input's dtype.

  `rhs_fp8`: `fp8_weight(rhs, interpret=interpret)`, quantized once by a caller that
  multiplies by rhs many times (the products then read it, and rhs only gives d(rhs) its
  dtype), or None to quantize rhs here.
  """
  return _gmm_fp8_fwd(lhs, rhs, group_sizes, rhs_fp8, blocks, interpret)[0]


def _gmm_fp8_fwd(lhs, rhs, group_sizes, rhs_fp8, blocks, interpret):
  forward = rhs if rhs_fp8 is None else rhs_fp8.forward
  out = gmm_fp8(lhs, forward, group_sizes, blocks=blocks, interpret=interpret)
  return out, (lhs, rhs, group_sizes, rhs_fp8)


def _gmm_fp8_bwd(blocks, interpret, residuals, dout):
  lhs, rhs, group_sizes, rhs_fp8 = residuals
  kernels = dict(blocks=blocks, interpret=interpret)
  transposed = rhs if rhs_fp8 is None else rhs_fp8.dgrad
  d_lhs = gmm_fp8(dout, transposed, group_sizes, transpose_rhs=True, **kernels)
  d_rhs = tgmm_fp8(lhs, dout, group_sizes, **kernels)
  return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None, None


gmm_fp8_vjp.defvjp(_gmm_fp8_fwd, _gmm_fp8_bwd)
