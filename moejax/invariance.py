"""Batch invariance (`MoEConfig.batch_invariant`): what makes a token's output bit-identical
whatever else is in the call.

A matmul's result for one row can depend on the matmul's shape: XLA (and cuBLAS) pick an
algorithm, and with it a summation order, by size; XLA:CPU compiles even elementwise work on
a [T, E] array differently from about 2048 rows on. The layer's per-token work whose shape
follows the call's size (a token's whole routing over all of a device's tokens, the shared
experts over a chunk) runs in fixed blocks of `BLOCK_ROWS` rows, and the tile loop's tiles
have `TILE_ROWS` rows whatever the call's size. docs/design.md, "Batch invariance" says
what this covers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig

# Rows of each block of the router's and the shared experts' matmuls.
BLOCK_ROWS = 128
# Rows of each tile of the tile loop.
TILE_ROWS = 64


def block_rows(config: MoEConfig) -> int | None:
  """The fixed block of the layer's per-token matmuls, or None: one matmul over all rows."""
  return BLOCK_ROWS if config.batch_invariant else None


def in_row_blocks(fn: Callable[[Any], Any], x: Any, rows: int | None) -> Any:
  """`fn` (rows [B, ...] -> rows [B, ...], pytrees of arrays with one leading B) on `x`
  (leading N), in fixed blocks of B = `rows` rows (zero-padded, one loop step per block), or
  on all of `x` at once when `rows` is None.

  In blocks, every row is computed by the same program whatever N is, so its result is
  bit-identical for every N. None leaves pass through.

  >>> square = lambda a: (a * a, None)
  >>> in_row_blocks(square, jnp.arange(5.0), 2)[0].tolist()
  [0.0, 1.0, 4.0, 9.0, 16.0]
  """
  if rows is None:
    return fn(x)
  num_rows = jax.tree.leaves(x)[0].shape[0]
  blocks = -(-num_rows // rows)

  def in_blocks(a: jax.Array) -> jax.Array:  # [N, ...] -> [blocks, B, ...], zero-padded
    padded = jnp.pad(a, [(0, blocks * rows - num_rows)] + [(0, 0)] * (a.ndim - 1))
    return padded.reshape(blocks, rows, *a.shape[1:])

  def joined(a: jax.Array) -> jax.Array:  # [blocks, B, ...] -> [N, ...]
    return a.reshape(blocks * rows, *a.shape[2:])[:num_rows]

  return jax.tree.map(joined, jax.lax.map(fn, jax.tree.map(in_blocks, x)))
