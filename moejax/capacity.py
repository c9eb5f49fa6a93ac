"""Receive capacity: all_to_all's receive buffers sized for the expected load, still dropless.

Dropless buffers hold the worst case: every row of every device of the expert group sent to
this one, S·C rows per chunk. Balanced routing sends a device about C·min(K, S) of them (a
row reaches at most min(K, S) devices; S·C rows spread over S devices). With
`MoEConfig.receive_capacity_factor` f, a device's buffers hold `capacity_rows`: f times that,
so memory and the exchange's buffers follow the expected load. A chunk for which any device
of the group would receive more (its rows' routing is known before the rows move: the send
sizes are gathered first) does not send at capacity: it runs again as a loop of sub-chunks
of `fallback_chunk` rows, whose worst case (S of them per device) fits the same capacity.
Every row is computed, exactly as without capacity.

>>> capacity_rows(2.0, chunk=64, top_k=8, axis_size=256)
1024
>>> fallback_chunk(64, capacity=1024, axis_size=256)
4
"""

from __future__ import annotations

import math

from moejax.config import MoEConfig, Scheme

GRANULE = 8  # buffers in whole multiples of 8 rows


def capacity_rows(factor: float, chunk: int, top_k: int, axis_size: int) -> int:
  """Rows a device receives per chunk at capacity: `factor` · C · min(K, S), rounded up to a
  multiple of 8, at least S (so that one-row sub-chunks fit), at most S·C (the worst case)."""
  rows = GRANULE * math.ceil(factor * chunk * min(top_k, axis_size) / GRANULE)
  return min(max(rows, axis_size), axis_size * chunk)


def fallback_chunk(chunk: int, capacity: int, axis_size: int) -> int:
  """The sub-chunk an overflowed chunk of C rows runs in: the largest divisor of C whose worst
  case, S rows per row of it, fits `capacity`."""
  most = max(capacity // axis_size, 1)
  return max(d for d in range(1, min(most, chunk) + 1) if chunk % d == 0)


def received_rows(config: MoEConfig, chunk: int, axis_size: int, scheme: Scheme) -> int:
  """N, the rows a device receives per chunk of C rows: `capacity_rows` with a capacity on
  all_to_all, else S·C (all_gather's gathered chunk; all_to_all's worst case)."""
  factor = config.receive_capacity_factor
  if factor is None or scheme != "all_to_all":
    return axis_size * chunk
  return capacity_rows(factor, chunk, config.top_k, axis_size)
