"""Autodiff wiring of the Pallas kernels: `jax.custom_vjp` for gmm and the fused expert MLP.

Backward passes reuse the forward kernels: d(lhs) = dout @ rhs[g]^T is the grouped matmul
reading rhs transposed, and d(rhs)[g] = lhs[rows of g]^T @ dout[rows of g] is the transposed
grouped matmul `tgmm`. The fused MLP does not store its [M, 2F] pre-activation; the backward
pass recomputes it with one grouped matmul. A `BlockScaled` rhs is a constant: the backward
computes d(lhs), reading it quantized and transposed, and no weight gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.activations import activate
from kernels_pallas.backends import BACKENDS, Case, unsupported_reason
from kernels_pallas.dequant import kernel_form
from kernels_pallas.metadata import aligned_rows, gather_rows
from kernels_pallas.quantized import BlockScaled, format_of, is_block_scaled


@dataclasses.dataclass(frozen=True)
class KernelSettings:
  """Static choices of one kernel call (hashable: a `custom_vjp` non-differentiable input).

  Attributes:
    implementation: a name in `BACKENDS`; its `gmm` and `tgmm` run every product.
    blocks: the backend's blocks for the forward kernel.
    tgmm_blocks: the backend's blocks for the transposed kernel.
    precision: `jax.lax.Precision` or `DotAlgorithmPreset` of the block dots, or None.
    out_dtype: output dtype, or None for lhs's.
    interpret: run the kernels in their interpreter (CPU testing).
  """

  implementation: str
  blocks: object
  tgmm_blocks: object
  precision: object = None
  out_dtype: object = None
  interpret: bool = False


def _pad(x: jax.Array | BlockScaled, axis: int, multiple: int) -> jax.Array | BlockScaled:
  """Zero-pads `axis` of x up to a multiple of `multiple` (no copy when it already is one)."""
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  if is_block_scaled(x):
    return x.pad(axis, x.shape[axis] + extra)
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def _pad_gate_up(rhs: jax.Array | BlockScaled, multiple: int) -> jax.Array | BlockScaled:
  """Pads each half of the [gate | up] last axis separately, so the halves stay aligned."""
  if (rhs.shape[-1] // 2) % multiple == 0:
    return rhs
  if is_block_scaled(rhs):
    return BlockScaled.concatenate_columns([_pad(h, -1, multiple) for h in rhs.split_columns(2)])
  gate, up = jnp.split(rhs, 2, axis=-1)
  return jnp.concatenate([_pad(gate, -1, multiple), _pad(up, -1, multiple)], axis=-1)


def _check_supported(settings: KernelSettings, dtype, activation=None, rhs=None) -> None:
  """Raises NotImplementedError with the registry's reason if the backend cannot run this."""
  case = Case(dtype, activation, precision=settings.precision, rhs_format=format_of(rhs))
  reason = unsupported_reason(settings.implementation, case)
  if reason is not None:
    raise NotImplementedError(reason)


def grouped_matmul(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  settings: KernelSettings,
  *,
  transpose_rhs: bool = False,
  activation: str | None = None,
  row_weights: jax.Array | None = None,
) -> jax.Array:
  """The forward kernel on any shape: pads M, K, N to whole blocks, runs, slices back.

  Args:
    lhs: [M, K].
    rhs: [G, K, N] ([G, N, K] with `transpose_rhs`); with `activation`, N = 2N' ([gate | up]).
      A `BlockScaled` rhs in a format the backend lists in `quant_formats`.
    group_sizes: [G] int32.
    settings: the kernel choice.
    transpose_rhs: read rhs as [G, N, K].
    activation: None, or the gated epilogue's activation.
    row_weights: [M] or None.

  Returns:
    [M, N] ([M, N'] with `activation`).
  """
  _check_supported(settings, lhs.dtype, activation, rhs)
  rhs = kernel_form(rhs) if is_block_scaled(rhs) else rhs
  backend = BACKENDS[settings.implementation]
  # The one place blocks are fitted to a quantized rhs's scale blocks.
  blocks = settings.blocks
  if is_block_scaled(rhs):
    blocks = backend.fit_blocks(blocks, rhs, transpose_rhs)
  num_rows = lhs.shape[0]
  n_axis, k_axis = (1, 2) if transpose_rhs else (2, 1)
  out_cols = rhs.shape[n_axis] // (2 if activation else 1)
  lhs = _pad(_pad(lhs, 0, blocks.block_m), 1, blocks.block_k)
  rhs = _pad(rhs, k_axis, blocks.block_k)
  rhs = _pad_gate_up(rhs, blocks.block_n) if activation else _pad(rhs, n_axis, blocks.block_n)
  if row_weights is not None:
    row_weights = _pad(row_weights, 0, blocks.block_m)
  out = backend.gmm(
    lhs,
    rhs,
    group_sizes.astype(jnp.int32),
    row_weights,
    blocks=blocks,
    activation=activation,
    transpose_rhs=transpose_rhs,
    out_dtype=settings.out_dtype,
    precision=settings.precision,
    interpret=settings.interpret,
  )
  return out[:num_rows, :out_cols]


def transposed_grouped_matmul(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  settings: KernelSettings,
  out_dtype=jnp.float32,
) -> jax.Array:
  """`tgmm` on any shape: out[g] = lhs[rows of g]^T @ rhs[rows of g], [G, K, N] `out_dtype`.

  Every backend sums a group's rows in float32 and rounds once as it stores, so a weight's
  gradient asked for in the weight's dtype is the float32 one rounded, without a float32 copy
  written and converted."""
  _check_supported(settings, lhs.dtype)
  backend = BACKENDS[settings.implementation]
  blocks = settings.tgmm_blocks
  row_multiple, k_multiple, n_multiple = backend.tgmm_multiples(blocks)
  # Rows padded and tiled as the forward kernels take them: the operands' padded (and, in a
  # kernel that regroups rows into tiles, regrouped) copies are those of the products that
  # read the same arrays, and XLA makes each once.
  row_tile = None if settings.blocks is None else settings.blocks.block_m
  row_multiple = math.lcm(row_multiple, row_tile or 1)
  k, n = lhs.shape[1], rhs.shape[1]
  out = backend.tgmm(
    _pad(_pad(lhs, 0, row_multiple), 1, k_multiple),
    _pad(_pad(rhs.astype(lhs.dtype), 0, row_multiple), 1, n_multiple),
    group_sizes.astype(jnp.int32),
    blocks=blocks,
    row_tile=row_tile,
    out_dtype=out_dtype,
    precision=settings.precision,
    interpret=settings.interpret,
  )
  return out[:, :k, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gmm_vjp(lhs, rhs, group_sizes, settings: KernelSettings):
  """Differentiable grouped matmul: [M, K] x [G, K, N] -> [M, N]."""
  return grouped_matmul(lhs, rhs, group_sizes, settings)


def _gmm_fwd(lhs, rhs, group_sizes, settings):
  return grouped_matmul(lhs, rhs, group_sizes, settings), (lhs, rhs, group_sizes)


def split_in_parts(x: jax.Array, dtype) -> list[jax.Array]:
  """x as `dtype` parts whose float32 sum is x: enough parts to hold every bit of x.

  The kernels multiply operands of one dtype (a dot cannot mix float32 and bfloat16), but a
  cotangent in a wider `preferred_element_type` (bf16 operands, f32 output) holds more bits
  than the operands: rounded to bf16 it loses 1e-2 of the gradient. Each part takes the next
  8 (bf16) or 11 (f16) bits of the 24 of a float32, so three parts hold all of it; each part
  multiplies exactly and the products accumulate in float32. Same or narrower dtypes need
  one part.

  >>> parts = split_in_parts(jnp.array([1 + 2**-10 + 2**-20]), jnp.bfloat16)
  >>> [p.tolist() for p in parts]
  [[1.0], [0.0009765625], [9.5367431640625e-07]]
  """
  bits = lambda d: jnp.finfo(d).nmant + 1
  count = -(-bits(x.dtype) // bits(dtype))
  parts = []
  for _ in range(count):
    parts.append(x.astype(dtype))
    x = x - parts[-1].astype(x.dtype)
  return parts


def _gmm_bwd(settings, residuals, dout):
  lhs, rhs, group_sizes = residuals
  parts = split_in_parts(dout, lhs.dtype)
  # One part: each gradient in its operand's dtype straight from the kernel (which sums in
  # float32 and rounds once as it stores); several: float32 sums over the parts, then rounded.
  out_dtype = lambda like: like.dtype if len(parts) == 1 else jnp.float32
  to_lhs = dataclasses.replace(settings, out_dtype=out_dtype(lhs))
  d_lhs = functools.reduce(
    jnp.add, [grouped_matmul(p, rhs, group_sizes, to_lhs, transpose_rhs=True) for p in parts]
  )
  if is_block_scaled(rhs):  # quantized weights are constants
    return d_lhs.astype(lhs.dtype), None, None
  # d(rhs) of every part in one call: the parts side by side as columns, summed after.
  columns = jnp.concatenate(parts, axis=1)
  d_rhs = transposed_grouped_matmul(lhs, columns, group_sizes, settings, out_dtype(rhs))
  d_rhs = functools.reduce(jnp.add, jnp.split(d_rhs, len(parts), axis=2))
  return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None


gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


class RowLayout(NamedTuple):
  """Where the expert MLP keeps its rows from one product to the next.

  As they are ([M, W]: each product pads, and regroups if its kernel does, for itself), or,
  for a backend with kernels on regrouped rows (`Backend.gmm_tiles`), regrouped once into
  whole tiles of one group each ([Ma, W], `metadata.aligned_rows`), every product reading
  and writing tiles. Rows of tiles past the groups' last hold no defined value, and no
  product or move back reads them.

  Attributes:
    into: [M, ...] rows -> the layout's rows (a tile's empty rows 0).
    back: the layout's rows -> [M, ...] (rows past every group 0).
    gmm: (lhs, rhs, settings, *, transpose_rhs, activation, row_weights) -> the product,
      its rows (and row_weights') in the layout, as `grouped_matmul`.
    tgmm: (lhs, dout, out_dtype) -> [G, K, N], rows in the layout.
  """

  into: Callable
  back: Callable
  gmm: Callable
  tgmm: Callable


def row_layout(
  x: jax.Array, w_gate_up, group_sizes: jax.Array, settings: KernelSettings
) -> RowLayout:
  """The MLP's rows in tiles where the backend has kernels on tiles, its weights are float
  and no product needs padding (a model's sizes are multiples of the blocks); else as they
  are."""
  backend = BACKENDS[settings.implementation]
  blocks, tgmm_blocks = settings.blocks, settings.tgmm_blocks
  d, f = x.shape[1], w_gate_up.shape[-1] // 2
  if backend.gmm_tiles is None or is_block_scaled(w_gate_up):
    tiled = False
  else:
    multiple = math.lcm(blocks.block_k, blocks.block_n, tgmm_blocks.block_m, tgmm_blocks.block_n)
    tiled = d % multiple == f % multiple == blocks.block_m % tgmm_blocks.block_k == 0
  if not tiled:
    return RowLayout(
      into=lambda rows: rows,
      back=lambda rows: rows,
      gmm=lambda lhs, rhs, settings, **options: grouped_matmul(
        lhs, rhs, group_sizes, settings, **options
      ),
      tgmm=lambda lhs, dout, out_dtype: transposed_grouped_matmul(
        lhs, dout, group_sizes, settings, out_dtype
      ),
    )
  rows = aligned_rows(group_sizes, x.shape[0], blocks.block_m)

  def gmm(lhs, rhs, settings, *, transpose_rhs=False, activation=None, row_weights=None):
    _check_supported(settings, lhs.dtype, activation, rhs)
    out = backend.gmm_tiles(
      lhs,
      rhs,
      rows.tile_ends,
      blocks=settings.blocks,
      activation=activation,
      transpose_rhs=transpose_rhs,
      out_dtype=settings.out_dtype,
      interpret=settings.interpret,
    )
    if row_weights is None:
      return out
    return (out.astype(jnp.float32) * row_weights[:, None].astype(jnp.float32)).astype(out.dtype)

  return RowLayout(
    into=lambda x: gather_rows(x, rows.row_source),
    back=lambda x: gather_rows(x, rows.source_row),
    gmm=gmm,
    tgmm=lambda lhs, dout, out_dtype: backend.tgmm_tiles(
      lhs,
      dout,
      group_sizes,
      blocks=tgmm_blocks,
      row_tile=blocks.block_m,
      out_dtype=out_dtype,
      interpret=settings.interpret,
    ),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def moe_mlp_vjp(x, w_gate_up, w_down, group_sizes, row_weights, activation: str, settings):
  """Differentiable fused expert MLP: row_weights * (act(x @ Wg) * (x @ Wu)) @ Wd, per group."""
  return _moe_mlp_fwd(x, w_gate_up, w_down, group_sizes, row_weights, activation, settings)[0]


def _moe_mlp_fwd(x, w_gate_up, w_down, group_sizes, row_weights, activation, settings):
  rows = row_layout(x, w_gate_up, group_sizes, settings)
  hidden = rows.gmm(rows.into(x), w_gate_up, settings, activation=activation)  # [M, F]
  out = rows.gmm(hidden, w_down, settings, row_weights=rows.into(row_weights))  # [M, D]
  return rows.back(out), (x, w_gate_up, w_down, group_sizes, row_weights)


def _moe_mlp_bwd(activation, settings, residuals, d_out):
  x, w_gate_up, w_down, group_sizes, row_weights = residuals
  rows = row_layout(x, w_gate_up, group_sizes, settings)
  x_rows, d_out_rows, weights = rows.into(x), rows.into(d_out), rows.into(row_weights)
  f32 = dataclasses.replace(settings, out_dtype=jnp.float32)
  # 1. Recompute the pre-activation (the forward pass never stored it).
  gate, up = jnp.split(rows.gmm(x_rows, w_gate_up, f32), 2, axis=-1)  # [M, F] x2
  act, act_vjp = jax.vjp(lambda g: activate(g, activation), gate)
  hidden = act * up  # [M, F]
  # 2. Through the down projection and the row weights: q = d_out @ Wd^T.
  q = rows.gmm(d_out_rows, w_down, f32, transpose_rhs=True)  # [M, F]
  d_row_weights = rows.back(jnp.sum(hidden * q, axis=-1))  # [M]
  d_hidden = q * weights[:, None].astype(jnp.float32)
  # 3. Through the gated activation and the gate/up projection.
  d_gate_up = jnp.concatenate([act_vjp(d_hidden * up)[0], d_hidden * act], axis=-1)  # [M, 2F]
  d_gate_up = d_gate_up.astype(x.dtype)
  to_x = dataclasses.replace(settings, out_dtype=x.dtype)  # rounded once, in the kernel
  d_x = rows.back(rows.gmm(d_gate_up, w_gate_up, to_x, transpose_rhs=True))
  d_weights = (None, None)  # quantized weights are constants
  if not is_block_scaled(w_gate_up):
    # The row weights scale the narrower operand, hidden [M, F] (f32, rounded once), and the
    # products read x and d_out as they are: the copies the products above made of them.
    weighted_hidden = (hidden * weights[:, None].astype(jnp.float32)).astype(x.dtype)
    d_weights = (
      rows.tgmm(x_rows, d_gate_up, w_gate_up.dtype),
      rows.tgmm(weighted_hidden, d_out_rows.astype(x.dtype), w_down.dtype),
    )
  return (d_x, *d_weights, None, d_row_weights.astype(row_weights.dtype))


moe_mlp_vjp.defvjp(_moe_mlp_fwd, _moe_mlp_bwd)
