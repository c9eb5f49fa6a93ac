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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.compat import out_struct
from kernels_pallas.metadata import aligned_rows, max_visits

_WGMMA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_NUM_SMS = 132  # H100 / H200 SXM


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
  """Block sizes of the Mosaic GPU kernel.

  Attributes:
    block_m: rows per tile (a multiple of 64, one warpgroup's wgmma M).
    block_n: output columns per tile (a multiple of 8, at most 256).
    block_k: contraction step; block_k * itemsize must be a TMA swizzle width (32..128 bytes).
    max_concurrent_steps: TMA pipeline depth (shared-memory buffers per operand).
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
    if self.max_concurrent_steps < 1:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")


def default_blocks(num_rows: int, k: int, n: int) -> MosaicBlocks:
  """A heuristic per shape class: few rows (decode) take 64-row tiles."""
  return MosaicBlocks(block_m=64 if num_rows <= 512 else 128, block_n=128, block_k=64)


def unsupported_reason(dtype, activation: str | None) -> str | None:
  """Why the Mosaic kernel cannot run this case, or None."""
  if jnp.dtype(dtype) not in _WGMMA_DTYPES:
    return f"mosaic runs bf16/f16 wgmma only, got {jnp.dtype(dtype)}"
  if activation == "gelu":
    return "mosaic's epilogue has no exact-erf gelu; use silu, or triton / xla for gelu"
  return None


def _tile_group(tile_ends_gmem, tile: jax.Array, num_groups: int) -> jax.Array:
  """Group of an aligned tile: how many groups end at or before it (unrolled over G)."""
  group = jnp.int32(0)
  for g in range(num_groups - 1):
    group += (tile >= tile_ends_gmem[g]).astype(jnp.int32)
  return group


def _gmm_aligned_kernel(
  tile_ends_gmem,
  lhs_gmem,
  rhs_gmem,
  out_gmem,
  *,
  blocks: MosaicBlocks,
  num_tiles: int,
  gated: bool,
):
  """out tile (t, n) = epilogue(lhs tile t @ rhs[group(t)][:, n-block]), tiles past used skipped.

  Refs: tile_ends [G], lhs [R, K] (tile-aligned), rhs [G, K, N], out [R, N'] (N' = N/2 gated).
  """
  bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
  num_groups, k, _ = rhs_gmem.shape
  out_cols = out_gmem.shape[1]
  col_blocks = out_cols // bn
  swizzle = plgpu.find_swizzle(bk * jnp.dtype(lhs_gmem.dtype).itemsize * 8)
  transforms = (
    plgpu.TilingTransform((8, swizzle // jnp.dtype(lhs_gmem.dtype).itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )
  used_tiles = tile_ends_gmem[num_groups - 1]

  @plgpu.nd_loop((num_tiles * col_blocks,), collective_axes="sm")
  def _tile_loop(loop_info: plgpu.NDLoopInfo):
    (index,) = loop_info.index
    tile, col_block = index // col_blocks, index % col_blocks

    @pl.when(tile < used_tiles)
    def _():
      group = _tile_group(tile_ends_gmem, tile, num_groups)
      # Gate columns [n*bn, (n+1)*bn); with the gated epilogue also up columns at +N'.
      col_offsets = (0, out_cols // bn) if gated else (0,)
      rhs_specs = [
        plgpu.BlockSpec((bk, bn), lambda kb, o=o: (kb, col_block + o), transforms=transforms)
        for o in col_offsets
      ]

      def accumulate(*acc_refs):
        def step(_, lhs_smem, *rhs_smems):
          for acc_ref, rhs_smem in zip(acc_refs, rhs_smems, strict=True):
            plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
          plgpu.wgmma_wait(1)

        plgpu.emit_pipeline(
          step,
          grid=(k // bk,),
          in_specs=[
            plgpu.BlockSpec((bm, bk), lambda kb: (tile, kb), transforms=transforms),
            *rhs_specs,
          ],
          max_concurrent_steps=blocks.max_concurrent_steps,
        )(lhs_gmem, *[rhs_gmem.at[group]] * len(col_offsets))
        return tuple(acc_ref[...] for acc_ref in acc_refs)

      accs = pl.run_scoped(accumulate, *[plgpu.ACC((bm, bn), jnp.float32)] * len(col_offsets))
      out = accs[0] / (1.0 + jnp.exp(-accs[0])) * accs[1] if gated else accs[0]  # silu(g) * u

      @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((bm, bn), out_gmem.dtype))
      def _store(out_smem):
        out_smem[...] = out.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
          out_smem, out_gmem.at[pl.ds(tile * bm, bm), pl.ds(col_block * bn, bn)]
        )
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(
  jax.jit,
  static_argnames=("blocks", "activation", "transpose_rhs", "out_dtype", "precision", "interpret"),
)
def gmm_mosaic(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  row_weights: jax.Array | None = None,
  *,
  blocks: MosaicBlocks,
  activation: str | None = None,
  transpose_rhs: bool = False,
  out_dtype=None,
  precision=None,
  interpret=False,
) -> jax.Array:
  """Grouped matmul (ragged rows) on Hopper, with optional silu-gated and row-weight epilogues.

  Args:
    lhs: [M, K] bf16/f16; K a multiple of block_k.
    rhs: [G, K, N] ([G, N, K] with `transpose_rhs`, transposed here in XLA); N (N/2 gated) a
      multiple of block_n.
    group_sizes: [G] int32, sum <= M.
    row_weights: [M] or None; scales the output rows (applied while gathering them back).
    blocks: `MosaicBlocks`.
    activation: None or "silu" (the gated epilogue over [gate | up] columns).
    transpose_rhs: read rhs as [G, N, K].
    out_dtype: output dtype (default lhs.dtype).
    precision: unused (wgmma accumulates bf16/f16 products in float32); kept for the
      backends' common signature.
    interpret: False, or Mosaic GPU interpreter params (CPU testing).

  Returns:
    [M, N] (or [M, N/2] gated); rows outside every group are 0.
  """
  del precision
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  num_rows, k = lhs.shape
  groups, _, n = rhs.shape
  out_cols = n // 2 if activation else n
  if k % blocks.block_k or out_cols % blocks.block_n:
    raise ValueError(
      f"K={k} and N={out_cols} must be multiples of {blocks.block_k=}, {blocks.block_n=}"
    )
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  rows = aligned_rows(group_sizes, num_rows, blocks.block_m)
  num_tiles = max_visits(num_rows, groups, blocks.block_m)
  lhs_aligned = jnp.concatenate([lhs, jnp.zeros((1, k), lhs.dtype)])[rows.row_source]
  kernel = plgpu.kernel(
    functools.partial(
      _gmm_aligned_kernel, blocks=blocks, num_tiles=num_tiles, gated=activation is not None
    ),
    out_type=out_struct((num_tiles * blocks.block_m, out_cols), out_dtype, like=lhs_aligned),
    grid=(_NUM_SMS,),
    grid_names=("sm",),
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    **({"interpret": interpret} if interpret else {}),
  )
  out_aligned = kernel(rows.tile_ends, lhs_aligned, rhs)
  out_aligned = jnp.concatenate([out_aligned, jnp.zeros((1, out_cols), out_dtype)])
  out = out_aligned[rows.source_row]  # rows outside every group read the zero row
  if row_weights is not None:
    out = (out.astype(jnp.float32) * row_weights[:, None].astype(jnp.float32)).astype(out_dtype)
  return out


def interpret_params():
  """Mosaic GPU interpreter settings, for running this kernel on a CPU in tests.

  JAX 0.10 keeps the interpreter's parameter class private; the import is confined here.
  """
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return InterpretGPUParams()
