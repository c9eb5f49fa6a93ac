"""The whole expert MLP on rows read by index, in Pallas Triton: no permuted copy of the tokens,
no argsort, no scatter of outputs, and in inference no [rows, 2F] pre-activation.

The N*K (token, choice) assignments are laid out by counting (`counted_layout`: a histogram of
the local experts and prefix sums): each expert's assignments fill whole tiles of `block_m`
aligned rows, in token order, so every tile belongs to one expert. Kernels read a tile's
tokens through the aligned rows' index (`row_assignment // K`), never a permuted copy:

forward (`fused_moe_mlp`)::

  hidden[r] = act(x[source(r)] @ W_gate_up[e(r)] + b_gate_up[e(r)])  # gathered loads, gated
  y[r]      = w[r] * (hidden[r] @ W_down[e(r)] + b_down[e(r)])    # epilogues (biases if any)
  out[n]    = sum_k y[slot[n, k]]                          # a gather and sum over K, no scatter

backward (`jax.custom_vjp`; the differentiated forward also stores gate|up, [rows, 2F], and
with adapters their first factors, [rows, r] each)::

  d_raw[r]   = dout[source(r)] @ W_down[e(r)]^T            # gathered loads; epilogue: hidden
               recomputed, dw[r] = <d_raw[r], hidden[r]>, d(gate|up) = act'(w[r] d_raw[r])
  dW_down[e] = hidden[rows of e]^T @ (w dout[source])[rows of e]   # gathered rhs
  dW_gate_up[e] = x[source(rows of e)]^T @ d(gate|up)[rows of e]   # gathered lhs
  dx[n]      = sum_k (d(gate|up) @ W_gate_up[e]^T)[slot[n, k]]
  db_gate_up[e] = sum of d(gate|up)[rows of e]; db_down[e] = sum_n (sum_k w [e(n,k) = e]) dout[n]
  dw[r]     += dout[source(r)] . b_down[e(r)]              # the biases' terms, in XLA

Every activation is a `(gate, up) -> hidden` function traced into the epilogues (its
derivative by `jax.vjp` there), so any elementwise activation Triton lowers is fused. The
kernels run on any CUDA GPU Triton targets (Hopper's wgmma included) and in the Pallas
interpreter on a CPU. Rows past a tile's assignments read zeros and are never read back.

Quantized matrices (`BlockScaled`: constants, no dW) reach the kernels as their bits and
scales; every weight tile is decoded before its dot (`gmm_triton.decoded_tiles`). A 4-bit
byte pairs neighbouring columns: read forward, the even and odd columns are multiplied and
stored apart (strided columns, so every output keeps its natural order); read transposed,
lhs's even and odd columns are loaded apart. Each kernel's blocks fit its scale blocks
(`fitted`).

LoRA adapters (`Adapters`) add each projection's rank-r product in the same kernels: the
[Ma, r] rows of its first factor come from the aligned-rows kernel (x's by index), and the
up, down, down-backward and dx kernels add `rows @ B` (or its transpose) to their
accumulators (`_plus_low_rank`); the adapters' gradients are per-expert products of the
weight-gradient kernel.

FP8 compute (`compute_quant="fp8_deepseek"`, `moejax.compute_quant`): XLA quantizes each
product's operands to e4m3 with float32 scales (`fp8_groups.quantize_groups`: the tokens and
cotangents per row in 1x128 groups, the matrices in 128x128 blocks read either way), and each
step of a kernel's contraction multiplies one 128-wide group of e4m3 tiles and adds the
product times its scales to a float32 sum (`_fp8_products`). The weight gradients' operands
are quantized along the tokens, 128 aligned rows of one expert a group, on gathered e4m3
copies (`_token_quantized`); the blocks are `FP8_BLOCKS`.

An output norm (`output_norm`, a function of whole rows) runs in XLA between the down kernel,
whose rows it leaves unweighted, and the sum over choices; its backward hands the down
kernel's backward the rows' own cotangent, aligned (`_OutputCotangent`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.compat import out_struct, pallas_triton, triton_missing_reason
from kernels_pallas.dequant import PAIRED, by_parity, kernel_block, kernel_rhs
from kernels_pallas.fp8_groups import GROUP, quantize_groups
from kernels_pallas.gmm_triton import TritonBlocks, decoded_tiles, fit_blocks_to
from kernels_pallas.metadata import max_visits
from kernels_pallas.quantized import BlockScaled, format_of, is_block_scaled

plgpu = pallas_triton()  # None once JAX has removed the backend

Activation = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> hidden, hashable


class FusedLayout(NamedTuple):
  """Where each (token, choice) assignment sits among the tile-aligned rows.

  Attributes:
    slot: [N, K] int32 aligned row of each assignment; Ma (no row) for an expert held
      elsewhere. Ma = `max_visits(N*K, El, bm) * bm`.
    row_assignment: [Ma] int32 assignment (n*K + k) each aligned row holds; N*K if none.
    tile_expert: [Ma / bm] int32 local expert of each tile (the last one for unused tiles).
    tile_ends: [El] int32 one past each expert's last tile.
    num_tiles: [1] int32 tiles in use; the rest are never read or written.
  """

  slot: jax.Array
  row_assignment: jax.Array
  tile_expert: jax.Array
  tile_ends: jax.Array
  num_tiles: jax.Array


def counted_layout(expert_ids: jax.Array, local_experts: int, block_m: int) -> FusedLayout:
  """The tile-aligned layout of the assignments, by counting (no sort).

  Each assignment's rank among its expert's is a prefix sum of the [N*K, El] one-hot of the
  ids (int32: 4·N·K·El bytes, far less than one permuted copy of the rows unless El
  approaches 2·D), so an expert's rows keep their token order.

  Args:
    expert_ids: [N, K] int local expert ids; ids outside [0, El) belong to no local expert.
    local_experts: El.
    block_m: bm, rows per tile.

  Returns:
    `FusedLayout`.

  >>> layout = counted_layout(jnp.array([[1, 0], [1, 5]]), local_experts=2, block_m=2)
  >>> layout.slot.tolist(), layout.row_assignment.tolist(), int(layout.num_tiles[0])
  ([[2, 0], [3, 6]], [1, 4, 0, 2, 4, 4], 2)
  """
  assignments = expert_ids.size
  flat = expert_ids.reshape(-1)
  local = (flat >= 0) & (flat < local_experts)
  one_hot = (flat[:, None] == jnp.arange(local_experts)[None, :]).astype(jnp.int32)  # [NK, El]
  counts = jnp.sum(one_hot, axis=0)  # [El]
  tiles = -(-counts // block_m)
  tile_ends = jnp.cumsum(tiles).astype(jnp.int32)
  first_row = (tile_ends - tiles) * block_m  # [El]
  expert = jnp.where(local, flat, 0)
  rank = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0), expert[:, None], axis=1)[:, 0] - 1
  num_tiles = max_visits(assignments, local_experts, block_m)
  aligned = num_tiles * block_m
  slot = jnp.where(local, first_row[expert] + rank, aligned).astype(jnp.int32)
  every = jnp.arange(assignments, dtype=jnp.int32)
  row_assignment = jnp.full(aligned, assignments, jnp.int32).at[slot].set(every, mode="drop")
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  tile_expert = jnp.searchsorted(tile_ends, tile, side="right", method="compare_all")
  return FusedLayout(
    slot=slot.reshape(expert_ids.shape),
    row_assignment=row_assignment,
    tile_expert=jnp.minimum(tile_expert, local_experts - 1).astype(jnp.int32),
    tile_ends=tile_ends,
    num_tiles=tile_ends[-1:],
  )


@dataclasses.dataclass(frozen=True)
class FusedSettings:
  """The static choices of one fused call (hashable: a `custom_vjp` non-differentiable input).

  Attributes:
    activation: (gate, up) -> hidden, traced into the epilogues.
    blocks: `TritonBlocks` of every kernel.
    precision: `jax.lax.Precision` of the block dots, or None.
    interpret: run the kernels in the Pallas interpreter (CPU testing).
    compute_quant: None, or "fp8_deepseek": the kernels' base products multiply e4m3
      operands (`FP8_BLOCKS`; the adapters' products are not quantized).
    output_norm: None, or a function of [rows, D] float32 expert outputs applied to each
      row before its routing weight (in XLA: a row's norm needs every column).
  """

  activation: Activation
  blocks: TritonBlocks
  precision: object = None
  interpret: bool = False
  compute_quant: str | None = None
  output_norm: Callable[[jax.Array], jax.Array] | None = None


class WeightForm(NamedTuple):
  """How a kernel reads one expert matrix: its float values (`format` None), or the uint8
  bits and float32 scales of a `BlockScaled` one (`dequant.KernelRhs`), decoded tile by tile.

  Attributes:
    format: None, or the `FORMATS` name.
    block: its scale block (bi, bo) as the kernels load it (`dequant.kernel_block`).
  """

  format: str | None = None
  block: tuple[int, int] | None = None

  @property
  def parts(self) -> int:
    """The column sets a forward read multiplies apart: 2 for a paired format (the even and
    the odd stored columns: a byte holds one of each), else 1."""
    return 2 if self.format in PAIRED else 1


def weight_form(w: jax.Array | BlockScaled) -> WeightForm:
  """The form a kernel reads `w` in."""
  name = format_of(w)
  return WeightForm() if name is None else WeightForm(name, kernel_block(name, w.block))


def fitted(blocks: TritonBlocks, form: WeightForm, *, transpose_rhs: bool) -> TritonBlocks:
  """The blocks of a kernel reading a `form` matrix (`transpose_rhs`: as W^T, the backward
  pass): `blocks`, each tile within one scale block (`gmm_triton.fit_blocks`)."""
  if form.format is None:
    return blocks
  return fit_blocks_to(blocks, form.format, form.block, transpose_rhs)


def unsupported_reason(
  hidden_size: int,
  intermediate_size: int,
  blocks: TritonBlocks,
  forms: tuple[WeightForm, ...] = (),
  compute_quant: str | None = None,
) -> str | None:
  """Why the fused kernels cannot run these widths with `blocks` on matrices read in `forms`
  (none: float) under `compute_quant`, or at all here; None if they can."""
  missing = triton_missing_reason()
  if missing is not None:
    return missing
  if compute_quant is not None:
    why = _fp8_reason(blocks, forms, compute_quant)
    if why is not None:
      return why
  try:
    every = _every_blocks(blocks, forms)
  except NotImplementedError as error:
    return f"the fused kernels read quantized weights in tiles: {error}"
  for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
    for block in (b for call in every for b in (call.block_n, call.block_k)):
      if size % block:
        return f"the fused kernels need {name}={size} to be a multiple of {block} (the blocks)"
  return None


def _fp8_reason(
  blocks: TritonBlocks, forms: tuple[WeightForm, ...], compute_quant: str
) -> str | None:
  """Why the kernels cannot run `compute_quant` with `blocks` on matrices in `forms`, or
  None."""
  if compute_quant != "fp8_deepseek":
    return f"they run compute_quant='fp8_deepseek', not {compute_quant!r}"
  if any(form.format is not None for form in forms):
    return "compute_quant quantizes float matrices on the fly, not BlockScaled ones"
  if (blocks.block_m, blocks.block_k) != (GROUP, GROUP) or GROUP % blocks.block_n:
    return (
      f"compute_quant={compute_quant!r} takes block_m={GROUP}, block_k={GROUP} and a "
      f"block_n dividing {GROUP} (FP8_BLOCKS), not {blocks}"
    )
  return None


def _every_blocks(blocks: TritonBlocks, forms: tuple[WeightForm, ...]) -> list[TritonBlocks]:
  """The blocks of every kernel of a call: `blocks`, and them `fitted` to each form's reads.

  Raises:
    NotImplementedError: no tile fits a form's scale blocks.
  """
  reads = ((form, transpose_rhs) for form in forms for transpose_rhs in (False, True))
  return [blocks, *(fitted(blocks, form, transpose_rhs=t) for form, t in reads)]


def _padded_rank(lora, blocks: TritonBlocks, forms: tuple[WeightForm, ...]) -> Adapters:
  """`Adapters` of the (gate_up_a, gate_up_b, down_a, down_b) `lora`, the rank padded with
  zeros (which add nothing) to a multiple of every kernel's block_n and block_k: the rank is
  an output width and a contraction of the kernels."""
  multiple = max(b for call in _every_blocks(blocks, forms) for b in (call.block_n, call.block_k))
  rank = lora[0].shape[-1]
  pad = -rank % multiple
  a_pad, b_pad = [(0, 0), (0, 0), (0, pad)], [(0, 0), (0, pad), (0, 0)]
  gate_up_a, gate_up_b, down_a, down_b = lora
  return Adapters(
    jnp.pad(gate_up_a, a_pad), jnp.pad(gate_up_b, b_pad), jnp.pad(down_a, a_pad),
    jnp.pad(down_b, b_pad),
  )  # fmt: skip


def batch_invariant_blocks(hidden_size: int, intermediate_size: int) -> TritonBlocks:
  """The blocks of every call whose tokens' outputs must not depend on the rest of the call
  (`MoEConfig.batch_invariant`): `default_blocks`' widths and 64 rows a tile, whatever the
  call's size, so that every row goes through the same program (a row's products, its
  activation and its K results' sum involve no other row)."""
  return dataclasses.replace(default_blocks(0, hidden_size, intermediate_size), block_m=64)


# The blocks of every call under compute_quant="fp8_deepseek": a contraction step of one
# 128-wide group (a weight block's rows and an activation group), 128 rows a tile (each
# expert's rows in whole groups of 128 tokens, the weight gradients' groups) and 64 columns
# (within one 128x128 weight block).
FP8_BLOCKS = TritonBlocks(block_m=GROUP, block_n=64, block_k=GROUP, num_warps=8)


def default_blocks(num_rows: int, hidden_size: int, intermediate_size: int) -> TritonBlocks:
  """The largest of 16/32/64 rows per tile that is at most the rows per expert would fill, and
  the widest 64/32/16 columns and contraction step that divide both widths."""
  block_m = 64 if num_rows > 4096 else 32 if num_rows > 256 else 16
  width = (
    next(b for b in (64, 32, 16) if hidden_size % b == 0 == intermediate_size % b)
    if (hidden_size % 16 == 0 == intermediate_size % 16)
    else 16
  )
  return TritonBlocks(block_m=block_m, block_n=width, block_k=min(width, 32))


# --- the kernels ---------------------------------------------------------------------------


def _tile_rows(row_assignment_ref, tile, bm: int, top_k: int, num_tokens: int):
  """The tile's source token rows [bm] (clamped in range) and which hold an assignment."""
  assignment = row_assignment_ref[pl.ds(tile * bm, bm)]
  token = assignment // top_k
  return jnp.minimum(token, num_tokens - 1), token < num_tokens


def _columns(col, width: int, parity: int | None):
  """`width` columns from `col`: contiguous (`parity` None: a slice), or one parity's of a
  paired read, col + parity + 2j (an index)."""
  if parity is None:
    return pl.ds(col, width)
  return col + parity + 2 * jnp.arange(width)


def _block(ref, row, num_rows: int, col, width: int, parity: int | None = None):
  """ref[row:row+num_rows, `_columns(col, width, parity)`], to load or store."""
  columns = _columns(col, width, parity)
  if parity is None:
    return ref.at[pl.ds(row, num_rows), columns]
  return ref.at[(row + jnp.arange(num_rows))[:, None], columns[None, :]]


def _gathered(ref, rows, valid, col, width: int, parity: int | None = None) -> jax.Array:
  """ref[rows, `_columns(col, width, parity)`], zero where not `valid`: a load by row index."""
  cols = col + jnp.arange(width) if parity is None else _columns(col, width, parity)
  mask = jnp.broadcast_to(valid[:, None], (rows.shape[0], width))
  return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0)


class _Lhs(NamedTuple):
  """How a kernel loads its tile's lhs rows: `tile(k0, width, parity)` [bm, width] (`_block`'s
  columns), and under `compute_quant` `scales(group)` [bm, 1] float32, each row's scale of
  its 128-wide group `group` of columns."""

  tile: Callable
  scales: Callable


def _aligned_lhs(values_ref, scales_ref, tile, bm: int) -> _Lhs:
  """`_Lhs` of the tile's own rows of an aligned [Ma, K] lhs (scales [Ma, K/128])."""
  first = tile * bm
  return _Lhs(
    lambda k0, width, parity: plgpu.load(_block(values_ref, first, bm, k0, width, parity)),
    lambda group: plgpu.load(scales_ref.at[pl.ds(first, bm), pl.ds(group, 1)]),
  )


def _gathered_lhs(values_ref, scales_ref, rows, valid) -> _Lhs:
  """`_Lhs` of an [N, K] lhs (scales [N, K/128]) read by index, zeros where not `valid`."""
  return _Lhs(
    lambda k0, width, parity: _gathered(values_ref, rows, valid, k0, width, parity),
    lambda group: _gathered(scales_ref, rows, valid, group, 1),
  )


def _products(lhs: _Lhs, w_refs, expert, columns, *, k_size, transpose_rhs, form, settings):
  """The float32 products lhs(k0, bk) @ W[expert][k0:k0+bk, col:col+bn] summed over k0, for
  each col of `columns` (read as W[expert][col:col+bn, k0:k0+bk]^T when `transpose_rhs`),
  the lhs tile loaded once per step for all of them (`_fp8_products` under compute_quant).

  W is `w_refs` (values, scales) read in `form`. Read forward, a paired format gives each
  product as its even and odd columns apart; read transposed, its pairs run along the
  contraction, so lhs's even and odd columns are loaded apart (`lhs.tile(k0, bk/2, parity)`).

  Returns:
    per col, a tuple of its parts: ([bm, bn],), or (even, odd) columns [bm, bn/2] each.
  """
  if settings.compute_quant is not None:
    return _fp8_products(
      lhs, w_refs, expert, columns, k_size=k_size, transpose_rhs=transpose_rhs,
      settings=settings,
    )  # fmt: skip
  bm, bn, bk = settings.blocks.block_m, settings.blocks.block_n, settings.blocks.block_k
  dot = functools.partial(plgpu.dot, trans_b=transpose_rhs, precision=settings.precision)
  parts = 1 if transpose_rhs else form.parts

  def step(k_block, accs):
    k0 = k_block * bk
    if transpose_rhs and form.parts == 2:
      tiles = [lhs.tile(k0, bk // 2, parity) for parity in (0, 1)]
    else:
      tiles = [lhs.tile(k0, bk, None)]
    products = []
    for col in columns:
      rows, cols = ((col, bn), (k0, bk)) if transpose_rhs else ((k0, bk), (col, bn))
      w_tiles = decoded_tiles(
        *w_refs, expert, rows, cols, rhs_format=form.format, quant_block=form.block,
        dtype=tiles[0].dtype,
      )  # fmt: skip
      if transpose_rhs:  # one product: the lhs parts times the tile's
        part_products = [dot(part, w_tile) for part, w_tile in zip(tiles, w_tiles, strict=True)]
        products.append(sum(part_products[1:], part_products[0]))
      else:
        products.extend(dot(tiles[0], w_tile) for w_tile in w_tiles)
    return tuple(acc + p for acc, p in zip(accs, products, strict=True))

  zero = jnp.zeros((bm, bn // parts), jnp.float32)
  accs = jax.lax.fori_loop(0, k_size // bk, step, (zero,) * (len(columns) * parts))
  return [accs[i : i + parts] for i in range(0, len(accs), parts)]


def _fp8_products(lhs: _Lhs, w_refs, expert, columns, *, k_size, transpose_rhs, settings):
  """`_products` on e4m3 operands (compute_quant="fp8_deepseek"; lhs in 1x128 groups along
  the contraction, W [El, K, N] e4m3 with scales [El, K/128, N/128] of its 128x128 blocks,
  read either way): per 128-wide group of the contraction, the tiles' product on the tensor
  cores (float32) times the lhs rows' scales and the weight block's, added to a float32
  total. The sums are promoted to float32 at every 128 of the contraction, as DeepSeek-V3
  does (Hopper's fp8 sums keep ~14 bits)."""
  values_ref, scales_ref = w_refs
  bm, bn = settings.blocks.block_m, settings.blocks.block_n

  def step(group, totals):
    k0 = group * GROUP
    tile, row_scales = lhs.tile(k0, GROUP, None), lhs.scales(group)
    added = []
    for col in columns:
      if transpose_rhs:
        w = plgpu.load(values_ref.at[expert, pl.ds(col, bn), pl.ds(k0, GROUP)])
        block_scale = scales_ref[expert, col // GROUP, group]
      else:
        w = plgpu.load(values_ref.at[expert, pl.ds(k0, GROUP), pl.ds(col, bn)])
        block_scale = scales_ref[expert, group, col // GROUP]
      part = plgpu.dot(tile, w, trans_b=transpose_rhs)
      added.append(part * (row_scales * block_scale))
    return tuple(total + a for total, a in zip(totals, added, strict=True))

  zero = jnp.zeros((bm, bn), jnp.float32)
  totals = jax.lax.fori_loop(0, k_size // GROUP, step, (zero,) * len(columns))
  return [(total,) for total in totals]


def _tile_products(
  row_assignment_ref, tile_expert_ref, tile, lhs_refs, w_refs, columns, *, gather_top_k,
  transpose_rhs, form, settings,
):  # fmt: skip
  """`_products` of `tile` on its lhs rows from `lhs_refs`, lhs and its scales (read under
  compute_quant): read by index from lhs [N, K] (scales [N, K/128]) for `gather_top_k`
  choices a token, or with `gather_top_k` None the tile's own rows of an aligned lhs [Ma, K]
  (scales [Ma, K/128])."""
  values_ref, scales_ref = lhs_refs
  bm = settings.blocks.block_m
  if gather_top_k is None:
    lhs = _aligned_lhs(values_ref, scales_ref, tile, bm)
  else:
    rows, valid = _tile_rows(row_assignment_ref, tile, bm, gather_top_k, values_ref.shape[0])
    lhs = _gathered_lhs(values_ref, scales_ref, rows, valid)
  return _products(
    lhs, w_refs, tile_expert_ref[tile], columns, k_size=values_ref.shape[1],
    transpose_rhs=transpose_rhs, form=form, settings=settings,
  )  # fmt: skip


def _expert_bias(bias_ref, expert, col, width: int, parity: int | None) -> jax.Array:
  """[1, width] float32 bias[expert, `_columns(col, width, parity)`]."""
  columns = _columns(col, width, parity)
  return plgpu.load(bias_ref.at[expert, columns]).astype(jnp.float32)[None, :]


def _parity(part: int, parts: int) -> int | None:
  """The parity of a product's `part` of `parts` (None: all its columns, contiguous)."""
  return None if parts == 1 else part


def _plus_low_rank(products, low_ref, low_w_ref, tile, expert, columns, *, transpose_rhs, settings):
  """`products` (per col, its parts: `_products`'s) plus the adapters' share of each:
  low[tile's rows] @ B[expert][:, col:col+bn] over the whole rank r (B[expert][col:col+bn,
  :]^T when `transpose_rhs`). In two parts (a paired base read forward), B's columns come
  by parity in each block_n (`dequant.by_parity`), so that each part is a contiguous half."""
  bm, bn, bk = settings.blocks.block_m, settings.blocks.block_n, settings.blocks.block_k
  parts = len(products[0])
  width = bn // parts

  def step(k_block, accs):
    k0 = k_block * bk
    lhs = plgpu.load(low_ref.at[pl.ds(tile * bm, bm), pl.ds(k0, bk)])
    added = []
    for col in columns:
      for part in range(parts):
        if transpose_rhs:
          rhs = plgpu.load(low_w_ref.at[expert, pl.ds(col, bn), pl.ds(k0, bk)])
        else:
          rhs = plgpu.load(low_w_ref.at[expert, pl.ds(k0, bk), pl.ds(col + part * width, width)])
        added.append(plgpu.dot(lhs, rhs, trans_b=transpose_rhs, precision=settings.precision))
    return tuple(acc + a for acc, a in zip(accs, added, strict=True))

  flat = tuple(p for col_parts in products for p in col_parts)
  flat = jax.lax.fori_loop(0, low_ref.shape[1] // bk, step, flat)
  return [flat[i : i + parts] for i in range(0, len(flat), parts)]


def _up_kernel(
  tile_expert_ref, num_tiles_ref, row_assignment_ref, x_ref, x_scales_ref, w_ref, w_scales_ref,
  low_ref, low_w_ref, bias_ref, hidden_ref, *pre_refs, top_k, biased, low_rank, form, settings,
):  # fmt: skip
  """One (tile, F block): hidden = act(x[rows] @ W_gate_up[e] (+ x_low[rows] @ B[e] with
  `low_rank`, + b_gate_up[e] if `biased`)); gate|up kept with `pre_refs`."""
  bm, bn = settings.blocks.block_m, settings.blocks.block_n
  tile, block = pl.program_id(0), pl.program_id(1)
  hidden_width = hidden_ref.shape[1]

  @pl.when(tile < num_tiles_ref[0])
  def _():
    gates, ups = _tile_products(
      row_assignment_ref, tile_expert_ref, tile, (x_ref, x_scales_ref), (w_ref, w_scales_ref),
      (block * bn, hidden_width + block * bn), gather_top_k=top_k, transpose_rhs=False, form=form,
      settings=settings,
    )  # fmt: skip
    if low_rank:
      gates, ups = _plus_low_rank(
        (gates, ups), low_ref, low_w_ref, tile, tile_expert_ref[tile],
        (block * bn, hidden_width + block * bn), transpose_rhs=False, settings=settings,
      )  # fmt: skip
    width = bn // form.parts

    def store(ref, col, parity, value):
      plgpu.store(_block(ref, tile * bm, bm, col, width, parity), value.astype(ref.dtype))

    for part, (gate, up) in enumerate(zip(gates, ups, strict=True)):
      parity = _parity(part, form.parts)
      if biased:
        expert = tile_expert_ref[tile]
        gate = gate + _expert_bias(bias_ref, expert, block * bn, width, parity)
        up = up + _expert_bias(bias_ref, expert, hidden_width + block * bn, width, parity)
      store(hidden_ref, block * bn, parity, settings.activation(gate, up))
      for pre_ref in pre_refs:  # the differentiated forward keeps gate|up for the backward
        store(pre_ref, block * bn, parity, gate)
        store(pre_ref, hidden_width + block * bn, parity, up)


def _aligned_kernel(
  tile_expert_ref, num_tiles_ref, row_assignment_ref, row_weight_ref, lhs_ref, lhs_scales_ref,
  w_ref, w_scales_ref, low_ref, low_w_ref, bias_ref, out_ref, *, transpose_rhs, weighted,
  biased, gather_top_k, low_rank, form, settings,
):  # fmt: skip
  """One (tile, output block) of out = lhs @ W[e] (W[e]^T with `transpose_rhs`) on aligned
  rows (lhs [N, K] read by index for `gather_top_k` K choices a token), plus low[rows] @ B[e]
  with `low_rank`, plus bias[e] when `biased`, times each row's weight when `weighted`."""
  bm, bn = settings.blocks.block_m, settings.blocks.block_n
  tile, block = pl.program_id(0), pl.program_id(1)

  @pl.when(tile < num_tiles_ref[0])
  def _():
    rows = pl.ds(tile * bm, bm)
    (outs,) = _tile_products(
      row_assignment_ref, tile_expert_ref, tile, (lhs_ref, lhs_scales_ref), (w_ref, w_scales_ref),
      (block * bn,), gather_top_k=gather_top_k, transpose_rhs=transpose_rhs, form=form,
      settings=settings,
    )  # fmt: skip
    if low_rank:
      (outs,) = _plus_low_rank(
        [outs], low_ref, low_w_ref, tile, tile_expert_ref[tile], (block * bn,),
        transpose_rhs=transpose_rhs, settings=settings,
      )  # fmt: skip
    width = bn // len(outs)
    for part, out in enumerate(outs):
      parity = _parity(part, len(outs))
      if biased:
        out = out + _expert_bias(bias_ref, tile_expert_ref[tile], block * bn, width, parity)
      if weighted:
        out = out * plgpu.load(row_weight_ref.at[rows])[:, None]
      out_block = _block(out_ref, tile * bm, bm, block * bn, width, parity)
      plgpu.store(out_block, out.astype(out_ref.dtype))


def _down_backward_kernel(
  tile_expert_ref, num_tiles_ref, row_assignment_ref, row_weight_ref, dout_ref, dout_scales_ref,
  w_down_ref, w_down_scales_ref, low_ref, low_w_ref, pre_ref, d_pre_ref, hidden_ref,
  *d_weight_refs, gather_top_k, low_rank, form, settings,
):  # fmt: skip
  """One (tile, F block) of d_raw = dout[rows] @ W_down[e]^T (+ d_low[rows] @ A_down[e]^T
  with `low_rank`), with the activation's backward in the epilogue: hidden recomputed from
  gate|up, the routing weight's partial gradient <d_raw, hidden> over this block's columns,
  and d(gate|up) of w * d_raw. With `gather_top_k` None, dout is the aligned rows' own
  cotangent [Ma, D], their weights in it: d(gate|up) of d_raw, and no routing weight's
  gradient (no `d_weight_refs`)."""
  bm, bn = settings.blocks.block_m, settings.blocks.block_n
  tile, block = pl.program_id(0), pl.program_id(1)
  hidden_width = hidden_ref.shape[1]

  @pl.when(tile < num_tiles_ref[0])
  def _():
    d_raw_parts = _tile_products(
      row_assignment_ref, tile_expert_ref, tile, (dout_ref, dout_scales_ref),
      (w_down_ref, w_down_scales_ref), (block * bn,), gather_top_k=gather_top_k,
      transpose_rhs=True, form=form, settings=settings,
    )  # fmt: skip
    if low_rank:
      d_raw_parts = _plus_low_rank(
        d_raw_parts, low_ref, low_w_ref, tile, tile_expert_ref[tile], (block * bn,),
        transpose_rhs=True, settings=settings,
      )  # fmt: skip
    ((d_raw,),) = d_raw_parts
    out_rows = pl.ds(tile * bm, bm)
    gate_cols, up_cols = pl.ds(block * bn, bn), pl.ds(hidden_width + block * bn, bn)
    gate = plgpu.load(pre_ref.at[out_rows, gate_cols]).astype(jnp.float32)
    up = plgpu.load(pre_ref.at[out_rows, up_cols]).astype(jnp.float32)
    hidden, activation_vjp = jax.vjp(settings.activation, gate, up)
    d_hidden = d_raw
    if gather_top_k is not None:
      d_hidden = d_raw * plgpu.load(row_weight_ref.at[out_rows])[:, None]
    d_gate, d_up = activation_vjp(d_hidden)
    plgpu.store(d_pre_ref.at[out_rows, gate_cols], d_gate.astype(d_pre_ref.dtype))
    plgpu.store(d_pre_ref.at[out_rows, up_cols], d_up.astype(d_pre_ref.dtype))
    plgpu.store(hidden_ref.at[out_rows, gate_cols], hidden.astype(hidden_ref.dtype))
    for d_weight_ref in d_weight_refs:
      plgpu.store(d_weight_ref.at[block, out_rows], jnp.sum(d_raw * hidden, axis=1))


def _weight_grad_kernel(
  tile_ends_ref, row_assignment_ref, row_weight_ref, lhs_ref, lhs_scales_ref, rhs_ref,
  rhs_scales_ref, *refs, gather, top_k, num_tokens, seeded, settings,
):  # fmt: skip
  """One (expert, K block, N block) of out[e] = L[rows of e]^T @ R[rows of e], over the
  expert's tiles: `gather` "lhs": L = lhs[source] and R = rhs; "rhs": L = lhs and R = w *
  rhs[source]; "neither": L = lhs and R = rhs (both on aligned rows). Under compute_quant
  both are e4m3 on aligned rows ("neither"), each tile one group of 128 tokens, its scales
  L's [K, tiles] and R's [tiles, N]: each tile's product is scaled, then summed. `seeded`:
  `refs` is (seed, out), out aliasing the seed, and the seed's own block is added to the
  block's sum before it is stored (rounded once, to out's dtype); else `refs` is (out,)."""
  bm, bn, bk = settings.blocks.block_m, settings.blocks.block_n, settings.blocks.block_k
  expert, k_block, n_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  first_tile = jnp.where(expert > 0, tile_ends_ref[jnp.maximum(expert - 1, 0)], 0)

  def step(tile, acc):
    rows = pl.ds(tile * bm, bm)
    source, valid = _tile_rows(row_assignment_ref, tile, bm, top_k, num_tokens)
    if gather == "lhs":
      lhs = _gathered(lhs_ref, source, valid, k_block * bk, bk)
    else:
      lhs = plgpu.load(lhs_ref.at[rows, pl.ds(k_block * bk, bk)])
    if gather == "rhs":
      rhs = _gathered(rhs_ref, source, valid, n_block * bn, bn)
      weight = plgpu.load(row_weight_ref.at[rows])
      rhs = (rhs.astype(jnp.float32) * weight[:, None]).astype(lhs.dtype)
    else:
      rhs = plgpu.load(rhs_ref.at[rows, pl.ds(n_block * bn, bn)])
    if settings.compute_quant is None:
      return acc + plgpu.dot(lhs, rhs, trans_a=True, precision=settings.precision)
    lhs_scales = plgpu.load(lhs_scales_ref.at[pl.ds(k_block * bk, bk), pl.ds(tile, 1)])
    rhs_scales = plgpu.load(rhs_scales_ref.at[pl.ds(tile, 1), pl.ds(n_block * bn, bn)])
    return acc + plgpu.dot(lhs, rhs, trans_a=True) * (lhs_scales * rhs_scales)

  acc = jax.lax.fori_loop(first_tile, tile_ends_ref[expert], step, jnp.zeros((bk, bn), jnp.float32))
  *seed_ref, out_ref = refs
  block = (expert, pl.ds(k_block * bk, bk), pl.ds(n_block * bn, bn))
  if seeded:
    acc = acc + plgpu.load(seed_ref[0].at[block]).astype(jnp.float32)
  plgpu.store(out_ref.at[block], acc.astype(out_ref.dtype))


# --- the calls -----------------------------------------------------------------------------


def _call(kernel, out_shapes, grid, settings: FusedSettings, name: str, *operands, aliases=None):
  """The kernel's `pallas_call` over `grid`; `aliases`, {operand index: output index} of
  outputs written in place of an operand."""
  blocks = settings.blocks
  return pl.pallas_call(
    kernel,
    out_shape=out_shapes,
    grid=grid,
    compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
    interpret=settings.interpret,
    name=name,
    input_output_aliases=aliases or {},
  )(*operands)


def _stand_in() -> jax.Array:
  """An operand a kernel never reads (of a feature the call does not use)."""
  return jnp.zeros((1, 1), jnp.float32)


def _unread_if_none(bias: jax.Array | None) -> jax.Array:
  """The bias operand of a kernel: itself, or a stand-in the kernel never reads."""
  return _stand_in() if bias is None else bias


def _unquantized(settings: FusedSettings) -> FusedSettings:
  """The settings of the adapters' products, which compute_quant leaves unquantized."""
  return dataclasses.replace(settings, compute_quant=None)


def _lhs_operands(lhs: jax.Array, settings: FusedSettings) -> tuple[jax.Array, jax.Array]:
  """A kernel's lhs and its scales: lhs as it is and a stand-in never read, or under
  compute_quant its e4m3 values and float32 scales in 1x128 groups along its columns, the
  contraction (`fp8_groups.quantize_groups`, the emulated recipe's own function)."""
  if settings.compute_quant is None:
    return lhs, _stand_in()
  return quantize_groups(lhs, (1, GROUP))


def _weight_operands(
  w: jax.Array | BlockScaled | Fp8Matrix, settings: FusedSettings, *, transpose_rhs: bool
) -> tuple[tuple[jax.Array, jax.Array], WeightForm, FusedSettings]:
  """A matrix as a kernel takes it: its two operands (values and float32 scales; a float
  matrix's scales are a stand-in never read), the form it reads them in, and the settings
  of a kernel reading it so (its blocks `fitted`). An `Fp8Matrix` (compute_quant) is read as
  [El, K, N] e4m3 either way."""
  if isinstance(w, Fp8Matrix):
    return tuple(w), WeightForm(), settings
  form = weight_form(w)
  if form.format is None:
    return (w, jnp.zeros((1, 1, 1), jnp.float32)), form, settings
  rhs = kernel_rhs(w)
  blocks = fitted(settings.blocks, form, transpose_rhs=transpose_rhs)
  return (rhs.bits, rhs.scales), form, dataclasses.replace(settings, blocks=blocks)


class Fp8Matrix(NamedTuple):
  """A matrix [El, K, N] in e4m3 for the fp8 products (compute_quant), read forward and
  transposed: values [El, K, N] float8_e4m3fn and their scales [El, K/128, N/128] float32,
  one per 128x128 block (`fp8_matrix`)."""

  values: jax.Array
  scales: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape


def fp8_matrix(w: jax.Array) -> Fp8Matrix:
  """W [El, K, N] quantized in 128x128 blocks (`fp8_groups.quantize_groups`), a constant (no
  gradient flows through it): for a caller that multiplies by W many times (a chunked layer's
  every chunk) to quantize it once and pass it to `fused_moe_mlp`."""
  return Fp8Matrix(*quantize_groups(jax.lax.stop_gradient(w), (GROUP, GROUP)))


class LowRank(NamedTuple):
  """An adapter's share of a product: `rows` [Ma, r] (aligned, the compute dtype) @ `w`
  [El, r, N] per tile's expert (read as [El, N, r], transposed, in the backward pass)."""

  rows: jax.Array
  w: jax.Array


def _low_rank_operands(
  low_rank: LowRank | None, form: WeightForm, settings: FusedSettings, *, transpose_rhs: bool
) -> tuple[jax.Array, jax.Array]:
  """A kernel's two low-rank operands (stand-ins it never reads without `low_rank`); read
  forward beside a paired base, w's columns by parity in each block_n (`_plus_low_rank`)."""
  if low_rank is None:
    return jnp.zeros((1, 1), jnp.float32), jnp.zeros((1, 1, 1), jnp.float32)
  w = low_rank.w
  if form.parts == 2 and not transpose_rhs:
    w = by_parity(w.reshape(-1, w.shape[-1]), settings.blocks.block_n).reshape(w.shape)
  return low_rank.rows, w


def _up(
  x, w_gate_up, b_gate_up, layout: FusedLayout, settings: FusedSettings, *, keep_pre: bool,
  low_rank: LowRank | None = None,
):  # fmt: skip
  """hidden [Ma, F] (and gate|up [Ma, 2F], biases added, with `keep_pre`), in x's dtype."""
  top_k = layout.slot.shape[1]
  aligned, hidden_width = layout.row_assignment.shape[0], w_gate_up.shape[2] // 2
  shapes = [out_struct((aligned, hidden_width), x.dtype, like=x)]
  if keep_pre:
    shapes.append(out_struct((aligned, 2 * hidden_width), x.dtype, like=x))
  w_operands, form, settings = _weight_operands(w_gate_up, settings, transpose_rhs=False)
  low_operands = _low_rank_operands(low_rank, form, settings, transpose_rhs=False)
  kernel = functools.partial(
    _up_kernel, top_k=top_k, biased=b_gate_up is not None, low_rank=low_rank is not None,
    form=form, settings=settings,
  )  # fmt: skip
  grid = (layout.tile_expert.shape[0], hidden_width // settings.blocks.block_n)
  return _call(
    kernel, shapes, grid, settings, "fused_moe_up",
    layout.tile_expert, layout.num_tiles, layout.row_assignment, *_lhs_operands(x, settings),
    *w_operands, *low_operands, _unread_if_none(b_gate_up),
  )  # fmt: skip


def _aligned(
  lhs, w, row_weight, layout: FusedLayout, settings, *, transpose_rhs, out_dtype, bias=None,
  gather: bool = False, low_rank: LowRank | None = None,
):  # fmt: skip
  """[Ma, N] = lhs @ W[e] per tile (W[e]^T with `transpose_rhs`; with `gather`, lhs [N, K]
  is read by index, else it is [Ma, K] aligned), plus `low_rank` and `bias[e]` unless None,
  rows times `row_weight` unless it is None."""
  width = w.shape[1] if transpose_rhs else w.shape[2]
  w_operands, form, settings = _weight_operands(w, settings, transpose_rhs=transpose_rhs)
  low_operands = _low_rank_operands(low_rank, form, settings, transpose_rhs=transpose_rhs)
  kernel = functools.partial(
    _aligned_kernel, transpose_rhs=transpose_rhs, weighted=row_weight is not None,
    biased=bias is not None, gather_top_k=layout.slot.shape[1] if gather else None,
    low_rank=low_rank is not None, form=form, settings=settings,
  )  # fmt: skip
  if row_weight is None:
    row_weight = jnp.zeros(layout.row_assignment.shape[0], jnp.float32)
  shape = out_struct((layout.row_assignment.shape[0], width), out_dtype, like=lhs)
  grid = (layout.tile_expert.shape[0], width // settings.blocks.block_n)
  return _call(
    kernel, shape, grid, settings, "fused_moe_aligned",
    layout.tile_expert, layout.num_tiles, layout.row_assignment, row_weight,
    *_lhs_operands(lhs, settings), *w_operands, *low_operands, _unread_if_none(bias),
  )  # fmt: skip


def _token_quantized(lhs, rhs, row_weight, layout: FusedLayout, *, gather):
  """A weight gradient's operands under compute_quant: L and R (`_weight_grad_kernel`) on the
  aligned rows, gathered and weighted here (in XLA: e4m3 copies, one byte a value), rows that
  hold no assignment zero, quantized along the tokens in groups of 128 (a tile's rows):
  (L [Ma, K] e4m3, its scales [K, Ma/128], R [Ma, N] e4m3, its scales [Ma/128, N])."""
  held, source = _held_and_source(layout)
  if gather == "lhs":
    lhs = jnp.take(lhs, source, axis=0)
  if gather == "rhs":
    rhs = jnp.take(rhs, source, axis=0).astype(jnp.float32) * row_weight[:, None]
  lhs_values, lhs_scales = quantize_groups(jnp.where(held[:, None], lhs, 0), (GROUP, 1))
  rhs_values, rhs_scales = quantize_groups(jnp.where(held[:, None], rhs, 0), (GROUP, 1))
  return lhs_values, lhs_scales.T, rhs_values, rhs_scales


def _weight_grad(
  lhs, rhs, row_weight, layout: FusedLayout, settings, *, gather, num_experts, like, seed=None
):
  """[El, K, N] per-expert L^T @ R (see `_weight_grad_kernel`) in `like`'s dtype (the
  weight's), rounded once from float32; plus `seed` (like-shaped, written over in place)
  unless None."""
  blocks = settings.blocks
  k, n = lhs.shape[1], rhs.shape[1]
  operands = (lhs, _stand_in(), rhs, _stand_in())
  if settings.compute_quant is not None:
    operands, gather = _token_quantized(lhs, rhs, row_weight, layout, gather=gather), "neither"
  kernel = functools.partial(
    _weight_grad_kernel, gather=gather, top_k=layout.slot.shape[1],
    num_tokens=layout.slot.shape[0], seeded=seed is not None, settings=settings,
  )  # fmt: skip
  shape = out_struct((num_experts, k, n), like.dtype, like=lhs)
  grid = (num_experts, k // blocks.block_k, n // blocks.block_n)
  seeds = () if seed is None else (seed.astype(like.dtype),)
  return _call(
    kernel, shape, grid, settings, "fused_moe_weight_grad",
    layout.tile_ends, layout.row_assignment, row_weight, *operands, *seeds,
    aliases={3 + len(operands): 0} if seeds else None,
  )  # fmt: skip


def _row_weight(weights: jax.Array, layout: FusedLayout) -> jax.Array:
  """[Ma] float32 routing weight of each aligned row (0 where it holds no assignment)."""
  return jnp.take(weights.reshape(-1), layout.row_assignment, mode="fill", fill_value=0)


def _sum_over_choices(rows: jax.Array, layout: FusedLayout) -> jax.Array:
  """[N, ...] float32: each token's K aligned rows gathered and summed (0 for no row)."""
  picked = jnp.take(rows, layout.slot, axis=0, mode="fill", fill_value=0)  # [N, K, ...]
  return jnp.sum(picked.astype(jnp.float32), axis=1)


class Adapters(NamedTuple):
  """Each expert's LoRA pair per projection (its scale folded into B), of a rank r that is a
  multiple of the kernels' blocks (`fused_moe_mlp` pads it): gate_up_a [El, D, r],
  gate_up_b [El, r, 2F], down_a [El, F, r], down_b [El, r, D]."""

  gate_up_a: jax.Array
  gate_up_b: jax.Array
  down_a: jax.Array
  down_b: jax.Array


class Experts(NamedTuple):
  """The local experts' weights: w_gate_up [El, D, 2F], w_down [El, F, D] (float, or both
  `BlockScaled`: constants), biases b_gate_up [El, 2F] and b_down [El, D], or None,
  `Adapters` or None, under compute_quant both matrices' `Fp8Matrix` (constants), and the
  float matrices' gradient seeds (`fused_moe_mlp`'s `grad_seeds`: added to their gradients
  in the weight-gradient kernels; no gradient of their own) or None."""

  w_gate_up: jax.Array | BlockScaled
  w_down: jax.Array | BlockScaled
  b_gate_up: jax.Array | None
  b_down: jax.Array | None
  lora: Adapters | None = None
  fp8: tuple[Fp8Matrix, Fp8Matrix] | None = None
  seeds: tuple[jax.Array, jax.Array] | None = None

  @property
  def multiplied(self) -> tuple:
    """(w_gate_up, w_down) as the base products read them: their `Fp8Matrix` under
    compute_quant, else the matrices."""
    return self.fp8 or (self.w_gate_up, self.w_down)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(x, weights, experts: Experts, layout, settings):
  out, _ = _fused_forward(x, weights, experts, layout, settings, keep_pre=False)
  return out


def _fused_forward(x, weights, experts: Experts, layout, settings, *, keep_pre):
  """(out [N, D], (gate|up [Ma, 2F] with `keep_pre`, else None; the rows' weights [Ma]; the
  adapters' first factors x_low and hidden_low [Ma, r], or None without adapters; with an
  output norm the rows' unweighted outputs [Ma, D] float32, else None)): what the backward
  pass keeps. With an output norm the down kernel leaves its rows unweighted; XLA normalizes
  and weighs them before the sum over choices."""
  row_weight = _row_weight(weights, layout)
  lora = experts.lora
  gate_up_low = down_low = None
  if lora is not None:
    gate_up_low = LowRank(_x_low(x, lora, layout, settings), lora.gate_up_b)
  w_gate_up, w_down = experts.multiplied
  hidden, *pre = _up(
    x, w_gate_up, experts.b_gate_up, layout, settings, keep_pre=keep_pre, low_rank=gate_up_low
  )
  if lora is not None:
    down_low = LowRank(_hidden_low(hidden, lora, layout, settings), lora.down_b)
  norm = settings.output_norm
  y = _aligned(
    hidden, w_down, None if norm else row_weight, layout, settings, transpose_rhs=False,
    out_dtype=jnp.float32 if norm else x.dtype, bias=experts.b_down, low_rank=down_low,
  )  # fmt: skip
  unweighted = None
  if norm is not None:
    unweighted, y = y, norm(y) * row_weight[:, None]
  lows = None if lora is None else (gate_up_low.rows, down_low.rows)
  return _sum_over_choices(y, layout), (pre[0] if pre else None, row_weight, lows, unweighted)


def _x_low(x, lora: Adapters, layout, settings) -> jax.Array:
  """[Ma, r] x[source] @ A_gate_up[e] in x's dtype, the tokens read by index."""
  return _aligned(
    x, lora.gate_up_a, None, layout, _unquantized(settings), transpose_rhs=False,
    out_dtype=x.dtype, gather=True,
  )  # fmt: skip


def _hidden_low(hidden, lora: Adapters, layout, settings) -> jax.Array:
  """[Ma, r] hidden @ A_down[e] in hidden's dtype."""
  return _aligned(
    hidden, lora.down_a, None, layout, _unquantized(settings), transpose_rhs=False,
    out_dtype=hidden.dtype,
  )  # fmt: skip


def _fused_fwd(x, weights, experts: Experts, layout, settings):
  out, kept = _fused_forward(x, weights, experts, layout, settings, keep_pre=True)
  return out, (x, weights, experts, layout, *kept)


class _OutputCotangent(NamedTuple):
  """The cotangent of the down-projection's output rows y[r]: `values` [N, D] read by index
  for `gather_top_k` choices a token, times each row's routing weight (dout: the kernel
  weighed y), or with `gather_top_k` None [Ma, D], the aligned rows' own (the output norm's
  backward: y was unweighted, the weights are in it)."""

  values: jax.Array
  gather_top_k: int | None

  @property
  def weight_grad_gather(self) -> str:
    """How `_weight_grad` reads it as its rhs."""
    return "neither" if self.gather_top_k is None else "rhs"


def _held_and_source(layout: FusedLayout) -> tuple[jax.Array, jax.Array]:
  """([Ma] whether each aligned row holds an assignment, [Ma] its token, clamped in range)."""
  tokens, top_k = layout.slot.shape
  held = layout.row_assignment < tokens * top_k
  return held, jnp.minimum(layout.row_assignment // top_k, tokens - 1)


def _normalized_cotangent(d_out, unweighted, row_weight, layout: FusedLayout, settings):
  """Under an output norm: (the rows' own cotangent [Ma, D] float32, the routing weights'
  gradient [Ma]), from dout read onto the aligned rows; 0 on rows holding no assignment
  (whose outputs, never read, may be anything)."""
  held, source = _held_and_source(layout)
  d_rows = jnp.take(d_out.astype(jnp.float32), source, axis=0)
  normalized, norm_vjp = jax.vjp(settings.output_norm, unweighted)
  (d_unweighted,) = norm_vjp(d_rows * row_weight[:, None])
  d_row_weight = jnp.sum(d_rows * normalized, axis=1)
  return jnp.where(held[:, None], d_unweighted, 0.0), jnp.where(held, d_row_weight, 0.0)


def _bias_grads(d_pre, cotangent: _OutputCotangent, row_weight, b_down, layout, block_m: int):
  """(d b_gate_up [El, 2F], d b_down [El, D], the routing weights' bias term [Ma] or None:
  with the aligned rows' own cotangent, the bias is in what the norm's gradient read),
  float32, in XLA: sums over each expert's aligned rows, read where they hold an assignment,
  as products with one-hot matrices (no scatter-add of many rows into one: the same sums
  every run)."""
  tokens, experts = layout.slot.shape[0], b_down.shape[0]
  held, source = _held_and_source(layout)
  row_expert = jnp.repeat(layout.tile_expert, block_m)  # [Ma]
  per_row_expert = jax.nn.one_hot(row_expert, experts, dtype=jnp.float32).T  # [El, Ma]
  d_pre = jnp.where(held[:, None], d_pre.astype(jnp.float32), 0.0)
  d_out = cotangent.values.astype(jnp.float32)
  if cotangent.gather_top_k is None:
    return per_row_expert @ d_pre, per_row_expert @ d_out, None
  # [El, N]: each token's routing weights toward each expert (one row per (expert, token) of
  # distinct choices: no two adds meet), then times its cotangent
  token_weights = jnp.zeros((experts, tokens), jnp.float32)
  token_weights = token_weights.at[row_expert, source].add(jnp.where(held, row_weight, 0.0))
  # dout[source(r)] . b_down[e(r)], from [N, El] products of every token with every bias
  per_expert = d_out @ b_down.astype(jnp.float32).T
  bias_term = jnp.where(held, per_expert[source, row_expert], 0.0)
  return per_row_expert @ d_pre, token_weights @ d_out, bias_term


def _fused_bwd(settings, residuals, d_out):
  x, weights, experts, layout, pre, row_weight, lows, unweighted = residuals
  w_gate_up, w_down, lora = experts.w_gate_up, experts.w_down, experts.lora
  num_experts, hidden_width = w_down.shape[:2]
  plain = _unquantized(settings)  # the adapters'
  d_row_weight = None
  if unweighted is None:
    cotangent = _OutputCotangent(d_out.astype(x.dtype), layout.slot.shape[1])
  else:
    d_unweighted, d_row_weight = _normalized_cotangent(
      d_out, unweighted, row_weight, layout, settings
    )
    cotangent = _OutputCotangent(d_unweighted.astype(x.dtype), None)
  weighted = cotangent.gather_top_k is not None
  # the down adapter's share of d(hidden): (dy[rows] @ B_down^T) @ A_down^T
  d_down_low = d_low = None
  if lora is not None:
    d_down_low = _aligned(
      cotangent.values, lora.down_b, None, layout, plain, transpose_rhs=True,
      out_dtype=jnp.float32, gather=weighted,
    )  # fmt: skip
    d_low = LowRank(d_down_low.astype(x.dtype), lora.down_a)
  gate_up_read, down_read = experts.multiplied
  w_down_operands, form, down_settings = _weight_operands(down_read, settings, transpose_rhs=True)
  d_blocks = hidden_width // down_settings.blocks.block_n
  aligned = layout.row_assignment.shape[0]
  kernel = functools.partial(
    _down_backward_kernel, gather_top_k=cotangent.gather_top_k, low_rank=lora is not None,
    form=form, settings=down_settings,
  )  # fmt: skip
  shapes = [
    out_struct((aligned, 2 * hidden_width), x.dtype, like=x),  # d(gate|up)
    out_struct((aligned, hidden_width), x.dtype, like=x),  # hidden
  ]
  if weighted:  # the routing weights' partial gradients, per F block
    shapes.append(out_struct((d_blocks, aligned), jnp.float32, like=x))
  d_pre, hidden, *d_weight_parts = _call(
    kernel, shapes, (layout.tile_expert.shape[0], d_blocks), down_settings,
    "fused_moe_down_backward",
    layout.tile_expert, layout.num_tiles, layout.row_assignment, row_weight,
    *_lhs_operands(cotangent.values, down_settings), *w_down_operands,
    *_low_rank_operands(d_low, form, down_settings, transpose_rhs=True), pre,
  )  # fmt: skip
  weight_grad = functools.partial(
    _weight_grad, layout=layout, settings=settings, num_experts=num_experts
  )
  d_matrices = (None, None)  # quantized matrices are constants
  if not is_block_scaled(w_down):
    seed_gate_up, seed_down = experts.seeds or (None, None)
    d_w_down = weight_grad(
      hidden, cotangent.values, row_weight, gather=cotangent.weight_grad_gather, like=w_down,
      seed=seed_down,
    )  # fmt: skip
    d_w_gate_up = weight_grad(x, d_pre, row_weight, gather="lhs", like=w_gate_up, seed=seed_gate_up)
    d_matrices = (d_w_gate_up, d_w_down)
  # the gate|up adapter's share of dx: (d(gate|up) @ B_gate_up^T) @ A_gate_up^T
  d_gate_up_low = d_x_low = None
  if lora is not None:
    d_gate_up_low = _aligned(
      d_pre, lora.gate_up_b, None, layout, plain, transpose_rhs=True, out_dtype=jnp.float32
    ).astype(x.dtype)
    d_x_low = LowRank(d_gate_up_low, lora.gate_up_a)
  d_x_rows = _aligned(
    d_pre, gate_up_read, None, layout, settings, transpose_rhs=True, out_dtype=jnp.float32,
    low_rank=d_x_low,
  )  # fmt: skip
  d_x = _sum_over_choices(d_x_rows, layout).astype(x.dtype)
  if weighted:
    d_row_weight = jnp.sum(d_weight_parts[0], axis=0)  # [Ma]
  d_biases = (None, None)
  if experts.b_down is not None:  # biases come in pairs (`fused_moe_mlp`)
    d_b_gate_up, d_b_down, bias_term = _bias_grads(
      d_pre, cotangent, row_weight, experts.b_down, layout, settings.blocks.block_m
    )
    if bias_term is not None:
      d_row_weight = d_row_weight + bias_term
    d_biases = (d_b_gate_up.astype(experts.b_gate_up.dtype), d_b_down.astype(experts.b_down.dtype))
  d_lora = None
  if lora is not None:
    adapter_grad = functools.partial(weight_grad, settings=plain)
    d_lora = Adapters(
      gate_up_a=adapter_grad(x, d_gate_up_low, row_weight, gather="lhs", like=lora.gate_up_a),
      gate_up_b=adapter_grad(lows[0], d_pre, row_weight, gather="neither", like=lora.gate_up_b),
      down_a=adapter_grad(
        hidden,
        (d_down_low * (row_weight[:, None] if weighted else 1.0)).astype(x.dtype),
        row_weight,
        gather="neither",
        like=lora.down_a,
      ),
      down_b=adapter_grad(
        lows[1], cotangent.values, row_weight, gather=cotangent.weight_grad_gather,
        like=lora.down_b,
      ),
    )  # fmt: skip
  d_weights = jnp.take(d_row_weight, layout.slot, mode="fill", fill_value=0)  # [N, K]
  d_experts = Experts(*d_matrices, *d_biases, d_lora)
  return (d_x, d_weights.astype(weights.dtype), d_experts, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _check_like_matrices(argument: str, pair, w_gate_up, w_down) -> None:
  """Raises ValueError naming the array of `argument`'s pair not shaped like its matrix."""
  for name, array, w in zip(("w_gate_up", "w_down"), pair, (w_gate_up, w_down), strict=True):
    if array.shape != w.shape:
      raise ValueError(f"{argument}' {name} has shape {array.shape}; expected {w.shape}")


def _check_shapes(x, expert_ids, weights, w_gate_up, w_down, b_gate_up, b_down, lora) -> None:
  """Raises ValueError naming the first argument whose shape disagrees with the others."""
  if x.ndim != 2 or w_down.ndim != 3:
    raise ValueError(f"x must be [N, D] and w_down [El, F, D], got {x.shape} and {w_down.shape}")
  (tokens, dim), (experts, hidden, _) = x.shape, w_down.shape
  expected = {
    "expert_ids": (expert_ids.shape, (tokens, expert_ids.shape[-1])),
    "weights": (weights.shape, expert_ids.shape),
    "w_gate_up": (w_gate_up.shape, (experts, dim, 2 * hidden)),
    "w_down": (w_down.shape, (experts, hidden, dim)),
  }
  if (b_gate_up is None) != (b_down is None):
    raise ValueError("b_gate_up and b_down are given together or not at all")
  if b_gate_up is not None:
    expected["b_gate_up"] = (b_gate_up.shape, (experts, 2 * hidden))
    expected["b_down"] = (b_down.shape, (experts, dim))
  if lora is not None:
    rank = lora[0].shape[-1]
    for name, got, want in zip(
      ("gate_up_a", "gate_up_b", "down_a", "down_b"),
      lora,
      (
        (experts, dim, rank),
        (experts, rank, 2 * hidden),
        (experts, hidden, rank),
        (experts, rank, dim),
      ),
      strict=True,
    ):
      expected[f"lora.{name}"] = (got.shape, want)
  for name, (got, want) in expected.items():
    if tuple(got) != tuple(want):
      raise ValueError(f"{name} has shape {tuple(got)}; expected {tuple(want)}")


def fused_moe_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  w_gate_up: jax.Array | BlockScaled,
  w_down: jax.Array | BlockScaled,
  b_gate_up: jax.Array | None = None,
  b_down: jax.Array | None = None,
  lora: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None,
  *,
  activation: Activation,
  blocks: TritonBlocks | None = None,
  precision=None,
  interpret: bool = False,
  compute_quant: str | None = None,
  fp8_matrices: tuple[Fp8Matrix, Fp8Matrix] | None = None,
  output_norm: Callable[[jax.Array], jax.Array] | None = None,
  grad_seeds: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """y[n] = sum_k weights[n, k] * down_{e[n,k]}(act(gate_up_{e[n,k]}(x[n]))), differentiable
  in x, weights, both float weight arrays and the biases.

  Args:
    x: [N, D] tokens in the compute dtype.
    expert_ids: [N, K] int local expert ids; ids outside [0, El) contribute nothing.
    weights: [N, K] float32 combine weights.
    w_gate_up: [El, D, 2F] gate | up columns, x's dtype.
    w_down: [El, F, D], x's dtype. Both may be `BlockScaled` (fp8_block, mxfp4, int4_group,
      nvfp4; both or neither): each tile is decoded in registers to x's dtype before its dot
      (`gmm_triton.decoded_tiles`), the kernels' blocks shrunk to fit the scale blocks
      (`fitted`); constants, with no gradient.
    b_gate_up, b_down: [El, 2F] and [El, D] biases added before the activation and before the
      routing weight (GPT-OSS's experts), both or neither.
    lora: None, or each expert's LoRA adapters (gate_up_a [El, D, r], gate_up_b [El, r, 2F],
      down_a [El, F, r], down_b [El, r, D]; x's dtype, the scale folded into the B's; a
      `moejax.lora.ExpertLoRA` is one): each projection adds (rows @ A) @ B, the rank-r rows
      rounded to x's dtype between the two (as `moejax.tiles` does), the rank padded with zeros
      to the kernels' blocks. Differentiable.
    activation: (gate, up) -> hidden on [bm, bn] float32 tiles, hashable; traced into the
      kernels (Triton must lower it: no erf).
    blocks: `TritonBlocks` (None: `default_blocks`, or `FP8_BLOCKS` under compute_quant); D
      and F multiples of block_n and block_k.
    precision: of the block dots (not the fp8 ones).
    interpret: run the kernels in the Pallas interpreter (a CPU).
    compute_quant: None, or "fp8_deepseek" (`moejax.compute_quant`; float matrices, D and F
      multiples of 128): every base product multiplies e4m3 operands in float32 sums
      promoted every 128 of the contraction (`_fp8_products`). Quantized in XLA by
      `fp8_groups.quantize_groups`: x, hidden, dout and d(gate|up) in 1x128 groups along the
      contraction (dout before its routing weight, which the epilogue applies), each matrix
      in 128x128 blocks, read transposed by the dgrads; the weight gradients' operands along
      the tokens in groups of 128 rows of one expert (one tile: `FP8_BLOCKS`' block_m), on
      gathered, weighted e4m3 copies of the aligned rows. Adapters multiply unquantized.
    fp8_matrices: under compute_quant, (`fp8_matrix(w_gate_up)`, `fp8_matrix(w_down)`)
      quantized once by a caller that multiplies by them many times, or None to quantize
      them here; the float matrices still get their gradients.
    output_norm: None, or a row-wise function of the experts' outputs ([rows, D] float32,
      biases added) applied before the routing weights, hashable (an RMS norm: Muse Spark's
      `post_expert_norm`). A row's norm needs all D columns, which no tile of the down
      kernel holds: that kernel then writes its rows unweighted in float32, and XLA
      normalizes and weighs them as it sums each token's K rows; the backward reads dout
      onto the aligned rows and differentiates the norm there (`jax.vjp`), and the
      down-projection's backward reads that aligned cotangent.
    grad_seeds: None, or arrays (seed_gate_up, seed_down) shaped like the float matrices:
      the gradient this call returns for each matrix is its seed plus the call's own, in
      the matrix's dtype, summed in float32 in the weight-gradient kernel and written over
      the seed in place (the seeds get no gradient). For a caller that sums a matrix's
      gradient over many calls (a chunk loop): a weight-sized add per call, and the
      kernel's float32 copy, saved.

  Returns:
    [N, D] float32.

  Raises:
    ValueError: an argument's shape that disagrees with the others, named.
    NotImplementedError: the widths or this JAX cannot run the kernels (`unsupported_reason`).
  """
  _check_shapes(x, expert_ids, weights, w_gate_up, w_down, b_gate_up, b_down, lora)
  if grad_seeds is not None:
    if is_block_scaled(w_gate_up):
      raise ValueError("grad_seeds seed the float matrices' gradients; BlockScaled ones have none")
    _check_like_matrices("grad_seeds", grad_seeds, w_gate_up, w_down)
  if fp8_matrices is not None:
    if compute_quant is None:
      raise ValueError("fp8_matrices are read under compute_quant only; compute_quant is None")
    _check_like_matrices("fp8_matrices", fp8_matrices, w_gate_up, w_down)
  elif compute_quant is not None:
    fp8_matrices = (fp8_matrix(w_gate_up), fp8_matrix(w_down))
  dim = x.shape[1]
  hidden_width = w_down.shape[1]
  if blocks is None:
    blocks = FP8_BLOCKS if compute_quant else default_blocks(expert_ids.size, dim, hidden_width)
  if is_block_scaled(w_gate_up) != is_block_scaled(w_down):
    raise ValueError("w_gate_up and w_down are BlockScaled together or not at all")
  forms = (weight_form(w_gate_up), weight_form(w_down))
  reason = unsupported_reason(dim, hidden_width, blocks, forms, compute_quant)
  if reason is not None:
    raise NotImplementedError(reason)
  layout = counted_layout(expert_ids, w_down.shape[0], blocks.block_m)
  settings = FusedSettings(activation, blocks, precision, interpret, compute_quant, output_norm)
  adapters = None if lora is None else _padded_rank(lora, blocks, forms)
  experts = Experts(w_gate_up, w_down, b_gate_up, b_down, adapters, fp8_matrices, grad_seeds)
  return _fused(x, weights.astype(jnp.float32), experts, layout, settings)
