"""The fp8 exchange (`MoEConfig.dispatch_quant="fp8"`): dispatched rows cross the expert axis as
float8_e4m3fn values with a float32 scale per 1x128 group (amax / 448; 1 for a group of zeros:
`kernels_pallas.fp8_groups`, the function the fp8 recipes quantize with),
about half the bytes of bf16, and are dequantized to the compute dtype on arrival (what an fp8
matmul would read; `compute_quant="fp8_deepseek"` quantizes them again to the same values).

Only the outbound rows are quantized: the routing ids and weights travel as they are, and the
experts' partial outputs return in float32. The backward pass sends the rows' cotangents back
unquantized (the exact transpose of the exchange): the quantization is a straight-through
rounding of the rows, so the gradients are those of the layer at the rounded rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from kernels_pallas.fp8_groups import GROUP, dequantize_groups, quantize_groups

# A row map that moves rows between devices and is linear in them: (rows [N, W], *index
# arrays) -> rows [M, W], for any dtype and width W (the exchange's collective and gathers).
Move = Callable[..., jax.Array]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def moved_in_fp8(move: Move, rows: jax.Array, *indices: jax.Array) -> jax.Array:
  """move(rows, *indices), the rows sent as fp8 values and their scales (two moves), in rows'
  dtype on arrival. Differentiable in `rows` only, straight through the rounding.

  Args:
    move: the exchange's row map (`Move`), hashable.
    rows: [N, D] rows to send, D a multiple of 128.
    indices: the arrays `move` takes after the rows (offsets, sizes), never differentiated.
  """
  values, scales = quantize_groups(rows, (1, GROUP))  # [N, D] e4m3, [N, D/128] float32
  return dequantize_groups(move(values, *indices), move(scales, *indices)).astype(rows.dtype)


def _moved_fwd(move, rows, *indices):
  return moved_in_fp8(move, rows, *indices), (rows, indices)


def _moved_bwd(move, residuals, cotangent):
  rows, indices = residuals
  (d_rows,) = jax.linear_transpose(lambda r: move(r, *indices), rows)(cotangent)
  return (d_rows, *(None for _ in indices))


moved_in_fp8.defvjp(_moved_fwd, _moved_bwd)
