"""Grouped matmul (ragged rows) in Pallas Triton, with fused MoE epilogues.

out[rows of group g] = epilogue(lhs[rows of g] @ rhs[g]), rows grouped in order by
`group_sizes`, rows past their sum left 0. The grid is static: (visits, N / bn), with
`metadata.max_visits` row-tile visits, the ones past `num_active` exiting at once. A visit
loads its row tile with the rows outside its group masked to 0 and stores only its group's
rows, so a tile shared by two groups is written in two visits without overlap.

Epilogues (all in float32, before the single store):
- `activation="silu"|"gelu"`: rhs holds [gate | up] columns ([G, K, 2N']); the kernel
  accumulates both halves for its N' block and stores act(gate) * up, so the [M, 2N']
  pre-activation never reaches memory.
- `row_weights`: scales each output row (vLLM's MUL_ROUTED_WEIGHT).

This backend is for pre-Hopper GPUs; JAX 0.11 deprecated Pallas Triton, so Hopper uses
`gmm_mosaic`, and where the installed JAX no longer ships Pallas Triton the registry reports
it unsupported (`unsupported_reason`). Dimensions must be multiples of the blocks; `api.py`
pads odd shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.activations import activate, erf_in_kernel
from kernels_pallas.compat import out_struct, pallas_triton, triton_missing_reason
from kernels_pallas.dequant import PAIRED, by_parity, decode, from_parity, kernel_block, kernel_rhs
from kernels_pallas.metadata import GroupTiles, group_tiles, max_visits
from kernels_pallas.quantized import BlockScaled, format_of, is_block_scaled


@dataclasses.dataclass(frozen=True)
class TritonBlocks:
  """Block sizes of the Triton kernels (each a power of two >= 16, Triton's dot minimum)."""

  block_m: int = 64
  block_n: int = 64
  block_k: int = 32
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self) -> None:
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16")


plgpu = pallas_triton()  # None once JAX has removed the backend


def unsupported_reason(dtype, activation, precision) -> str | None:
  """Triton's dot takes every float dtype, both activations and every precision: only a JAX
  without Pallas Triton stops it."""
  del dtype, activation, precision
  return triton_missing_reason()


def default_blocks(num_rows: int, k: int, n: int) -> TritonBlocks:
  """A heuristic per shape class: small M (decode) takes thin row tiles."""
  block_m = 16 if num_rows <= 256 else 64 if num_rows <= 4096 else 128
  return TritonBlocks(block_m=block_m, block_n=64 if n <= 1024 else 128, block_k=32)


def fit_blocks(blocks: TritonBlocks, rhs: BlockScaled, transpose_rhs: bool = False) -> TritonBlocks:
  """`blocks` shrunk (by powers of two) so that every tile of `rhs` has one scale row.

  A tile spans block_k rows of the stored [in, out] weight and block_n columns read
  forward, the other way round read `transpose_rhs` (the backward pass): the tile's rows
  must divide the scale block's bi, and its columns its bo unless bo is 1 (a scale per
  column). Each is at least 16 (Triton's smallest dot); a paired format's columns (mxfp4,
  int4_group, nvfp4: two values a byte) split into even and odd halves, so at least 32.

  >>> values = jnp.ones((1, 64, 64), jnp.float4_e2m1fn)
  >>> mxfp4 = BlockScaled(values, jnp.ones((1, 2, 64), jnp.float8_e8m0fnu), (32, 1))
  >>> fit_blocks(TritonBlocks(64, 128, 64), mxfp4)  # forward: 32 rows (bi) a tile
  TritonBlocks(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=2)
  >>> fit_blocks(TritonBlocks(64, 128, 64), mxfp4, transpose_rhs=True)  # rows are block_n
  TritonBlocks(block_m=64, block_n=32, block_k=64, num_warps=4, num_stages=2)

  Raises:
    NotImplementedError: no power-of-two tile of at least 16 (32 paired) fits the block.
  """
  return fit_blocks_to(blocks, format_of(rhs), rhs.block, transpose_rhs)


def fit_blocks_to(
  blocks: TritonBlocks, format: str, block: tuple[int, int], transpose_rhs: bool = False
) -> TritonBlocks:
  """`fit_blocks` for a weight of `format` stored in scale blocks `block`."""
  bi, bo = kernel_block(format, block)
  smallest_columns = 32 if format in PAIRED else 16
  tile_rows = _dividing(max(blocks.block_n if transpose_rhs else blocks.block_k, 16), bi)
  tile_columns = max(blocks.block_k if transpose_rhs else blocks.block_n, smallest_columns)
  tile_columns = _dividing(tile_columns, bo) if bo > 1 else tile_columns
  if tile_rows < 16 or tile_columns < smallest_columns:
    raise NotImplementedError(
      f"triton needs tiles of >= 16 rows and >= {smallest_columns} columns within a "
      f"{tuple(block)} scale block"
    )
  k, n = (tile_columns, tile_rows) if transpose_rhs else (tile_rows, tile_columns)
  return dataclasses.replace(blocks, block_k=k, block_n=n)


def _dividing(size: int, block: int) -> int:
  """The largest power of two <= size that divides block (0 if only 1 does)."""
  while size > 1 and block % size:
    size //= 2
  return size if size > 1 else 0


@dataclasses.dataclass(frozen=True)
class _GmmCall:
  """The static choices of one `gmm_triton` kernel, shared by every program of its grid.

  Attributes:
    blocks: the `TritonBlocks`.
    num_k_blocks: K / block_k, the contraction steps.
    gate_up_offset: with the gated epilogue, the first up column of rhs's [gate | up]; None.
    activation: the gated epilogue's activation, or None.
    weighted: whether row weights scale the output.
    transpose_rhs: rhs read as [G, N, K].
    precision: `jax.lax.Precision` of the block dots.
    rhs_format: the `KernelRhs` format of a quantized rhs, or None.
    quant_block: its scale block (bi, bo), or None.
  """

  blocks: TritonBlocks
  num_k_blocks: int
  gate_up_offset: int | None
  activation: str | None
  weighted: bool
  transpose_rhs: bool
  precision: object
  rhs_format: str | None
  quant_block: tuple[int, int] | None


def _rhs_products(
  lhs_ref, rhs_ref, scales_ref, lhs, k0, col, *, rows, in_group, group, call: _GmmCall, dtype
):
  """The tile's partial products lhs[rows, k0:k0+bk] @ rhs[group][k0:k0+bk, col:col+bn].

  Returns a list: one [bm, bn] product, or for a paired rhs read forward two [bm, bn/2] ones
  (even and odd output columns, as its bytes pack them).
  """
  bm, bn, bk = call.blocks.block_m, call.blocks.block_n, call.blocks.block_k
  rhs_format, transpose_rhs = call.rhs_format, call.transpose_rhs
  dot = functools.partial(plgpu.dot, trans_b=transpose_rhs, precision=call.precision)
  # The stored [in, out] tile: (bk, bn) read forward, (bn, bk) read transposed.
  (in0, in_size), (out0, out_size) = (
    ((col, bn), (k0, bk)) if transpose_rhs else ((k0, bk), (col, bn))
  )
  tiles = decoded_tiles(
    rhs_ref, scales_ref, group, (in0, in_size), (out0, out_size), rhs_format=rhs_format,
    quant_block=call.quant_block, dtype=dtype,
  )  # fmt: skip
  if rhs_format not in PAIRED or not transpose_rhs:
    return [dot(lhs, tile) for tile in tiles]
  even, odd = tiles
  # Read transposed, the pairs run along the contraction: lhs's columns come by parity
  # (`by_parity` over all K), the even ones in the first half.
  half = bk // 2
  mask = jnp.broadcast_to(in_group[:, None], (bm, half))
  lhs_half = lambda parity: plgpu.load(
    lhs_ref.at[rows, pl.ds(parity * (lhs_ref.shape[1] // 2) + k0 // 2, half)], mask=mask, other=0
  )  # [bm, bk/2]
  return [dot(lhs_half(0), even) + dot(lhs_half(1), odd)]


def decoded_tiles(
  rhs_ref, scales_ref, group, rows, columns, *, rhs_format, quant_block, dtype
) -> list[jax.Array]:
  """The stored [in, out] tile rhs[group][rows, columns] in `dtype`, `rows` and `columns`
  each (start, size) within one scale block (`fit_blocks`).

  Returns a list: the tile [rows, columns] (a float or fp8_block rhs), or a paired format's
  (mxfp4, int4_group, nvfp4: `dequant.PAIRED`) two halves [rows, columns/2], the even
  stored columns then the odd ones: byte j holds columns start + 2j (its low nibble) and
  start + 2j + 1 (its high one), one scale per column, kept by parity (`KernelRhs.scales`
  [G, in/bi, 2, out/2]).
  """
  (in0, in_size), (out0, out_size) = rows, columns
  if rhs_format is None:
    return [plgpu.load(rhs_ref.at[group, pl.ds(in0, in_size), pl.ds(out0, out_size)])]
  scale_row = in0 // quant_block[0]
  if rhs_format == "fp8_block":
    bits = plgpu.load(rhs_ref.at[group, pl.ds(in0, in_size), pl.ds(out0, out_size)])
    scale = scales_ref[group, scale_row, out0 // quant_block[1]]  # one per tile
    return [(decode(bits, rhs_format) * scale).astype(dtype)]
  half = out_size // 2
  bits = plgpu.load(rhs_ref.at[group, pl.ds(in0, in_size), pl.ds(out0 // 2, half)])

  def scaled(values, parity):  # one nibble's values times their columns' scales
    scales = scales_ref.at[group, scale_row, jnp.int32(parity), pl.ds(out0 // 2, half)]
    return (values * plgpu.load(scales)[None, :]).astype(dtype)

  return [scaled(v, parity) for parity, v in enumerate(decode(bits, rhs_format))]


def _gmm_kernel(
  tile_group_ref,
  tile_block_ref,
  starts_ref,
  ends_ref,
  num_active_ref,
  lhs_ref,
  rhs_ref,
  *refs,
  call: _GmmCall,
):
  """One (row-tile visit, column block) of out = epilogue(lhs @ rhs[g]).

  Refs: metadata (`GroupTiles`), lhs [Mp, K], rhs [G, K, N] (or [G, N, K] transposed; the
  uint8 bits of a `KernelRhs` when `rhs_format` is set, then its float32 scales follow),
  optional row_weights [Mp], the zero-filled output it aliases, then out [Mp, N'].
  """
  rhs_format, transpose_rhs, activation = call.rhs_format, call.transpose_rhs, call.activation
  scales_ref = refs[0] if rhs_format else None
  refs = refs[1:] if rhs_format else refs
  row_weights_ref = refs[0] if call.weighted else None
  out_ref = refs[-1]
  bm, bn, bk = call.blocks.block_m, call.blocks.block_n, call.blocks.block_k
  visit, col_block = pl.program_id(0), pl.program_id(1)
  # A paired rhs read forward computes even and odd output columns apart (its bytes pack pairs).
  parities = 2 if rhs_format in PAIRED and not transpose_rhs else 1

  @pl.when(visit < num_active_ref[0])
  def _():
    group, tile = tile_group_ref[visit], tile_block_ref[visit]
    rows = pl.ds(tile * bm, bm)
    row_ids = tile * bm + jnp.arange(bm)
    in_group = (row_ids >= starts_ref[group]) & (row_ids < ends_ref[group])  # [bm]
    col_starts = [col_block * bn]
    if call.gate_up_offset is not None:
      col_starts.append(call.gate_up_offset + col_block * bn)  # the up half of [gate | up]

    rhs_products = functools.partial(
      _rhs_products, lhs_ref, rhs_ref, scales_ref, rows=rows, in_group=in_group, group=group,
      call=call, dtype=lhs_ref.dtype,
    )  # fmt: skip

    def k_step(k_block, accs):
      k0 = k_block * bk
      lhs = None  # a paired rhs read transposed loads lhs's columns by parity itself
      if not (rhs_format in PAIRED and transpose_rhs):
        mask = jnp.broadcast_to(in_group[:, None], (bm, bk))
        lhs = plgpu.load(lhs_ref.at[rows, pl.ds(k0, bk)], mask=mask, other=0)  # [bm, bk]
      products = [p for col in col_starts for p in rhs_products(lhs, k0, col)]
      return tuple(acc + p for acc, p in zip(accs, products, strict=True))

    zero = jnp.zeros((bm, bn // parities), jnp.float32)
    accs = jax.lax.fori_loop(0, call.num_k_blocks, k_step, (zero,) * (len(col_starts) * parities))
    for parity in range(parities):
      acc = accs[parity::parities]  # gate (and up) of these columns
      out = acc[0] if activation is None else activate(acc[0], activation, erf_in_kernel) * acc[1]
      if call.weighted:
        weights = plgpu.load(row_weights_ref.at[rows], mask=in_group, other=0)  # [bm]
        out = out * weights[:, None].astype(jnp.float32)
      width = bn // parities  # a paired rhs's output columns come by parity (`by_parity`)
      mask = jnp.broadcast_to(in_group[:, None], (bm, width))
      cols = pl.ds(parity * (out_ref.shape[1] // parities) + col_block * width, width)
      plgpu.store(out_ref.at[rows, cols], out.astype(out_ref.dtype), mask=mask)


@functools.partial(
  jax.jit,
  static_argnames=("blocks", "activation", "transpose_rhs", "out_dtype", "precision", "interpret"),
)
def gmm_triton(
  lhs: jax.Array,
  rhs: jax.Array | BlockScaled,
  group_sizes: jax.Array,
  row_weights: jax.Array | None = None,
  *,
  blocks: TritonBlocks,
  activation: str | None = None,
  transpose_rhs: bool = False,
  out_dtype=None,
  precision=None,
  interpret: bool = False,
) -> jax.Array:
  """Grouped matmul with optional gated-activation and row-weight epilogues.

  Args:
    lhs: [M, K], M a multiple of block_m, K of block_k.
    rhs: [G, K, N] ([G, N, K] with `transpose_rhs`); N a multiple of block_n. With
      `activation`, the columns are [gate | up] and the output has N/2 columns. A
      `BlockScaled` rhs (fp8_block, mxfp4, int4_group, nvfp4) is dequantized tile by tile in
      registers, to lhs's dtype, before each dot (`kernels_pallas.dequant`); `blocks` must fit
      its scale blocks (`fit_blocks`, which `ops` applies).
    group_sizes: [G] int32, sum <= M.
    row_weights: [M] or None; multiplies each output row.
    blocks: `TritonBlocks`.
    activation: None, "silu" or "gelu" (the gated epilogue).
    transpose_rhs: read rhs as [G, N, K] (the backward pass's d(lhs) = dout @ rhs[g]^T).
    out_dtype: output dtype (default lhs.dtype).
    precision: `jax.lax.Precision` of the block dots.
    interpret: run with the Pallas interpreter (CPU testing).

  Returns:
    [M, N] (or [M, N/2] with `activation`); rows outside every group are 0.
  """
  _require_triton()
  num_rows, k = lhs.shape
  groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  out_cols = n // 2 if activation is not None else n
  quantized = kernel_rhs(rhs) if is_block_scaled(rhs) else None
  if quantized is not None and fit_blocks(blocks, rhs, transpose_rhs) != blocks:
    raise ValueError(f"{blocks} do not fit the {rhs.block} scale blocks (see fit_blocks)")
  paired = quantized is not None and quantized.values_per_byte == 2
  if paired and transpose_rhs:
    lhs = by_parity(lhs, k)
  _check_divisible(num_rows=num_rows, k=k, out_cols=out_cols, blocks=blocks)
  tiles: GroupTiles = group_tiles(group_sizes, num_rows, blocks.block_m)
  visits = max_visits(num_rows, groups, blocks.block_m)
  out_dtype = jnp.dtype(out_dtype or lhs.dtype)
  operands = [*tiles, lhs]
  operands += [rhs] if quantized is None else [quantized.bits, quantized.scales]
  if row_weights is not None:
    operands.append(row_weights)
  # The zero-filled buffer the output aliases; built from lhs so that inside shard_map it
  # varies over the same mesh axes as the result.
  operands.append(jnp.broadcast_to(jnp.zeros_like(lhs[:, :1], out_dtype), (num_rows, out_cols)))
  call = _GmmCall(
    blocks=blocks,
    num_k_blocks=k // blocks.block_k,
    gate_up_offset=out_cols if activation is not None else None,
    activation=activation,
    weighted=row_weights is not None,
    transpose_rhs=transpose_rhs,
    precision=precision,
    rhs_format=None if quantized is None else quantized.format,
    quant_block=None if quantized is None else quantized.block,
  )
  kernel = functools.partial(_gmm_kernel, call=call)
  out = pl.pallas_call(
    kernel,
    out_shape=out_struct((num_rows, out_cols), out_dtype, like=lhs),
    grid=(visits, out_cols // blocks.block_n),
    input_output_aliases={len(operands) - 1: 0},
    compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
    interpret=interpret,
    name="gmm_triton",
  )(*operands)
  return from_parity(out, out_cols) if paired and not transpose_rhs else out


def _tgmm_kernel(
  starts_ref, ends_ref, lhs_ref, rhs_ref, out_ref, *, blocks: TritonBlocks, precision
):
  """One (group, K block, N block) of out[g] = lhs[rows of g]^T @ rhs[rows of g]."""
  bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
  group, k_block, n_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = starts_ref[group], ends_ref[group]
  first_tile = start // bm
  num_tiles = jnp.where(end > start, (end - 1) // bm - first_tile + 1, 0)  # 0 for empty groups

  def m_step(i, acc):
    tile = first_tile + i
    row_ids = tile * bm + jnp.arange(bm)
    in_group = (row_ids >= start) & (row_ids < end)
    rows = pl.ds(tile * bm, bm)
    lhs = plgpu.load(
      lhs_ref.at[rows, pl.ds(k_block * bk, bk)],
      mask=jnp.broadcast_to(in_group[:, None], (bm, bk)),
      other=0,
    )  # [bm, bk]
    rhs = plgpu.load(
      rhs_ref.at[rows, pl.ds(n_block * bn, bn)],
      mask=jnp.broadcast_to(in_group[:, None], (bm, bn)),
      other=0,
    )  # [bm, bn]
    return acc + plgpu.dot(lhs, rhs, trans_a=True, precision=precision)

  acc = jax.lax.fori_loop(0, num_tiles, m_step, jnp.zeros((bk, bn), jnp.float32))
  out_block = out_ref.at[group, pl.ds(k_block * bk, bk), pl.ds(n_block * bn, bn)]
  plgpu.store(out_block, acc.astype(out_ref.dtype))


@functools.partial(
  jax.jit, static_argnames=("blocks", "row_tile", "out_dtype", "precision", "interpret")
)
def tgmm_triton(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  blocks: TritonBlocks,
  row_tile: int | None = None,
  out_dtype=None,
  precision=None,
  interpret: bool = False,
) -> jax.Array:
  """Transposed grouped matmul: out[g] = lhs[rows of g]^T @ rhs[rows of g] (d(rhs) of gmm).

  Args:
    lhs: [M, K], M a multiple of block_m, K of block_k.
    rhs: [M, N], N a multiple of block_n.
    group_sizes: [G] int32, sum <= M.
    blocks: `TritonBlocks`.
    row_tile: unused (the kernel masks each group's rows in place; the backends' signature).
    out_dtype: output dtype (default lhs.dtype).
    precision: `jax.lax.Precision` of the block dots.
    interpret: run with the Pallas interpreter.

  Returns:
    [G, K, N]; zero for empty groups.
  """
  del row_tile
  _require_triton()
  num_rows, k = lhs.shape
  n = rhs.shape[1]
  _check_divisible(num_rows=num_rows, k=k, out_cols=n, blocks=blocks)
  tiles = group_tiles(group_sizes, num_rows, blocks.block_m)
  groups = group_sizes.shape[0]
  return pl.pallas_call(
    functools.partial(_tgmm_kernel, blocks=blocks, precision=precision),
    out_shape=out_struct((groups, k, n), jnp.dtype(out_dtype or lhs.dtype), like=lhs),
    grid=(groups, k // blocks.block_k, n // blocks.block_n),
    compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
    interpret=interpret,
    name="tgmm_triton",
  )(tiles.starts, tiles.ends, lhs, rhs)


def _require_triton() -> None:
  reason = triton_missing_reason()
  if reason is not None:
    raise NotImplementedError(reason)


def _check_divisible(*, num_rows: int, k: int, out_cols: int, blocks: TritonBlocks) -> None:
  for name, size, block in (
    ("M", num_rows, blocks.block_m),
    ("K", k, blocks.block_k),
    ("N", out_cols, blocks.block_n),
  ):
    if size % block:
      raise ValueError(f"{name}={size} must be a multiple of its block {block}")
