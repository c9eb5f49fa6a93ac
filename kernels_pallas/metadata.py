"""Group metadata for grouped matmul kernels: which row tile of which group each grid step runs.

Pure `jnp`, static shapes, tested without Pallas. Rows of `lhs` [M, K] are grouped in order:
group g owns rows [starts[g], ends[g]). The forward kernel's grid walks row tiles of
`block_m` rows; a tile that straddles a group boundary is visited once per group it touches,
each visit storing only that group's rows. Group g touches
`(ends[g] - 1) // bm - starts[g] // bm + 1` tiles (0 if empty), so all groups together need at
most `cdiv(M, bm) + G - 1` visits: that static bound is the grid size, and the visits past
`num_active` exit early.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupTiles(NamedTuple):
  """Per-visit metadata of a grouped matmul's row tiles.

  Attributes:
    tile_group: [V] int32 group of each visit (V = `max_visits(M, G, bm)`).
    tile_block: [V] int32 row tile (rows [b*bm, (b+1)*bm)) of each visit.
    starts: [G] int32 first row of each group.
    ends: [G] int32 one past the last row of each group.
    num_active: [1] int32 visits that do work; the rest are padding of the static grid.
  """

  tile_group: jax.Array
  tile_block: jax.Array
  starts: jax.Array
  ends: jax.Array
  num_active: jax.Array


def max_visits(num_rows: int, num_groups: int, block_m: int) -> int:
  """Static bound on tile visits for any group sizes: cdiv(M, bm) + G - 1."""
  return -(-num_rows // block_m) + num_groups - 1


def group_tiles(group_sizes: jax.Array, num_rows: int, block_m: int) -> GroupTiles:
  """Metadata of the row-tile visits for `group_sizes`.

  Args:
    group_sizes: [G] int sizes; their sum may be less than M (the rest of the rows belong to no
      group). Each size must be >= 0 and the sum <= M; larger sums are clipped to M.
    num_rows: M.
    block_m: bm, rows per tile.

  Returns:
    `GroupTiles` with `max_visits(M, G, bm)` visits.

  >>> tiles = group_tiles(jnp.array([3, 0, 6]), num_rows=10, block_m=4)
  >>> tiles.tile_group.tolist(), tiles.tile_block.tolist(), int(tiles.num_active[0])
  ([0, 2, 2, 2, 2], [0, 0, 1, 2, 0], 4)
  """
  sizes = group_sizes.astype(jnp.int32)
  cumulative = jnp.cumsum(sizes)
  ends = jnp.minimum(cumulative, num_rows)  # [G]
  starts = jnp.minimum(cumulative - sizes, num_rows)  # [G]
  # 1. Tiles each group touches: from its first row's tile to its last row's tile.
  first_block = starts // block_m
  touched = jnp.where(ends > starts, (ends - 1) // block_m - first_block + 1, 0)  # [G]
  visit_ends = jnp.cumsum(touched)  # [G]
  # 2. Visit v belongs to the group whose visit range holds v.
  visits = max_visits(num_rows, group_sizes.shape[0], block_m)
  visit = jnp.arange(visits, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(visit_ends, visit, side="right"), sizes.shape[0] - 1)
  group = group.astype(jnp.int32)
  block = first_block[group] + visit - (visit_ends[group] - touched[group])
  num_active = visit_ends[-1]
  # Padding visits point at tile 0: they do no work, but their indices stay in range.
  block = jnp.where(visit < num_active, block, 0).astype(jnp.int32)
  return GroupTiles(group, block, starts, ends, num_active[None].astype(jnp.int32))


class AlignedRows(NamedTuple):
  """Rows regrouped so that every tile of `block_m` rows belongs to a single group.

  Group g's rows are copied, in order, to whole tiles starting at tile `first_tile[g]`; the
  tail of its last tile is empty. Kernels then never mask rows; `api`-level gathers move the
  rows in and out.

  Attributes:
    row_source: [Ma] int32 source row of each aligned row; M for an empty row
      (Ma = `max_visits(M, G, bm) * bm`).
    tile_ends: [G] int32 one past each group's last tile (cumulative tile counts).
    source_row: [M] int32 aligned row of each source row; Ma for rows outside every group.
  """

  row_source: jax.Array
  tile_ends: jax.Array
  source_row: jax.Array


def aligned_rows(group_sizes: jax.Array, num_rows: int, block_m: int) -> AlignedRows:
  """Tile-aligned placement of M grouped rows.

  Args:
    group_sizes: [G] int sizes, sum <= M.
    num_rows: M.
    block_m: bm.

  Returns:
    `AlignedRows`.

  >>> rows = aligned_rows(jnp.array([3, 0, 2]), num_rows=6, block_m=2)
  >>> rows.row_source.tolist(), rows.tile_ends.tolist(), rows.source_row.tolist()
  ([0, 1, 2, 6, 3, 4, 6, 6, 6, 6], [2, 2, 3], [0, 1, 2, 4, 5, 10])
  """
  sizes = group_sizes.astype(jnp.int32)
  groups = sizes.shape[0]
  cumulative = jnp.cumsum(sizes)
  starts = cumulative - sizes
  tile_ends = jnp.cumsum(-(-sizes // block_m))  # [G]
  first_row = (tile_ends - -(-sizes // block_m)) * block_m  # [G] first aligned row per group
  aligned = max_visits(num_rows, groups, block_m) * block_m
  # Aligned row r: its tile's group g, its rank inside g, and whether g has that many rows.
  row = jnp.arange(aligned, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(tile_ends, row // block_m, side="right"), groups - 1)
  rank = row - first_row[group]
  filled = (row // block_m < tile_ends[-1]) & (rank < sizes[group])
  row_source = jnp.where(filled, starts[group] + rank, num_rows).astype(jnp.int32)
  # Source row m: its group (rows past the total belong to none) and its aligned row.
  source = jnp.arange(num_rows, dtype=jnp.int32)
  source_group = jnp.minimum(jnp.searchsorted(cumulative, source, side="right"), groups - 1)
  in_group = source < cumulative[-1]
  source_row = first_row[source_group] + source - starts[source_group]
  source_row = jnp.where(in_group, source_row, aligned).astype(jnp.int32)
  return AlignedRows(row_source, tile_ends.astype(jnp.int32), source_row)


def gather_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
  """x[rows] along the first axis, where row index len(x) reads zeros: moves rows into their
  aligned places (`AlignedRows.row_source`) and back (`source_row`)."""
  return jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])[rows]
