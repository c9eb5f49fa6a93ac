"""Where each expert's replicas live: the `Placement` a layer with redundant experts computes by.

A layer with R = `num_redundant_experts` holds P = E + R physical expert slots, split over the
expert axis like the experts of a layer without replicas (P / S per device). Routing stays
logical (the router, top-k and every router statistic see E experts); only the chunk loop's
ids are physical: choice k of local row l of expert e goes to replica
`(l·K + k) mod replica_counts[e]` (vLLM's rule), at slot `logical_to_physical[e, replica]`.

The placement is data (a pytree of int32 arrays), never config and never a parameter:
re-placing experts compiles nothing, and `jax.grad` and optax never see integer leaves.
`moejax.eplb` computes placements from measured load and moves the weights.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax import id_spaces
from moejax.config import MoEConfig
from moejax.stacking import layer_of


class Placement(NamedTuple):
  """Which logical expert each physical slot holds. With a leading layer axis on every field
  for several layers (what `moejax.eplb.rebalance` returns for [layers, E] loads).

  Attributes:
    physical_to_logical: [P] int32 logical expert of each physical slot.
    logical_to_physical: [E, R + 1] int32 the slots of each expert's replicas, -1 padded.
    replica_counts: [E] int32 replicas of each expert (>= 1, summing to P).
  """

  physical_to_logical: np.ndarray | jax.Array
  logical_to_physical: np.ndarray | jax.Array
  replica_counts: np.ndarray | jax.Array


def initial_placement(num_experts: int, num_redundant: int) -> Placement:
  """A new layer's placement: slot e holds expert e, slot E + i holds expert i mod E (vLLM's).

  >>> initial_placement(3, 2).physical_to_logical.tolist()
  [0, 1, 2, 0, 1]
  """
  physical = np.arange(num_experts + num_redundant) % num_experts
  return from_physical_to_logical(physical, num_experts)


def from_physical_to_logical(physical_to_logical, num_experts: int) -> Placement:
  """The whole `Placement` of a [P] (or [layers, P]) slot -> expert map, replicas in slot order.

  Raises:
    ValueError: an id outside [0, E), or an expert without a slot.
  """
  physical = np.asarray(physical_to_logical, np.int64)
  if physical.size == 0 or physical.min() < 0 or physical.max() >= num_experts:
    raise ValueError(f"physical_to_logical holds ids outside [0, {num_experts}): {physical}")
  layers = physical.reshape(-1, physical.shape[-1])
  counts = np.stack([np.bincount(row, minlength=num_experts) for row in layers])
  if np.any(counts == 0):
    missing = sorted({int(e) for e in np.nonzero(counts == 0)[1]})
    raise ValueError(f"physical_to_logical leaves experts {missing} without a slot")
  width = physical.shape[-1] - num_experts + 1  # R + 1: at most one expert holds every spare
  to_physical = np.full((len(layers), num_experts, width), -1, np.int64)
  for layer, row in enumerate(layers):
    filled = np.zeros(num_experts, np.int64)
    for slot, expert in enumerate(row):
      to_physical[layer, expert, filled[expert]] = slot
      filled[expert] += 1
  lead = physical.shape[:-1]
  return Placement(
    physical.astype(np.int32),
    to_physical.reshape(*lead, num_experts, width).astype(np.int32),
    counts.reshape(*lead, num_experts).astype(np.int32),
  )


def check_values(placement: Placement, config: MoEConfig) -> Placement:
  """`placement` as NumPy int32 arrays, after checking its values describe one valid map
  (replicas of an expert may be listed in any order).

  Raises:
    ValueError: an id out of range, a logical expert without a slot, or fields that disagree
      with each other (the shapes are `moejax.inputs.check_placement`'s to check first).
  """
  host = Placement(*(np.asarray(field).astype(np.int32) for field in placement))
  expected = from_physical_to_logical(host.physical_to_logical, config.num_experts)
  if not np.array_equal(host.replica_counts, expected.replica_counts):
    raise ValueError(
      "placement.replica_counts disagrees with placement.physical_to_logical: expected "
      f"{expected.replica_counts.tolist()}"
    )
  # Each expert's row lists its slots (in any order), then -1s.
  if not np.array_equal(np.sort(host.logical_to_physical), np.sort(expected.logical_to_physical)):
    raise ValueError(
      "placement.logical_to_physical disagrees with placement.physical_to_logical: expected "
      f"the slots {expected.logical_to_physical.tolist()} (-1 padded, in any order per expert)"
    )
  listed = np.arange(host.logical_to_physical.shape[-1])[None] < host.replica_counts[:, None]
  if np.any((host.logical_to_physical >= 0) != listed):
    raise ValueError("placement.logical_to_physical must list each expert's slots first, then -1")
  return host


def physical_ids(
  expert_ids: jax.Array, placement: Placement | None, config: MoEConfig
) -> jax.Array:
  """The slot each choice is dispatched to: [N, K] logical ids -> [N, K] physical ids.

  Choice k of row n of expert e < E goes to `logical_to_physical[e, (n·K + k) mod
  replica_counts[e]]`; ids from E (zero-computation experts, padding) move up by R, past the
  physical slots (`moejax.id_spaces`). Without a placement (R = 0) the ids are returned as they are.

  >>> placement = initial_placement(num_experts=2, num_redundant=2)
  >>> config = MoEConfig(num_experts=2, top_k=2, hidden_size=4, intermediate_size=4,
  ...                    num_redundant_experts=2)
  >>> physical_ids(jnp.array([[0, 1], [0, 2]]), placement, config).tolist()
  [[0, 3], [0, 4]]
  """
  if placement is None:
    return expert_ids
  rows, top_k = expert_ids.shape
  position = jnp.arange(rows)[:, None] * top_k + jnp.arange(top_k)[None, :]
  logical = jnp.minimum(expert_ids, config.num_experts - 1)
  counts = jnp.maximum(jnp.asarray(placement.replica_counts)[logical], 1)
  slot = jnp.asarray(placement.logical_to_physical)[logical, position % counts]
  expert = id_spaces.is_expert(expert_ids, config)
  return jnp.where(expert, slot, id_spaces.past_the_slots(expert_ids, config)).astype(jnp.int32)


def physical_counts(physical_ids: jax.Array, num_physical: int) -> jax.Array:
  """[P] int32 (row, choice) pairs sent to each physical slot (ids from P count nowhere)."""
  flat = jnp.minimum(physical_ids.reshape(-1), num_physical)
  return jnp.zeros(num_physical + 1, jnp.int32).at[flat].add(1)[:num_physical]


def logical_load(load: np.ndarray, placement: Placement) -> np.ndarray:
  """[P] per-slot load -> [E] per-expert load: each expert's replicas summed (host NumPy);
  [layers, P] -> [layers, E] for a stack of layers, each by its own placement."""
  if np.ndim(load) == 2:
    return np.stack([logical_load(row, layer_of(placement, i)) for i, row in enumerate(load)])
  experts = np.shape(placement.replica_counts)[-1]
  to_logical = np.asarray(placement.physical_to_logical)
  return np.bincount(to_logical, weights=np.asarray(load, np.float64), minlength=experts)
