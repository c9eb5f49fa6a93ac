"""Group metadata for tiled grouped matmuls: which rows of which group go into which tile.

Pure `jnp` with static shapes, so it runs under `jit` for any group sizes. Rows are sorted by
group, and each group is padded to whole tiles of `tile_rows` rows, so that every tile belongs
to exactly one group and a tile is one dense matmul against that group's weights. The number of
tiles is bounded statically: groups of sizes s_g need sum_g ceil(s_g / B) <= ceil(A / B) + G - 1
tiles, so a buffer of ceil(A / B) + G tiles always fits; tiles past `num_used_tiles` are empty.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TileLayout(NamedTuple):
  """A block-padded, group-sorted arrangement of A items into tiles of B rows.

  Attributes:
    row_item: [num_tiles * B] int32 item held by each tiled row; A for an empty row.
    tile_group: [num_tiles] int32 group of each tile (tiles past the used ones repeat the last).
    item_row: [A] int32 tiled row of each item; num_tiles * B for items in no group.
    num_used_tiles: [] int32 tiles that hold at least one item.
  """

  row_item: jax.Array
  tile_group: jax.Array
  item_row: jax.Array
  num_used_tiles: jax.Array


def num_tiles(num_items: int, num_groups: int, tile_rows: int) -> int:
  """Static upper bound on the tiles any grouping of `num_items` items needs."""
  return -(-num_items // tile_rows) + num_groups


def tile_layout(item_group: jax.Array, num_groups: int, tile_rows: int) -> TileLayout:
  """Sorts items by group and pads each group to whole tiles.

  Args:
    item_group: [A] int group of each item; values outside [0, num_groups) mean "no group":
      the item lands in no tile.
    num_groups: G.
    tile_rows: B, rows per tile.

  Returns:
    The `TileLayout` (static shapes: `num_tiles(A, G, B)` tiles).

  >>> layout = tile_layout(jnp.array([1, 0, 1, 5]), num_groups=2, tile_rows=2)
  >>> layout.row_item.tolist(), layout.tile_group.tolist(), int(layout.num_used_tiles)
  ([1, 4, 0, 2, 4, 4, 4, 4], [0, 1, 1, 1], 2)
  >>> layout.item_row.tolist()
  [2, 0, 3, 8]
  """
  num_items = item_group.shape[0]
  tiles = num_tiles(num_items, num_groups, tile_rows)
  group = jnp.where((item_group >= 0) & (item_group < num_groups), item_group, num_groups)
  group = group.astype(jnp.int32)
  # 1. Sort items by group; items in no group (id G) sort last.
  order = jnp.argsort(group, stable=True)  # [A]
  sizes = jnp.zeros(num_groups + 1, jnp.int32).at[group].add(1)[:num_groups]  # [G]
  starts = jnp.cumsum(sizes) - sizes  # [G] first sorted position of each group
  # 2. Each group takes ceil(size / B) tiles, laid out back to back.
  group_tiles = -(-sizes // tile_rows)  # [G]
  tile_ends = jnp.cumsum(group_tiles)  # [G]
  first_tile = tile_ends - group_tiles  # [G]
  tile = jnp.arange(tiles, dtype=jnp.int32)
  tile_group = jnp.minimum(jnp.searchsorted(tile_ends, tile, side="right"), num_groups - 1)
  tile_group = tile_group.astype(jnp.int32)
  # 3. Tiled row r of tile t holds the group's item number (t - first_tile) * B + r % B.
  row = jnp.arange(tiles * tile_rows, dtype=jnp.int32)
  row_group = tile_group[row // tile_rows]
  rank = (row // tile_rows - first_tile[row_group]) * tile_rows + row % tile_rows
  filled = (row // tile_rows < tile_ends[-1]) & (rank < sizes[row_group])
  sorted_position = jnp.where(filled, starts[row_group] + rank, 0)
  row_item = jnp.where(filled, order[sorted_position], num_items)
  # 4. The inverse map: sorted item i of group g sits at row first_tile[g] * B + (i - start[g]).
  sorted_group = group[order]
  safe_group = jnp.minimum(sorted_group, num_groups - 1)
  sorted_row = first_tile[safe_group] * tile_rows + jnp.arange(num_items) - starts[safe_group]
  sorted_row = jnp.where(sorted_group < num_groups, sorted_row, tiles * tile_rows)
  item_row = jnp.zeros(num_items, jnp.int32).at[order].set(sorted_row.astype(jnp.int32))
  return TileLayout(row_item, tile_group, item_row, tile_ends[-1])
