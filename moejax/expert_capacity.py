"""Expert capacity (`MoEConfig.capacity_factor`): the assignments each device computes per
chunk, capped, the rest dropped, as Levanter grug's ring backend drops them.

A chunk of C rows per device sends its expert group S·C·K (row, choice) assignments, S·C·K / S
of them per device when routing is even. With capacity factor f a device computes at most
`assignment_capacity` = max(El, ceil(f · S·C·K / S)) of those that reach its El experts:
in order of local expert, then of the rows as they arrive, then of choice (`within_capacity`);
the others add nothing and get no gradient. `dropped` counts them, from the routing alone.

>>> assignment_capacity(1.25, chunk=4, top_k=2, axis_size=4, local_experts=2)
10
>>> ids = jnp.array([[0, 1], [0, 5], [1, 0]])  # 5: another device's expert
>>> within_capacity(ids, local_experts=2, capacity=3).tolist()  # expert 0's three first
[[0, 2], [0, 5], [2, 0]]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from moejax import id_spaces
from moejax.axis_groups import AxisGroup
from moejax.chunking import chunk_order
from moejax.collectives import axis_rank, gather_rows


def assignment_capacity(
  factor: float, chunk: int, top_k: int, axis_size: int, local_experts: int
) -> int:
  """The assignments a device computes per chunk: max(El, ceil(f · S·C·K / S)) (grug's
  arithmetic, so that the same factor keeps the same assignments)."""
  return max(local_experts, math.ceil(factor * (axis_size * chunk * top_k) / axis_size))


def within_capacity(local_ids: jax.Array, local_experts: int, capacity: int) -> jax.Array:
  """[N, K] local ids with the assignments past `capacity` moved off this device (id El).

  Kept: the first `capacity` of this device's assignments ordered by (local expert, row,
  choice); ids outside [0, El) (other devices', padding) stay as they are.
  """
  local = id_spaces.is_local(local_ids, local_experts)
  flat = jnp.arange(local_ids.size, dtype=jnp.int32).reshape(local_ids.shape)
  key = jnp.where(local, local_ids * local_ids.size + flat, local_experts * local_ids.size)
  rank = jnp.argsort(jnp.argsort(key.reshape(-1))).reshape(local_ids.shape)
  return jnp.where(local & (rank >= capacity), local_experts, local_ids)


def dropped(
  physical_ids: jax.Array,
  token_mask: jax.Array,
  chunk_size: int,
  *,
  axis: AxisGroup | None,
  axis_size: int,
  local_experts: int,
  capacity: int,
) -> jax.Array:
  """[] int32 assignments this device dropped in a call: in each chunk of the loop, those
  past `capacity` of the group's assignments to its slots.

  Args: physical_ids [L, K] and token_mask [L] of all this device's rows (padding's ids are
  past the slots); C; the expert group `axis` of S devices holding El slots each.
  """
  chunk_ids = physical_ids[chunk_order(token_mask, chunk_size)]  # [chunks, C, K]
  owner = id_spaces.owner_device(chunk_ids, local_experts, axis_size)
  devices = jnp.arange(axis_size, dtype=owner.dtype)[None, None, None, :]
  sent = jnp.sum(owner[..., None] == devices, axis=(1, 2), dtype=jnp.int32)  # [chunks, S]
  received = jnp.sum(gather_rows(sent[None], axis), axis=0)[:, axis_rank(axis)]  # [chunks]
  return jnp.sum(jnp.maximum(received - capacity, 0), dtype=jnp.int32)
