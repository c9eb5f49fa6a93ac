"""Grouped matmul for Hopper in Pallas Mosaic GPU (TMA loads, wgmma), with a gated epilogue.

Design: rather than masking ragged rows inside the kernel, rows are first regrouped into a
tile-aligned buffer (`metadata.aligned_rows`): each group's rows start on a fresh tile of
`block_m` rows, so every output tile belongs to one group, is loaded and stored whole by the
TMA engine, and the kernel needs no row masks or partial stores. The price is one gather of
lhs rows in and one gather of output rows back (the latter also applies the row weights), both
plain XLA ops. The tile count is bounded statically by `cdiv(M, bm) + G - 1`; each SM walks
(tile, column block) pairs with `plgpu.nd_loop` and skips tiles past the used ones.

The tile's group is found in-kernel from the groups' tile ends by an unrolled count over G
(static reads of a small [G] array), like upstream's ragged_dot_mgpu.

The backward pass needs two more products, both here so that Hopper training runs on this
backend alone: d(lhs) = dout @ rhs[g]^T reads rhs tiles transposed in shared memory
(`transpose_rhs`, no XLA transpose of the weights), and d(rhs)[g] = lhs[rows of g]^T @ dout[rows
of g] is `tgmm_mosaic`, which walks each group's aligned row tiles as its contraction axis.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import platform
from kernels_pallas.compat import (
  mosaic_interpret_params,
  mosaic_operands_transposed_in_smem,
  out_struct,
  target_num_sms,
  vary_like,
)
from kernels_pallas.dequant import by_parity, from_parity, kernel_rhs
from kernels_pallas.metadata import aligned_rows, gather_rows
from kernels_pallas.mosaic_quant import QuantTiles, fit_blocks, swizzled
from kernels_pallas.quantized import BlockScaled, is_block_scaled

_WGMMA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_INTERPRETED_SMS = 4  # programs the interpreter simulates: each one is slow on a CPU


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
  """Block sizes of the Mosaic GPU kernel.

  Attributes:
    block_m: rows per tile (a multiple of 64, one warpgroup's wgmma M).
    block_n: output columns per tile (a multiple of 8, at most 256).
    block_k: contraction step; block_k * itemsize must be a TMA swizzle width (32..128 bytes).
    max_concurrent_steps: TMA pipeline depth (shared-memory buffers per operand), >= 2: a
      slot is refilled one step after its use (`delay_release=1`), once the wgmma that read
      it has finished (each step waits for all but its own wgmma).
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4

  def __post_init__(self) -> None:
    if self.block_m % 64:
      raise ValueError(f"block_m={self.block_m} must be a multiple of 64")
    if self.block_n % 8 or not 8 <= self.block_n <= 256:
      raise ValueError(f"block_n={self.block_n} must be a multiple of 8 in [8, 256]")
    if self.block_k not in (16, 32, 64):
      raise ValueError(f"block_k={self.block_k} must be 16, 32 or 64 (bf16 swizzle widths)")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2")


# The forward kernel's blocks worth timing beside `default_blocks` (bf16 gmm): what
# `moejax.tune` and `benchmarks/gpu_kernels.py --tune` measure (`Backend.candidate_blocks`).
CANDIDATE_BLOCKS = tuple(
  MosaicBlocks(block_m, block_n, 64, steps)
  for block_m in (64, 128)
  for block_n in (128, 256)
  for steps in (3, 4)
)


def default_blocks(num_rows: int, k: int, n: int) -> MosaicBlocks:
  """A heuristic per shape class: few rows (decode) take 64-row tiles."""
  return MosaicBlocks(block_m=64 if num_rows <= 512 else 128, block_n=128, block_k=64)


# Precisions whose products wgmma computes for bf16/f16 inputs: the input dtype, f32 sums.
_PRECISIONS = (
  None,
  jax.lax.Precision.DEFAULT,
  jax.lax.DotAlgorithmPreset.DEFAULT,
  jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
  jax.lax.DotAlgorithmPreset.F16_F16_F32,
)


def unsupported_reason(dtype, activation: str | None, precision=None) -> str | None:
  """Why the Mosaic kernels cannot run this case, or None."""
  if jnp.dtype(dtype) not in _WGMMA_DTYPES:
    return f"mosaic runs bf16/f16 wgmma only, got {jnp.dtype(dtype)}"
  if activation not in (None, "silu"):
    return f"mosaic's epilogue has only silu, got {activation!r}; use triton or xla for it"
  if precision not in _PRECISIONS:
    return f"mosaic multiplies in the input dtype with f32 sums; {precision=} is not supported"
  return None


def store_tile(value: jax.Array, out_gmem_tile) -> None:
  """Writes a [rows, cols] register tile to global memory through shared memory (TMA)."""

  @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM(value.shape, out_gmem_tile.dtype))
  def _(out_smem):
    out_smem[...] = value.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem_tile)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def tile_group(tile_ends_gmem, tile: jax.Array, num_groups: int) -> jax.Array:
  """Group of an aligned tile: how many groups end at or before it (unrolled over G)."""
  group = jnp.int32(0)
  for g in range(num_groups - 1):
    group += (tile >= tile_ends_gmem[g]).astype(jnp.int32)
  return group


def each_used_tile(tile_ends_gmem, num_tiles: int, col_blocks: int):
  """Decorator: runs body(tile, col_block, group) for every (aligned row tile, column block)
  of the used tiles (`tile_ends_gmem` [G]: each group's end), the pairs spread over the SMs
  (a persistent loop over the static bound `num_tiles`)."""
  num_groups = tile_ends_gmem.shape[0]
  used_tiles = tile_ends_gmem[num_groups - 1]

  def loop(body) -> None:
    @plgpu.nd_loop((num_tiles * col_blocks,), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      (index,) = loop_info.index
      tile, col_block = index // col_blocks, index % col_blocks

      @pl.when(tile < used_tiles)
      def _():
        body(tile, col_block, tile_group(tile_ends_gmem, tile, num_groups))

  return loop


@dataclasses.dataclass(frozen=True)
class _AlignedCall:
  """The static choices of one `gmm_mosaic` kernel, shared by every program.

  Attributes:
    blocks: the `MosaicBlocks`.
    num_tiles: the static bound on aligned row tiles (`metadata.max_visits`).
    gated: the silu-gated epilogue over [gate | up] columns.
    transpose_rhs: rhs read as [G, N, K].
    quant: the quantized rhs's tile rules, or None for a float rhs.
  """

  blocks: MosaicBlocks
  num_tiles: int
  gated: bool
  transpose_rhs: bool
  quant: QuantTiles | None


class _TileSpecs(NamedTuple):
  """Step 1's result: what the K pipeline of one output tile loads.

  Attributes:
    stored_index: per accumulator (gate, and up when gated), K step -> the stored rhs tile.
    lhs: the lhs row tile's specs (one, or a quantized rhs's parity halves).
    rhs: each accumulator's rhs specs, `per_tile` apiece (bits, and scales if tiled).
    per_tile: refs per rhs tile.
  """

  stored_index: list
  lhs: list
  rhs: list
  per_tile: int


def _tile_specs(call: _AlignedCall, tile, col_block, lhs_gmem, out_cols: int) -> _TileSpecs:
  """Step 1: the pipeline's BlockSpecs for output tile (tile, col_block)."""
  bm, bn, bk = call.blocks.block_m, call.blocks.block_n, call.blocks.block_k
  transforms = swizzled(lhs_gmem.dtype, bk)
  # Gate columns [n*bn, (n+1)*bn); with the gated epilogue also up columns at +N'.
  col_offsets = (0, out_cols // bn) if call.gated else (0,)
  # The stored tile (row block, column block) of step kb: rhs[g] is [N, K] read transposed
  # (loaded as [bn, bk] tiles, multiplied by their transpose), else [K, N].
  stored_index = [
    (lambda kb, o=o: (col_block + o, kb))
    if call.transpose_rhs
    else (lambda kb, o=o: (kb, col_block + o))
    for o in col_offsets
  ]
  if call.quant:
    lhs = call.quant.lhs_specs(bm, tile, lhs_gmem.shape[1], lhs_gmem.dtype)
    rhs = [spec for index in stored_index for spec in call.quant.rhs_specs(index)]
  else:
    lhs = [plgpu.BlockSpec((bm, bk), lambda kb: (tile, kb), transforms=transforms, delay_release=1)]
    tile_shape = (bn, bk) if call.transpose_rhs else (bk, bn)
    rhs = [
      plgpu.BlockSpec(tile_shape, index, transforms=transforms, delay_release=1)
      for index in stored_index
    ]
  return _TileSpecs(stored_index, lhs, rhs, len(rhs) // len(col_offsets))


def _k_loop(call: _AlignedCall, specs: _TileSpecs, group, refs, acc_refs, tile_smems) -> tuple:
  """Step 2: acc_refs += lhs tile @ rhs[group] tiles over the K steps (a TMA pipeline; a
  quantized tile is decoded into its `tile_smems` buffer before its wgmma). Returns the
  accumulators' values."""
  lhs_gmem, rhs_gmem, scales_gmem = refs
  quant = call.quant

  def step(indices, *smems):
    lhs_smems, rhs_smems = smems[: len(specs.lhs)], smems[len(specs.lhs) :]
    for i, acc_ref in enumerate(acc_refs):
      rhs_smem, *scales_smem = rhs_smems[i * specs.per_tile : (i + 1) * specs.per_tile]
      if not quant:
        rhs_tile = rhs_smem.transpose((1, 0)) if call.transpose_rhs else rhs_smem
        plgpu.wgmma(acc_ref, lhs_smems[0], rhs_tile)
        continue
      scales = scales_smem or [
        quant.tile_scale(scales_gmem, group, specs.stored_index[i](indices[0]))
      ]
      quant.decode_into(tile_smems[i], rhs_smem, scales[0])
      quant.multiply(acc_ref, lhs_smems, tile_smems[i])
    # A decoded tile is rewritten next step: its wgmma must be done by then.
    plgpu.wgmma_wait(0 if quant else 1)

  rhs_operands = [rhs_gmem.at[group]] + ([scales_gmem.at[group]] if specs.per_tile == 2 else [])
  plgpu.emit_pipeline(
    step,
    grid=(lhs_gmem.shape[1] // call.blocks.block_k,),
    in_specs=[*specs.lhs, *specs.rhs],
    max_concurrent_steps=call.blocks.max_concurrent_steps,
  )(*[lhs_gmem] * len(specs.lhs), *rhs_operands * len(acc_refs))
  return tuple(acc_ref[...] for acc_ref in acc_refs)


def _accumulate(call: _AlignedCall, specs: _TileSpecs, group, refs) -> tuple:
  """Step 3: the K loop inside its scoped memory: float32 accumulators in registers and, for
  a quantized rhs, shared-memory buffers for the decoded tiles (scoped apart from them)."""
  accumulators = len(specs.stored_index)
  acc_types = [plgpu.ACC((call.blocks.block_m, call.blocks.block_n), jnp.float32)] * accumulators
  if not call.quant:
    return pl.run_scoped(lambda *accs: _k_loop(call, specs, group, refs, accs, ()), *acc_types)
  tile_types = call.quant.tile_types(refs[0].dtype)
  per_acc = len(tile_types)

  def with_tiles(*tiles):
    tile_smems = [tiles[i : i + per_acc] for i in range(0, len(tiles), per_acc)]
    return pl.run_scoped(
      lambda *accs: _k_loop(call, specs, group, refs, accs, tile_smems), *acc_types
    )

  return pl.run_scoped(with_tiles, *tile_types * accumulators)


def _gmm_aligned_kernel(tile_ends_gmem, lhs_gmem, rhs_gmem, *refs, call: _AlignedCall):
  """out tile (t, n) = epilogue(lhs tile t @ rhs[group(t)][:, n-block]), tiles past used skipped.

  Refs: tile_ends [G], lhs [Ma, K] (tile-aligned), rhs [G, K, N] ([G, N, K] with
  `transpose_rhs`), then with `quant` the rhs's float32 scales (rhs holds the uint8 bits of
  a `kernels_pallas.dequant.KernelRhs`), then out [Ma, N'] (N' = N/2 gated).
  """
  scales_gmem = refs[0] if call.quant else None
  out_gmem = refs[-1]
  bm, bn = call.blocks.block_m, call.blocks.block_n
  out_cols = out_gmem.shape[1]

  @each_used_tile(tile_ends_gmem, call.num_tiles, out_cols // bn)
  def _(tile, col_block, group):
    specs = _tile_specs(call, tile, col_block, lhs_gmem, out_cols)
    accs = _accumulate(call, specs, group, (lhs_gmem, rhs_gmem, scales_gmem))
    # Step 4, the epilogue: silu(gate) * up, or the product, stored through shared memory.
    out = accs[0] / (1.0 + jnp.exp(-accs[0])) * accs[1] if call.gated else accs[0]
    store_tile(out, out_gmem.at[pl.ds(tile * bm, bm), pl.ds(col_block * bn, bn)])


@functools.partial(
  jax.jit,
  static_argnames=("blocks", "activation", "transpose_rhs", "out_dtype", "precision", "interpret"),
)
def gmm_mosaic(
  lhs: jax.Array,
  rhs: jax.Array | BlockScaled,
  group_sizes: jax.Array,
  row_weights: jax.Array | None = None,
  *,
  blocks: MosaicBlocks,
  activation: str | None = None,
  transpose_rhs: bool = False,
  out_dtype=None,
  precision=None,
  interpret: bool = False,
) -> jax.Array:
  """Grouped matmul (ragged rows) on Hopper, with optional silu-gated and row-weight epilogues.

  Args:
    lhs: [M, K] bf16/f16; K a multiple of block_k.
    rhs: [G, K, N] ([G, N, K] with `transpose_rhs`, read transposed in shared memory), lhs's
      dtype; N (N/2 gated) a multiple of block_n. Or a `BlockScaled` (fp8_block, mxfp4,
      int4_group, nvfp4): each tile's bytes are decoded in registers, scaled and stored to shared
      memory in lhs's dtype for the wgmma (`kernels_pallas.mosaic_quant`); `blocks` must fit
      its scale blocks (`fit_blocks`, which `ops` applies).
    group_sizes: [G] int32, sum <= M.
    row_weights: [M] or None; scales the output rows (applied while gathering them back).
    blocks: `MosaicBlocks`.
    activation: None or "silu" (the gated epilogue over [gate | up] columns).
    transpose_rhs: read rhs as [G, N, K].
    out_dtype: output dtype (default lhs.dtype).
    precision: one of the precisions `unsupported_reason` accepts (wgmma multiplies in the
      input dtype and sums in float32); kept for the backends' common signature.
    interpret: run in the Mosaic GPU interpreter (CPU testing).

  Returns:
    [M, N] (or [M, N/2] gated); rows outside every group are 0.
  """
  del precision
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  rows = aligned_rows(group_sizes, lhs.shape[0], blocks.block_m)
  out = gmm_mosaic_tiles(
    gather_rows(lhs, rows.row_source),
    rhs,
    rows.tile_ends,
    blocks=blocks,
    activation=activation,
    transpose_rhs=transpose_rhs,
    out_dtype=out_dtype,
    interpret=interpret,
  )
  out = gather_rows(out, rows.source_row)
  if row_weights is not None:
    out = (out.astype(jnp.float32) * row_weights[:, None].astype(jnp.float32)).astype(out_dtype)
  return out


@functools.partial(
  jax.jit, static_argnames=("blocks", "activation", "transpose_rhs", "out_dtype", "interpret")
)
def gmm_mosaic_tiles(
  lhs_tiles: jax.Array,
  rhs: jax.Array | BlockScaled,
  tile_ends: jax.Array,
  *,
  blocks: MosaicBlocks,
  activation: str | None = None,
  transpose_rhs: bool = False,
  out_dtype=None,
  interpret: bool = False,
) -> jax.Array:
  """`gmm_mosaic`'s kernel on rows already regrouped into whole tiles of `block_m` rows.

  Args:
    lhs_tiles: [Ma, K], Ma = `metadata.max_visits(M, G, block_m) * block_m`: the rows as
      `metadata.aligned_rows` places them (`gather_rows(lhs, row_source)`).
    rhs: as for `gmm_mosaic`.
    tile_ends: [G] int32, `aligned_rows(...).tile_ends`.
    blocks, activation, transpose_rhs, out_dtype, interpret: as for `gmm_mosaic`.

  Returns:
    [Ma, N] (or [Ma, N/2] gated), in tiles as lhs_tiles; the rows of the tiles past the
    groups' last are not written (their contents are undefined).
  """
  quantized = kernel_rhs(rhs) if is_block_scaled(rhs) else None
  if quantized is not None and fit_blocks(blocks, rhs, transpose_rhs) != blocks:
    raise ValueError(f"{blocks} do not fit the {rhs.block} scale blocks (see fit_blocks)")
  if transpose_rhs and not mosaic_operands_transposed_in_smem(interpret) and quantized is None:
    rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), False
  num_rows, k = lhs_tiles.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out_cols = n // 2 if activation else n
  if k % blocks.block_k or out_cols % blocks.block_n or num_rows % blocks.block_m:
    raise ValueError(
      f"K={k}, N={out_cols} and the tiles' {num_rows} rows must be multiples of "
      f"{blocks.block_k=}, {blocks.block_n=} and {blocks.block_m=}"
    )
  lhs_aligned = lhs_tiles
  quant = None
  if quantized is not None:
    quant = QuantTiles(
      quantized.format,
      quantized.block,
      blocks.block_k,
      blocks.block_n,
      transpose_rhs,
      interpret,
    )
    if quant.split_contraction:  # the contraction's pairs: lhs's columns by parity
      lhs_aligned = by_parity(lhs_aligned, k)
  num_tiles = num_rows // blocks.block_m
  kernel = plgpu.kernel(
    functools.partial(
      _gmm_aligned_kernel,
      call=_AlignedCall(blocks, num_tiles, activation is not None, transpose_rhs, quant),
    ),
    out_type=out_struct(
      (num_rows, out_cols), jnp.dtype(out_dtype or lhs_tiles.dtype), like=lhs_aligned
    ),
    **launch(interpret),
  )
  rhs_operands = (rhs,) if quantized is None else (quantized.bits, quantized.scales)
  out = vary_like(kernel(tile_ends, lhs_aligned, *rhs_operands), lhs_aligned)
  if quant and quant.paired and not transpose_rhs:  # output columns came by parity
    out = from_parity(out, blocks.block_n)
  return out


def _num_sms(interpret: bool) -> int:
  """Persistent programs: one per SM of the device (132 on an H100 / H200 SXM)."""
  if interpret:
    return _INTERPRETED_SMS
  # Lowering for CUDA on a host without a GPU (jax.export): the `compat.cuda_target` GPU's
  # count, else an H100 / H200's.
  return platform.gpu_sm_count() or target_num_sms() or 132


def launch(interpret: bool) -> dict:
  """`plgpu.kernel` arguments shared by both kernels: one program per SM, warpgroup lowering."""
  return dict(
    grid=(_num_sms(interpret),),
    grid_names=("sm",),
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    **({"interpret": mosaic_interpret_params()} if interpret else {}),
  )


def _tgmm_aligned_kernel(
  first_steps_gmem,
  step_counts_gmem,
  lhs_gmem,
  dout_gmem,
  out_gmem,
  *,
  blocks: MosaicBlocks,
  num_groups: int,
  lhs_transposed: bool,
):
  """out[g] tile (i, j) = sum over g's steps t of lhs[t, i-block]^T @ dout[t, j-block].

  Refs: first_steps, step_counts [G] (each group's steps of bk aligned rows: the
  contraction), lhs [Ma, K] (or lhs^T [K, Ma] when `lhs_transposed`) and dout [Ma, N]
  (tile-aligned), out [G, K, N]. Output tiles are [bm, bn]; an empty group's are stored 0.
  """
  bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
  k = lhs_gmem.shape[0] if lhs_transposed else lhs_gmem.shape[1]
  k_blocks, n_blocks = k // bm, dout_gmem.shape[1] // bn

  @plgpu.nd_loop((num_groups, k_blocks * n_blocks), collective_axes="sm")
  def _tile_loop(loop_info: plgpu.NDLoopInfo):
    group, index = loop_info.index
    k_block, n_block = index // n_blocks, index % n_blocks
    first_step, group_steps = first_steps_gmem[group], step_counts_gmem[group]

    if lhs_transposed:  # lhs^T tiles [bm, bk] are wgmma's A operand as they are
      lhs_spec = plgpu.BlockSpec(
        (bm, bk),
        lambda t: (k_block, first_step + t),
        transforms=swizzled(lhs_gmem.dtype, bk),
        delay_release=1,
      )
    else:  # lhs tiles [bk, bm], read transposed in shared memory
      lhs_spec = plgpu.BlockSpec(
        (bk, bm),
        lambda t: (first_step + t, k_block),
        transforms=swizzled(lhs_gmem.dtype, bm),
        delay_release=1,
      )

    def accumulate(acc_ref):
      def step(_, lhs_smem, dout_smem):
        lhs_tile = lhs_smem if lhs_transposed else lhs_smem.transpose((1, 0))
        plgpu.wgmma(acc_ref, lhs_tile, dout_smem)
        plgpu.wgmma_wait(1)

      @pl.when(group_steps > 0)
      def _():
        plgpu.emit_pipeline(
          step,
          grid=(group_steps,),
          in_specs=[
            lhs_spec,
            plgpu.BlockSpec(
              (bk, bn),
              lambda t: (first_step + t, n_block),
              transforms=swizzled(lhs_gmem.dtype, bn),
              delay_release=1,
            ),
          ],
          max_concurrent_steps=blocks.max_concurrent_steps,
        )(lhs_gmem, dout_gmem)

      return acc_ref[...]

    acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn), jnp.float32))
    store_tile(acc, out_gmem.at[group, pl.ds(k_block * bm, bm), pl.ds(n_block * bn, bn)])


@functools.partial(
  jax.jit, static_argnames=("blocks", "row_tile", "out_dtype", "precision", "interpret")
)
def tgmm_mosaic(
  lhs: jax.Array,
  dout: jax.Array,
  group_sizes: jax.Array,
  *,
  blocks: MosaicBlocks,
  row_tile: int | None = None,
  out_dtype=jnp.float32,
  precision=None,
  interpret: bool = False,
) -> jax.Array:
  """Transposed grouped matmul on Hopper: out[g] = lhs[rows of g]^T @ dout[rows of g].

  The weight gradient of `gmm_mosaic`: `tgmm_mosaic_tiles` on the rows regrouped into tiles
  of `row_tile` rows. With `row_tile` the forward kernel's `block_m`, the regrouped lhs and
  dout are the very arrays `gmm_mosaic` gathers from them, which XLA then computes once.

  Args:
    lhs: [M, K] bf16/f16; K a multiple of block_m.
    dout: [M, N] in lhs's dtype; N a multiple of block_n.
    group_sizes: [G] int32, sum <= M; rows past the sum are ignored.
    blocks: `MosaicBlocks`: output tiles [block_m, block_n], block_k rows per step.
    row_tile: rows per aligned tile, a multiple of block_k (default block_k).
    out_dtype: output dtype.
    precision: as for `gmm_mosaic` (unused).
    interpret: run in the Mosaic GPU interpreter (CPU testing).

  Returns:
    [G, K, N]; groups of size 0 give 0.
  """
  del precision
  row_tile = row_tile or blocks.block_k
  row_source = aligned_rows(group_sizes, lhs.shape[0], row_tile).row_source
  return tgmm_mosaic_tiles(
    gather_rows(lhs, row_source),
    gather_rows(dout, row_source),
    group_sizes,
    blocks=blocks,
    row_tile=row_tile,
    out_dtype=out_dtype,
    interpret=interpret,
  )


@functools.partial(jax.jit, static_argnames=("blocks", "row_tile", "out_dtype", "interpret"))
def tgmm_mosaic_tiles(
  lhs_tiles: jax.Array,
  dout_tiles: jax.Array,
  group_sizes: jax.Array,
  *,
  blocks: MosaicBlocks,
  row_tile: int,
  out_dtype=jnp.float32,
  interpret: bool = False,
) -> jax.Array:
  """`tgmm_mosaic`'s kernel on rows already regrouped into whole tiles of `row_tile` rows.

  Each group's product contracts over its rows in steps of `block_k`, up to its last row (no
  step over a tile's empty tail), so no other row of the tiles is read.

  Args:
    lhs_tiles: [Ma, K], dout_tiles: [Ma, N]: the rows as `metadata.aligned_rows(group_sizes,
      M, row_tile)` places them; K a multiple of block_m, N of block_n.
    group_sizes: [G] int32.
    blocks, out_dtype, interpret: as for `tgmm_mosaic`.
    row_tile: rows per tile, a multiple of block_k.

  Returns:
    [G, K, N]; groups of size 0 give 0.
  """
  k, n = lhs_tiles.shape[1], dout_tiles.shape[1]
  groups = group_sizes.shape[0]
  if k % blocks.block_m or n % blocks.block_n:
    raise ValueError(f"K={k} and N={n} must be multiples of {blocks.block_m=}, {blocks.block_n=}")
  if row_tile % blocks.block_k:
    raise ValueError(f"row_tile={row_tile} must be a multiple of {blocks.block_k=}")
  sizes = group_sizes.astype(jnp.int32)
  tiles = -(-sizes // row_tile)  # [G]
  # Each group's first step and step count, in steps of block_k rows.
  first_steps = (jnp.cumsum(tiles) - tiles) * (row_tile // blocks.block_k)  # [G]
  step_counts = -(-sizes // blocks.block_k)  # [G]
  lhs_transposed = not mosaic_operands_transposed_in_smem(interpret)
  if lhs_transposed:
    lhs_tiles = lhs_tiles.T  # [K, Ma]
  kernel = plgpu.kernel(
    functools.partial(
      _tgmm_aligned_kernel, blocks=blocks, num_groups=groups, lhs_transposed=lhs_transposed
    ),
    out_type=out_struct((groups, k, n), jnp.dtype(out_dtype), like=lhs_tiles),
    **launch(interpret),
  )
  out = kernel(first_steps.astype(jnp.int32), step_counts, lhs_tiles, dout_tiles)
  return vary_like(out, lhs_tiles)
