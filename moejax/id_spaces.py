"""The expert id spaces, in one place: what every id means, and which device owns a slot.

Two numberings, each with its sentinels past the experts (E experts, Z = `num_zero_experts`
zero-computation experts, R = `num_redundant_experts` replicas, P = E + R physical slots, S
devices on the expert axis, El = P / S slots per device):

- logical ids (the router, top-k, router statistics): [0, E) experts; [E, E + Z)
  zero-computation experts (LongCat-Flash: the row itself, times its weight); E + Z the
  choices of padding tokens (`padding_id`), no expert.
- physical ids (the chunk loop, the exchange, per-slot counts): [0, P) slots, each holding
  one logical expert (`moejax.expert_placement.Placement` maps them, `expert_placement.physical_ids`
  translates); [P, P + Z) zero-computation experts (logical ids moved up by R); P + Z
  padding.

Without redundant experts the two are the same. Physical slot s lives on expert-axis device
`s // El` (`owner_device`) as its local expert `s mod El` (`local_id`); ids from P belong to
no device (`owner_device` gives S), so they are never sent and count for no slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import MoEConfig

Ids = jax.Array | np.ndarray | int  # traced ids, or host ids (NumPy, Python ints)


def padding_id(config: MoEConfig) -> int:
  """The logical id of padding tokens' choices, E + Z: an id no expert owns."""
  return config.num_experts + config.num_zero_experts


def is_expert(logical_ids: Ids, config: MoEConfig) -> Ids:
  """Whether each logical id is a routed expert, in [0, E) (not a zero expert, not padding)."""
  return logical_ids < config.num_experts


def past_the_slots(logical_ids: Ids, config: MoEConfig) -> Ids:
  """The physical ids of logical ids from E (zero experts, padding): moved up by R, past the
  P physical slots."""
  return logical_ids + config.num_redundant_experts


def is_zero_expert(physical_ids: Ids, config: MoEConfig) -> Ids:
  """Whether each physical id is a zero-computation expert, in [P, P + Z).

  >>> config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8,
  ...                    num_zero_experts=2)
  >>> is_zero_expert(jnp.array([3, 4, 5, 6]), config).tolist()
  [False, True, True, False]
  """
  first = config.num_physical_experts
  return (physical_ids >= first) & (physical_ids < first + config.num_zero_experts)


def owner_device(physical_ids: Ids, local_experts: int, axis_size: int) -> Ids:
  """The expert-axis device holding each slot (device s holds [s*El, (s+1)*El)); S for ids
  no device holds (from P: zero-computation experts and padding).

  >>> owner_device(jnp.array([0, 3, 4, 9]), local_experts=2, axis_size=2).tolist()
  [0, 1, 2, 2]
  """
  xp = jnp if isinstance(physical_ids, jax.Array) else np
  return xp.minimum(physical_ids // local_experts, axis_size)


def local_id(physical_ids: Ids, device: Ids, local_experts: int) -> Ids:
  """Each slot's index among `device`'s El slots; outside [0, El) if another device holds it.

  >>> local_id(jnp.array([0, 3, 4]), device=1, local_experts=2).tolist()
  [-2, 1, 2]
  """
  return physical_ids - device * local_experts


def is_local(local_ids: Ids, local_experts: int) -> Ids:
  """Whether each local id (`local_id`) is one of this device's El slots, in [0, El).

  >>> is_local(jnp.array([-2, 1, 2]), local_experts=2).tolist()
  [False, True, False]
  """
  return (local_ids >= 0) & (local_ids < local_experts)
