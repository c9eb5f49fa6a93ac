"""The reference backend: the kernels' `gmm` and `tgmm` contracts, and `moe_mlp`, on XLA's
`jax.lax.ragged_dot`.

It takes every float dtype, both epilogue activations and every precision, and no quantized
rhs: its ragged_dot would need every expert's weights dequantized at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.activations import activate


def unsupported_reason(dtype, activation, precision) -> None:
  """XLA's ragged_dot runs every case: always None."""
  del dtype, activation, precision


def no_blocks(*_) -> None:
  """XLA has no block sizes."""
  return None


def gmm_xla(
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
  """The kernels' `gmm` (`backends.Backend.gmm`): [M, K] x [G, K, N] -> [M, N], with the
  gated and row-weight epilogues, accumulated in float32."""
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


def tgmm_xla(
  lhs,
  dout,
  group_sizes,
  *,
  blocks=None,
  row_tile=None,
  out_dtype=None,
  precision=None,
  interpret=False,
):
  """out[g] = lhs[rows of g]^T @ dout[rows of g], as a ragged contraction over rows."""
  del blocks, row_tile, interpret
  numbers = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
  )
  out = jax.lax.ragged_dot_general(
    lhs, dout, group_sizes, numbers, precision=precision, preferred_element_type=jnp.float32
  )
  return out.astype(out_dtype or lhs.dtype)


def moe_mlp_reference(x, w_gate_up, w_down, group_sizes, row_weights, activation, precision=None):
  """`kernels_pallas.moe_mlp` in plain XLA: two `ragged_dot`s around the gated activation, in
  float32."""
  hidden = gmm_xla(x, w_gate_up, group_sizes, activation=activation, precision=precision)
  return gmm_xla(hidden, w_down, group_sizes, row_weights, precision=precision)
