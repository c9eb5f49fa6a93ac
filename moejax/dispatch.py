"""The expert-axis exchange: how a chunk's rows reach the devices holding their experts.

Two schemes share one interface (`Exchange`): `send` moves a chunk's rows to the devices of
the expert axis, `combine` brings the experts' partial outputs back and sums them per row.
The chunk loop runs `send` for chunk i+1 while the experts of chunk i compute.

- `AllGather` (vLLM's all-gather / reduce-scatter): every row goes to all S devices of the
  axis, whatever its routing; partial sums come back by `psum_scatter`. (S-1)·D values out
  and back per row.
- `AllToAll` (dropless, like DeepEP or MaxText's `ragged_all_to_all`): each (row, device)
  pair that the row's K choices need is sent once, with that device's (local expert id,
  weight) pairs; at most min(K, S) copies per row, and none for padding. A device receives at
  most C rows from each source, so the static buffers are [S·C, ...]: nothing is ever dropped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from kernels_pallas import platform
from moejax.collectives import (
  axis_rank,
  filled_like,
  gather_rows,
  platform_has_ragged_all_to_all,
  ragged_all_to_all,
  scatter_sum_rows,
  swap_slices,
)
from moejax.config import Dispatch, MoEConfig, Scheme
from moejax.id_spaces import is_local, local_id, owner_device


class Dispatched(NamedTuple):
  """What a device received for one chunk: N = S·C rows and, per row, its K local choices.

  Attributes:
    rows: [N, D] received rows in the compute dtype (unfilled rows hold zeros).
    local_ids: [N, K] int32 local expert ids; ids outside [0, El) compute nothing.
    weights: [N, K] float32 combine weights (0 where the id is not local).
    route_back: scheme-specific arrays `combine` needs to return the results.
  """

  rows: jax.Array
  local_ids: jax.Array
  weights: jax.Array
  route_back: Any


class Exchange(Protocol):
  """One expert-axis exchange scheme (see the module docstring).

  Attributes:
    axis: the expert group's mesh axes, or None without a mesh.
    axis_size: S.
    local_experts: El.
  """

  axis: tuple[str, ...] | None
  axis_size: int
  local_experts: int

  def send(self, rows: jax.Array, expert_ids: jax.Array, weights: jax.Array) -> Dispatched:
    """Sends a chunk: rows [C, D], physical expert_ids [C, K] (`moejax.id_spaces`: ids from P go to
    no device), weights [C, K]."""
    ...

  def combine(self, expert_out: jax.Array, dispatched: Dispatched) -> jax.Array:
    """Returns the local experts' outputs [N, D] to their sources: [C, D] routed output."""
    ...

  def rows_sent(self, expert_ids: jax.Array, chunks_run: jax.Array, chunk_size: int) -> jax.Array:
    """[] int32 (row, destination device) pairs sent in a call, this device's own included.

    Args: expert_ids [L, K] of all this device's rows; chunks_run [] chunks that ran; C.
    """
    ...


def received_rows(exchange: Exchange, chunk_size: int) -> int:
  """N, the rows a device receives per chunk: S·C for both schemes (all_gather's gathered
  chunk; all_to_all's static buffers, C from each source)."""
  return exchange.axis_size * chunk_size


def crosses_devices(exchange: Exchange) -> bool:
  """Whether the exchange moves rows between devices (an expert axis of 2 or more): only then
  has the chunk loop communication to overlap with compute."""
  return exchange.axis is not None and exchange.axis_size > 1


@dataclasses.dataclass(frozen=True)
class AllGather:
  """Every chunk row to every device of the axis; partial sums reduce-scattered back."""

  axis: tuple[str, ...] | None
  axis_size: int
  local_experts: int

  def send(self, rows, expert_ids, weights) -> Dispatched:
    # Ids this device does not hold (and E, padding) fall outside [0, El).
    local_ids = local_id(
      gather_rows(expert_ids, self.axis), axis_rank(self.axis), self.local_experts
    )
    return Dispatched(
      gather_rows(rows, self.axis), local_ids, gather_rows(weights, self.axis), route_back=()
    )

  def combine(self, expert_out, dispatched) -> jax.Array:
    return scatter_sum_rows(expert_out, self.axis)

  def rows_sent(self, expert_ids, chunks_run, chunk_size) -> jax.Array:
    return chunks_run * chunk_size * self.axis_size


class _RouteBack(NamedTuple):
  """`AllToAll`'s bookkeeping between `send` and `combine` (S = axis size, Q = pair slots).

  Attributes:
    choice_slot: [C, K] int32 pair slot of each choice (`PackedPairs.choice_slot`).
    send_sizes: [S] int32 pairs sent to each device.
    send_offsets: [S] int32 first pair slot of each device.
    recv_sizes: [S] int32 rows received from each device.
    return_offsets: [S] int32 where each source wants its returned rows (its send offset).
  """

  choice_slot: jax.Array
  send_sizes: jax.Array
  send_offsets: jax.Array
  recv_sizes: jax.Array
  return_offsets: jax.Array


def destination_devices(expert_ids: jax.Array, local_experts: int, axis_size: int) -> jax.Array:
  """[N, S] bool: which devices hold at least one of each row's chosen experts.

  Args:
    expert_ids: [N, K] physical ids; ids from P (zero-computation experts, padding) go to no
      device.
    local_experts: El, experts per device (device s holds [s*El, (s+1)*El)).
    axis_size: S.

  >>> destination_devices(jnp.array([[0, 1], [3, 0], [4, 4]]), 2, 2).tolist()
  [[True, False], [True, True], [False, False]]
  """
  device = owner_device(expert_ids, local_experts, axis_size)  # [N, K]
  rows = jnp.arange(expert_ids.shape[0])[:, None]
  hit = jnp.zeros((expert_ids.shape[0], axis_size + 1), bool).at[rows, device].set(True)
  return hit[:, :axis_size]


def distinct_destinations(expert_ids: jax.Array, local_experts: int, axis_size: int) -> jax.Array:
  """[N] int32: how many devices each row goes to (`destination_devices` summed, in O(N·K)).

  >>> distinct_destinations(jnp.array([[0, 1], [3, 0], [4, 4]]), 2, 2).tolist()
  [1, 2, 0]
  """
  device = jnp.sort(owner_device(expert_ids, local_experts, axis_size), axis=-1)  # [N, K]
  first = device[:, :1] < axis_size
  new = (device[:, 1:] != device[:, :-1]) & (device[:, 1:] < axis_size)
  return jnp.sum(first, axis=-1, dtype=jnp.int32) + jnp.sum(new, axis=-1, dtype=jnp.int32)


class PackedPairs(NamedTuple):
  """A chunk's (row, device) pairs packed by device (Q = C * min(K, S) slots).

  Attributes:
    pair_row: [Q] int32 chunk row of each slot; C for an empty slot.
    pair_device: [Q] int32 destination device of each slot; S for an empty slot.
    send_sizes: [S] int32 pairs for each device.
    send_offsets: [S] int32 first slot of each device's pairs (they are contiguous).
    choice_slot: [C, K] int32 slot of the pair that carries each choice; Q for padding and
      for a choice whose device an earlier choice of the row already took (each pair once).
  """

  pair_row: jax.Array
  pair_device: jax.Array
  send_sizes: jax.Array
  send_offsets: jax.Array
  choice_slot: jax.Array


def pack_pairs(expert_ids: jax.Array, local_experts: int, axis_size: int) -> PackedPairs:
  """Packs each row once per device holding one of its experts, devices in order.

  Args:
    expert_ids: [C, K] global ids (from E, zero-computation experts and padding: no device).
    local_experts: El.
    axis_size: S.

  >>> packed = pack_pairs(jnp.array([[0, 3], [2, 3], [4, 4]]), 2, 2)
  >>> packed.pair_row.tolist(), packed.pair_device.tolist(), packed.send_sizes.tolist()
  ([0, 0, 1, 3, 3, 3], [0, 1, 1, 2, 2, 2], [1, 2])
  >>> packed.choice_slot.tolist()
  [[0, 1], [2, 6], [6, 6]]
  """
  chunk_rows, top_k = expert_ids.shape
  slots = chunk_rows * min(top_k, axis_size)  # no row has more destinations
  goes_to = destination_devices(expert_ids, local_experts, axis_size)  # [C, S]
  send_sizes = jnp.sum(goes_to, axis=0, dtype=jnp.int32)  # [S]
  send_offsets = jnp.cumsum(send_sizes) - send_sizes
  rank_in_device = jnp.cumsum(goes_to, axis=0, dtype=jnp.int32) - 1  # [C, S]
  slot = jnp.where(goes_to, send_offsets[None, :] + rank_in_device, slots)  # [C, S]
  row_ids = jnp.repeat(jnp.arange(chunk_rows, dtype=jnp.int32), axis_size)
  device_ids = jnp.tile(jnp.arange(axis_size, dtype=jnp.int32), chunk_rows)
  flat_slot = slot.reshape(-1)
  pair_row = jnp.full(slots, chunk_rows, jnp.int32).at[flat_slot].set(row_ids, mode="drop")
  pair_device = jnp.full(slots, axis_size, jnp.int32).at[flat_slot].set(device_ids, mode="drop")
  # The slot of each choice's pair, kept for the first choice on each device only.
  device = owner_device(expert_ids, local_experts, axis_size)  # [C, K]
  earlier = jnp.tril(jnp.ones((top_k, top_k), bool), k=-1)  # [k, k']: k' < k
  repeated = jnp.any((device[:, :, None] == device[:, None, :]) & earlier[None], axis=-1)
  choice_slot = jnp.take_along_axis(slot, jnp.minimum(device, axis_size - 1), axis=1)
  choice_slot = jnp.where((device < axis_size) & ~repeated, choice_slot, slots)
  return PackedPairs(pair_row, pair_device, send_sizes, send_offsets, choice_slot)


@dataclasses.dataclass(frozen=True)
class AllToAll:
  """Dropless all-to-all: each (row, device) pair once, packed by destination.

  `ragged` sends with `jax.lax.ragged_all_to_all` (only the filled rows travel); otherwise
  the drop-in of `moejax.collectives` sends the static [S, C, ...] buffers. The packing and
  the offsets are the same code either way.
  """

  axis: tuple[str, ...] | None
  axis_size: int
  local_experts: int
  ragged: bool

  def _exchange(self, operand, output, offsets, sizes, out_offsets, out_sizes, chunk_rows):
    return ragged_all_to_all(
      operand,
      output,
      offsets,
      sizes,
      out_offsets,
      out_sizes,
      axis=self.axis,
      max_slice_rows=chunk_rows,
      ragged=self.ragged,
    )

  def send(self, rows, expert_ids, weights) -> Dispatched:
    chunk_rows = expert_ids.shape[0]
    devices, local_experts = self.axis_size, self.local_experts
    pairs = pack_pairs(expert_ids, local_experts, devices)
    pair_row, send_sizes, send_offsets = pairs.pair_row, pairs.send_sizes, pairs.send_offsets
    # Each pair carries the row and its choices on that device (others: id El, weight 0).
    row = jnp.minimum(pair_row, chunk_rows - 1)  # empty slots are never sent
    pair_ids = local_id(expert_ids[row], pairs.pair_device[:, None], local_experts)  # [Q, K]
    on_device = is_local(pair_ids, local_experts) & (pair_row < chunk_rows)[:, None]
    pair_ids = jnp.where(on_device, pair_ids, local_experts)
    pair_weights = jnp.where(on_device, weights[row], 0.0)
    # Sizes and offsets first (one small all-to-all), then the rows: source i's rows land
    # at [i*C, i*C + recv_sizes[i]) of this device's [S*C] buffers.
    received = swap_slices(jnp.stack([send_sizes, send_offsets], axis=-1), self.axis)  # [S, 2]
    recv_sizes, return_offsets = received[:, 0], received[:, 1]
    land_at = jnp.full(devices, axis_rank(self.axis) * chunk_rows, jnp.int32)
    send = functools.partial(
      self._exchange,
      offsets=send_offsets,
      sizes=send_sizes,
      out_offsets=land_at,
      out_sizes=recv_sizes,
      chunk_rows=chunk_rows,
    )
    buffer_rows = devices * chunk_rows
    pair_rows = rows[row]
    empty = lambda a, value: filled_like(a, (buffer_rows, *a.shape[1:]), value)
    return Dispatched(
      rows=send(pair_rows, empty(pair_rows, 0)),
      local_ids=send(pair_ids, empty(pair_ids, local_experts)),
      weights=send(pair_weights, empty(pair_weights, 0)),
      route_back=_RouteBack(
        pairs.choice_slot, send_sizes, send_offsets, recv_sizes, return_offsets
      ),
    )

  def combine(self, expert_out, dispatched) -> jax.Array:
    back: _RouteBack = dispatched.route_back
    chunk_rows, top_k = back.choice_slot.shape
    slots = chunk_rows * min(top_k, self.axis_size)
    returned = self._exchange(
      expert_out,
      filled_like(expert_out, (slots, *expert_out.shape[1:]), 0),
      jnp.arange(self.axis_size, dtype=jnp.int32) * chunk_rows,
      back.recv_sizes,
      back.return_offsets,
      back.send_sizes,
      chunk_rows,
    )  # [Q, D]: each pair's partial row, in this device's pair slots
    # Each row sums its pairs: a gather per choice (a scatter-add is slow on XLA:CPU).
    returned = jnp.concatenate([returned, jnp.zeros_like(returned[:1])]).astype(jnp.float32)
    return jnp.sum(returned[back.choice_slot], axis=1)  # [C, K, D] -> [C, D]

  def rows_sent(self, expert_ids, chunks_run, chunk_size) -> jax.Array:
    return jnp.sum(distinct_destinations(expert_ids, self.local_experts, self.axis_size))


# Platforms where a recorded multi-device run (`benchmarks/dispatch.py --timing`, recorded in
# docs/performance.md) showed all_to_all faster than all_gather, each with the smallest
# expert-axis size at which it was. Empty: no multi-device GPU or TPU run has been recorded,
# and fewer bytes alone do not make it faster (docs/performance.md, "Dispatch").
ALL_TO_ALL_FASTER_FROM_AXIS: dict[str, int] = {}


def resolve_dispatch(dispatch: str, axis_size: int, platform_name: str) -> str:
  """The scheme "auto" stands for: all_to_all only where `ALL_TO_ALL_FASTER_FROM_AXIS` records
  it faster on this platform at this expert-axis size, else all_gather.

  all_to_all sends at most min(K, S) copies of a row against all_gather's S, but XLA's GPU
  `ragged_all_to_all` syncs with the host on its offsets and issues one send per (slice,
  peer), so bytes do not decide it; a measurement does. On XLA:CPU the drop-in moves the same
  static buffers as all_gather plus a count exchange.

  >>> resolve_dispatch("auto", axis_size=8, platform_name="gpu")
  'all_gather'
  """
  return dispatch_choice(dispatch, axis_size, platform_name)[0]


def dispatch_choice(dispatch: Dispatch, axis_size: int, platform_name: str) -> tuple[Scheme, str]:
  """`resolve_dispatch`'s scheme and why, in words (what `moejax.plan_call` reports)."""
  if dispatch != "auto":
    return dispatch, f"config.dispatch={dispatch!r}"
  min_axis = ALL_TO_ALL_FASTER_FROM_AXIS.get(platform_name)
  if min_axis is None:
    return "all_gather", (
      f"dispatch='auto': no recorded run measured all_to_all faster on {platform_name} "
      "(ALL_TO_ALL_FASTER_FROM_AXIS)"
    )
  scheme = "all_to_all" if axis_size >= min_axis else "all_gather"
  return scheme, (
    f"dispatch='auto': ALL_TO_ALL_FASTER_FROM_AXIS records all_to_all faster on "
    f"{platform_name} from an expert axis of {min_axis}; this one has {axis_size}"
  )


def scheme_of(config: MoEConfig, axis_size: int) -> str:
  """The scheme a call of `config` on an expert axis of `axis_size` devices runs, on the
  platform deciding now (`kernels_pallas.platform.running_on`): resolved once per call and
  passed on (to the chunk budget and `make_exchange`)."""
  return resolve_dispatch(config.dispatch, axis_size, platform.platform())


def make_exchange(
  config: MoEConfig, axis: tuple[str, ...] | None, axis_size: int, scheme: Scheme
) -> Exchange:
  """The exchange of `scheme` ("all_gather" or "all_to_all": `scheme_of`) over the expert
  group `axis` of `axis_size` devices (None, 1: no mesh), over the config's physical experts
  (P = E + R; ids from P go to no device)."""
  local_experts = config.num_physical_experts // axis_size
  ragged = platform_has_ragged_all_to_all()
  if scheme == "all_gather":
    return AllGather(axis, axis_size, local_experts)
  return AllToAll(axis, axis_size, local_experts, ragged)
