"""Kernel metadata (pure jnp) against plain Python constructions, every zero-size pattern."""

import itertools

import jax
import numpy as np
import pytest

from kernels_pallas.metadata import aligned_rows, group_tiles, max_visits

jit_group_tiles = jax.jit(group_tiles, static_argnums=(1, 2))
jit_aligned_rows = jax.jit(aligned_rows, static_argnums=(1, 2))


def python_visits(sizes, num_rows, block_m):
  """(group, tile) visits in order: each group's tiles from its first row's to its last's."""
  visits, start = [], 0
  for g, size in enumerate(sizes):
    end = min(start + size, num_rows)
    if end > start:
      visits += [(g, b) for b in range(start // block_m, (end - 1) // block_m + 1)]
    start = end
  return visits


def python_aligned(sizes, num_rows, block_m):
  rows_total = max_visits(num_rows, len(sizes), block_m) * block_m
  row_source, source_row = [num_rows] * rows_total, [rows_total] * num_rows
  row, start = 0, 0
  for size in sizes:
    for i in range(size):
      row_source[row + i], source_row[start + i] = start + i, row + i
    row += -(-size // block_m) * block_m
    start += size
  return row_source, source_row


SIZE_PATTERNS = [
  [s * (g + 1) for g, s in enumerate(present)] for present in itertools.product([0, 3], repeat=4)
]


@pytest.mark.parametrize("block_m", [1, 2, 4])
@pytest.mark.parametrize("num_rows", [30, 33])
def test_group_tiles_every_zero_pattern(num_rows, block_m):
  for sizes in SIZE_PATTERNS:
    tiles = jit_group_tiles(np.array(sizes, np.int32), num_rows, block_m)
    want = python_visits(sizes, num_rows, block_m)
    active = int(tiles.num_active[0])
    groups, blocks = np.asarray(tiles.tile_group)[:active], np.asarray(tiles.tile_block)[:active]
    got = list(zip(groups.tolist(), blocks.tolist(), strict=True))
    assert got == want, sizes
    assert len(tiles.tile_group) == max_visits(num_rows, 4, block_m) >= active


@pytest.mark.parametrize("block_m", [1, 2, 4])
def test_aligned_rows_every_zero_pattern(block_m):
  for sizes in SIZE_PATTERNS:
    rows = jit_aligned_rows(np.array(sizes, np.int32), 31, block_m)
    row_source, source_row = python_aligned(sizes, 31, block_m)
    np.testing.assert_array_equal(np.asarray(rows.row_source), row_source, err_msg=str(sizes))
    np.testing.assert_array_equal(np.asarray(rows.source_row), source_row, err_msg=str(sizes))


def test_group_sums_past_m_are_clipped():
  tiles = group_tiles(np.array([8, 8], np.int32), 10, 4)
  assert np.asarray(tiles.starts).tolist() == [0, 8]
  assert np.asarray(tiles.ends).tolist() == [8, 10]
