"""Tile layout metadata (pure jnp) against a plain numpy construction."""

import itertools

import jax
import numpy as np
import pytest

from moejax.grouping import num_tiles, tile_layout
from tests.helpers import seed_of


def numpy_layout(groups: np.ndarray, num_groups: int, tile_rows: int):
  """The same layout built with Python loops: groups in order, each padded to whole tiles."""
  rows_total = num_tiles(len(groups), num_groups, tile_rows) * tile_rows
  row_item = np.full(rows_total, len(groups))
  item_row = np.full(len(groups), rows_total)
  tile_group = []
  row = 0
  for g in range(num_groups):
    members = [i for i, gi in enumerate(groups) if gi == g]
    for i in members:
      row_item[row] = i
      item_row[i] = row
      row += 1
    row = -(-row // tile_rows) * tile_rows
    tile_group += [g] * (-(-len(members) // tile_rows))
  used = len(tile_group)
  tiles = rows_total // tile_rows
  tile_group += [num_groups - 1] * (tiles - used)
  return row_item, np.array(tile_group), item_row, used


jit_tile_layout = jax.jit(tile_layout, static_argnums=(1, 2))


def check(groups: np.ndarray, num_groups: int, tile_rows: int) -> None:
  got = jit_tile_layout(jax.numpy.asarray(groups), num_groups, tile_rows)
  want = numpy_layout(groups, num_groups, tile_rows)
  for name, g, w in zip(("row_item", "tile_group", "item_row"), got[:3], want[:3], strict=True):
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name} for groups {groups}")
  assert int(got.num_used_tiles) == want[3]


@pytest.mark.parametrize("tile_rows", [1, 2, 4])
def test_every_zero_size_pattern(tile_rows):
  num_groups = 4
  for present in itertools.product([False, True], repeat=num_groups):
    groups = [g for g in range(num_groups) if present[g] for _ in range(g + 1)]
    # Items in no group (ids G and -1) fill every pattern to 12 items: one shape, one compile.
    groups = np.array(groups + [num_groups, -1] * 6, dtype=np.int32)[:12]
    np.random.default_rng(len(groups)).shuffle(groups)
    check(groups, num_groups, tile_rows)


@pytest.mark.parametrize("tile_rows", [1, 3, 8])
@pytest.mark.parametrize("num_groups", [1, 5, 16])
def test_random_groups(num_groups, tile_rows, request):
  rng = np.random.default_rng(seed_of(request.node.name))
  for items in (1, 7, 64):
    groups = rng.integers(-1, num_groups + 2, size=items).astype(np.int32)
    check(groups, num_groups, tile_rows)


def test_all_items_in_one_group_and_none_in_any():
  check(np.full(13, 2, np.int32), 4, 4)
  check(np.full(13, 9, np.int32), 4, 4)
