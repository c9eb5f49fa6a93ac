"""The backend registry: every grouped-matmul implementation, by name, in one table.

`BACKENDS[name]` is a frozen `Backend` record: its block-size class and defaults, why it cannot
run a case, and its two products, `gmm` (out = lhs @ rhs[g] per group of rows, with optional
epilogues) and `tgmm` (out[g] = lhs[rows of g]^T @ dout[rows of g], the weight gradient).
Everything that chooses or calls a backend reads this table.

>>> sorted(BACKENDS)
['mosaic', 'triton', 'xla']
>>> BACKENDS["mosaic"].unsupported_reason(jnp.float32, None, None)
'mosaic runs bf16/f16 wgmma only, got float32'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas import gmm_mosaic, gmm_triton, mosaic_quant
from kernels_pallas.activations import activate
from kernels_pallas.gmm_mosaic import MosaicBlocks
from kernels_pallas.gmm_triton import TritonBlocks


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of the grouped matmuls.

  Attributes:
    name: "xla", "triton" or "mosaic".
    blocks_type: its block-size dataclass (None for xla).
    default_blocks: (M, K, N) -> the forward kernel's blocks for that shape class.
    tgmm_blocks: (M, K, N) -> the transposed kernel's blocks.
    tgmm_multiples: blocks -> (M, K, N) multiples `tgmm`'s operands must be padded to.
    unsupported_reason: (dtype, activation, precision) -> why it cannot run the case, or None.
    quant_formats: the `kernels_pallas.quantized.FORMATS` its kernels take as a `BlockScaled`
      rhs, dequantized tile by tile in registers (`kernels_pallas.dequant`). XLA takes none:
      its ragged_dot would need every expert's weights dequantized at once.
    gmm: `gmm(lhs, rhs, group_sizes, row_weights, *, blocks, activation, transpose_rhs,
      out_dtype, precision, interpret)` -> [M, N]; operands padded to whole blocks.
    tgmm: `tgmm(lhs, dout, group_sizes, *, blocks, out_dtype, precision, interpret)` ->
      [G, K, N]; operands padded to `tgmm_multiples`.
    fit_blocks: (blocks, BlockScaled rhs) -> the blocks its kernels run that rhs with.
  """

  name: str
  blocks_type: type | None
  default_blocks: Callable
  tgmm_blocks: Callable
  tgmm_multiples: Callable
  unsupported_reason: Callable
  gmm: Callable
  tgmm: Callable
  quant_formats: tuple[str, ...] = ()
  fit_blocks: Callable = lambda blocks, rhs: blocks


def _xla_gmm(
  lhs,
  rhs,
  group_sizes,
  row_weights=None,
  *,
  blocks=None,
  activation=None,
  transpose_rhs=False,
  out_dtype=None,
  precision=None,
  interpret=False,
):
  """The contract of the kernels' `gmm` on `jax.lax.ragged_dot` (the reference backend)."""
  del blocks, interpret
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  out = jax.lax.ragged_dot(
    lhs, rhs, group_sizes, precision=precision, preferred_element_type=jnp.float32
  )
  if activation is not None:
    gate, up = jnp.split(out, 2, axis=-1)
    out = activate(gate, activation) * up
  if row_weights is not None:
    out = out * row_weights[:, None].astype(jnp.float32)
  return out.astype(out_dtype or lhs.dtype)


def _xla_tgmm(
  lhs, dout, group_sizes, *, blocks=None, out_dtype=None, precision=None, interpret=False
):
  """out[g] = lhs[rows of g]^T @ dout[rows of g], as a ragged contraction over rows."""
  del blocks, interpret
  numbers = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
  )
  out = jax.lax.ragged_dot_general(
    lhs, dout, group_sizes, numbers, precision=precision, preferred_element_type=jnp.float32
  )
  return out.astype(out_dtype or lhs.dtype)


def _no_blocks(*_) -> None:
  return None


def _runs_every_case(dtype, activation, precision) -> None:
  """XLA's ragged_dot takes every float dtype, both activations and every precision."""
  del dtype, activation, precision


def _mosaic_tgmm_blocks(num_rows: int, k: int, n: int) -> MosaicBlocks:
  """128 x 128 output tiles, 64 rows a step; 3 stages keep shared memory under the limit."""
  del num_rows, k, n
  return MosaicBlocks(block_m=128, block_n=128, block_k=64, max_concurrent_steps=3)


BACKENDS: dict[str, Backend] = {
  "xla": Backend(
    name="xla",
    blocks_type=None,
    default_blocks=_no_blocks,
    tgmm_blocks=_no_blocks,
    tgmm_multiples=lambda _: (1, 1, 1),
    unsupported_reason=_runs_every_case,
    gmm=_xla_gmm,
    tgmm=_xla_tgmm,
  ),
  "triton": Backend(
    name="triton",
    blocks_type=TritonBlocks,
    default_blocks=gmm_triton.default_blocks,
    tgmm_blocks=gmm_triton.default_blocks,
    tgmm_multiples=lambda b: (b.block_m, b.block_k, b.block_n),
    unsupported_reason=gmm_triton.unsupported_reason,
    gmm=gmm_triton.gmm_triton,
    tgmm=gmm_triton.tgmm_triton,
    quant_formats=("fp8_block", "mxfp4"),
    fit_blocks=gmm_triton.fit_blocks,
  ),
  "mosaic": Backend(
    name="mosaic",
    blocks_type=MosaicBlocks,
    default_blocks=gmm_mosaic.default_blocks,
    tgmm_blocks=_mosaic_tgmm_blocks,
    tgmm_multiples=lambda b: (1, b.block_m, b.block_n),
    unsupported_reason=gmm_mosaic.unsupported_reason,
    gmm=gmm_mosaic.gmm_mosaic,
    tgmm=gmm_mosaic.tgmm_mosaic,
    quant_formats=("fp8_block", "mxfp4"),
    fit_blocks=mosaic_quant.fit_blocks,
  ),
}
