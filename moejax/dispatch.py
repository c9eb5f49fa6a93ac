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
  With a receive capacity (`moejax.capacity`) they are smaller, each source's rows packed
  after the previous source's, and a chunk that would overflow any device sends nothing
  (`Dispatched.overflow`): the caller runs it again in sub-chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from kernels_pallas import platform
from moejax.capacity import capacity_rows
from moejax.chunking import chunk_order
from moejax.collectives import (
  axis_rank,
  filled_like,
  gather_rows,
  platform_has_ragged_all_to_all,
  ragged_all_to_all,
  scatter_sum_rows,
  swap_slices,
  varying_like,
)
from moejax.config import Dispatch, MoEConfig, Scheme
from moejax.fp8_exchange import moved_in_fp8
from moejax.id_spaces import is_local, local_id, owner_device


class Dispatched(NamedTuple):
  """What a device received for one chunk: N rows (`received_rows`) and, per row, its K local
  choices.

  Attributes:
    rows: [N, D] received rows in the compute dtype (unfilled rows hold zeros).
    local_ids: [N, K] int32 local expert ids; ids outside [0, El) compute nothing.
    weights: [N, K] float32 combine weights (0 where the id is not local).
    route_back: scheme-specific arrays `combine` needs to return the results.
    overflow: with a receive capacity, [] bool, the same on every device of the group: some
      device would have received more than its capacity, and nothing was sent; else None.
  """

  rows: jax.Array
  local_ids: jax.Array
  weights: jax.Array
  route_back: Any
  overflow: jax.Array | None = None


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

  def overflows(
    self, expert_ids: jax.Array, token_mask: jax.Array, chunk_size: int
  ) -> tuple[jax.Array, jax.Array]:
    """([] int32 chunks that overflowed some device's receive capacity and ran in sub-chunks,
    [] int32 rows this device would have received past its capacity in them); zeros without
    a capacity.

    Args: expert_ids [L, K] and token_mask [L] of all this device's rows; C.
    """
    ...


def crosses_devices(exchange: Exchange) -> bool:
  """Whether the exchange moves rows between devices (an expert axis of 2 or more): only then
  has the chunk loop communication to overlap with compute."""
  return exchange.axis is not None and exchange.axis_size > 1


@dataclasses.dataclass(frozen=True)
class AllGather:
  """Every chunk row to every device of the axis; partial sums reduce-scattered back. With
  `fp8`, the rows travel as fp8 values and scales (`moejax.fp8_exchange`)."""

  axis: tuple[str, ...] | None
  axis_size: int
  local_experts: int
  fp8: bool = False

  def send(self, rows, expert_ids, weights) -> Dispatched:
    # Ids this device does not hold (and E, padding) fall outside [0, El).
    local_ids = local_id(
      gather_rows(expert_ids, self.axis), axis_rank(self.axis), self.local_experts
    )
    gather = functools.partial(gather_rows, axis=self.axis)
    received = moved_in_fp8(gather, rows) if self.fp8 else gather(rows)
    return Dispatched(received, local_ids, gather_rows(weights, self.axis), route_back=())

  def combine(self, expert_out, dispatched) -> jax.Array:
    return scatter_sum_rows(expert_out, self.axis)

  def rows_sent(self, expert_ids, chunks_run, chunk_size) -> jax.Array:
    return chunks_run * chunk_size * self.axis_size

  def overflows(self, expert_ids, token_mask, chunk_size) -> tuple[jax.Array, jax.Array]:
    return no_overflow(token_mask)


class _RouteBack(NamedTuple):
  """`AllToAll`'s bookkeeping between `send` and `combine` (S = axis size, Q = pair slots).

  Attributes:
    choice_slot: [C, K] int32 pair slot of each choice (`PackedPairs.choice_slot`).
    send_sizes: [S] int32 pairs sent to each device.
    send_offsets: [S] int32 first pair slot of each device.
    recv_sizes: [S] int32 rows received from each device.
    recv_offsets: [S] int32 where each source's rows start in this device's buffers.
    return_offsets: [S] int32 where each source wants its returned rows (its send offset).
  """

  choice_slot: jax.Array
  send_sizes: jax.Array
  send_offsets: jax.Array
  recv_sizes: jax.Array
  recv_offsets: jax.Array
  return_offsets: jax.Array


class _Placement(NamedTuple):
  """Where a chunk's rows go in `AllToAll`'s receive buffers (S = axis size).

  Attributes:
    buffer_rows: N, the buffers' static rows.
    land_at: [S] int32 where this device's rows start in each destination's buffers.
    recv_sizes, recv_offsets, return_offsets: as `_RouteBack`'s.
    overflow: [] bool (same on every device) with a capacity, else None.
  """

  buffer_rows: int
  land_at: jax.Array
  recv_sizes: jax.Array
  recv_offsets: jax.Array
  return_offsets: jax.Array
  overflow: jax.Array | None


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
  the offsets are the same code either way. `capacity_factor`: None (buffers of S·C rows,
  source i's at i·C), or the receive capacity's factor (`moejax.capacity`: fewer rows, the
  sources' packed in order). With `fp8`, the rows travel as fp8 values and scales
  (`moejax.fp8_exchange`).
  """

  axis: tuple[str, ...] | None
  axis_size: int
  local_experts: int
  ragged: bool
  capacity_factor: float | None = None
  fp8: bool = False

  def capacity(self, chunk_rows: int, top_k: int) -> int:
    """N, the rows of this exchange's receive buffers for chunks of C = `chunk_rows` rows."""
    if self.capacity_factor is None:
      return self.axis_size * chunk_rows
    return capacity_rows(self.capacity_factor, chunk_rows, top_k, self.axis_size)

  def without_capacity(self) -> AllToAll:
    """This exchange with worst-case buffers (what an overflowed chunk's sub-chunks run)."""
    return dataclasses.replace(self, capacity_factor=None)

  def _placement(self, send_sizes, send_offsets, chunk_rows, top_k) -> _Placement:
    """Where this chunk's rows land: source i at i·C without a capacity (one small all-to-all
    of sizes and offsets); with one, packed in source order, from the [S, S] matrix of every
    device's send sizes (one small all-gather), which also tells every device alike whether
    any would overflow."""
    devices, rank = self.axis_size, axis_rank(self.axis)
    per_device = lambda a: varying_like(a, send_sizes)  # as the chunk's other values
    if self.capacity_factor is None:
      received = swap_slices(jnp.stack([send_sizes, send_offsets], axis=-1), self.axis)
      return _Placement(
        buffer_rows=devices * chunk_rows,
        land_at=jnp.full(devices, rank * chunk_rows, jnp.int32),
        recv_sizes=received[:, 0],
        recv_offsets=per_device(jnp.arange(devices, dtype=jnp.int32) * chunk_rows),
        return_offsets=received[:, 1],
        overflow=None,
      )
    sizes = gather_rows(send_sizes[None], self.axis)  # [source, destination]
    landing = jnp.cumsum(sizes, axis=0) - sizes  # where each source starts at each destination
    sending = jnp.cumsum(sizes, axis=1) - sizes  # each source's send offset for each one
    capacity = self.capacity(chunk_rows, top_k)
    return _Placement(
      buffer_rows=capacity,
      land_at=landing[rank],
      recv_sizes=per_device(sizes[:, rank]),
      recv_offsets=per_device(landing[:, rank]),
      return_offsets=per_device(sending[:, rank]),
      overflow=per_device(jnp.any(jnp.sum(sizes, axis=0) > capacity)),
    )

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
    # Sizes and offsets first, then the rows, each source's where `_placement` says.
    place = self._placement(send_sizes, send_offsets, chunk_rows, expert_ids.shape[1])
    send = functools.partial(
      self._exchange,
      offsets=send_offsets,
      sizes=send_sizes,
      out_offsets=place.land_at,
      out_sizes=place.recv_sizes,
      chunk_rows=chunk_rows,
    )
    pair_rows = rows[row]
    empty = lambda a, value: filled_like(a, (place.buffer_rows, *a.shape[1:]), value)
    operands = ((pair_rows, 0), (pair_ids, local_experts), (pair_weights, 0))

    def send_all():
      ids_and_weights = tuple(send(a, empty(a, value)) for a, value in operands[1:])
      if not self.fp8:
        return (send(pair_rows, empty(pair_rows, 0)), *ids_and_weights)
      move = functools.partial(
        _send_rows, self, buffer_rows=place.buffer_rows, chunk_rows=chunk_rows
      )
      indices = (send_offsets, send_sizes, place.land_at, place.recv_sizes)
      return (moved_in_fp8(move, pair_rows, *indices), *ids_and_weights)

    if place.overflow is None:
      received = send_all()
    else:  # an overflowing chunk sends nothing (the same choice on every device)
      received = jax.lax.cond(
        place.overflow, lambda: tuple(empty(a, value) for a, value in operands), send_all
      )
    return Dispatched(
      *received,
      route_back=_RouteBack(
        pairs.choice_slot,
        send_sizes,
        send_offsets,
        place.recv_sizes,
        place.recv_offsets,
        place.return_offsets,
      ),
      overflow=place.overflow,
    )

  def combine(self, expert_out, dispatched) -> jax.Array:
    back: _RouteBack = dispatched.route_back
    chunk_rows, top_k = back.choice_slot.shape
    slots = chunk_rows * min(top_k, self.axis_size)
    returned = self._exchange(
      expert_out,
      filled_like(expert_out, (slots, *expert_out.shape[1:]), 0),
      back.recv_offsets,
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

  def overflows(self, expert_ids, token_mask, chunk_size) -> tuple[jax.Array, jax.Array]:
    if self.capacity_factor is None:
      return no_overflow(token_mask)
    # The chunk loop's chunks: their rows' destinations, from every device, summed per device.
    chunk_ids = expert_ids[chunk_order(token_mask, chunk_size)]  # [chunks, C, K]
    goes_to = jax.vmap(destination_devices, in_axes=(0, None, None))(
      chunk_ids, self.local_experts, self.axis_size
    )  # [chunks, C, S]
    sizes = jnp.sum(goes_to, axis=1, dtype=jnp.int32)  # [chunks, S]
    received = jnp.sum(gather_rows(sizes[None], self.axis), axis=0)  # [chunks, S]
    capacity = self.capacity(chunk_size, expert_ids.shape[1])
    overflowed = jnp.any(received > capacity, axis=1)
    past = jnp.maximum(received[:, axis_rank(self.axis)] - capacity, 0)
    return (
      jnp.sum(overflowed, dtype=jnp.int32),
      jnp.sum(jnp.where(overflowed, past, 0), dtype=jnp.int32),
    )


def _send_rows(
  exchange: AllToAll, rows, offsets, sizes, land_at, recv_sizes, *, buffer_rows, chunk_rows
):
  """`AllToAll.send`'s move of [Q, W] rows into [buffer_rows, W] receive buffers, for any
  dtype and width (`moejax.fp8_exchange.Move`)."""
  output = filled_like(rows, (buffer_rows, *rows.shape[1:]), 0)
  return exchange._exchange(rows, output, offsets, sizes, land_at, recv_sizes, chunk_rows)


def no_overflow(like: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`Exchange.overflows` without a capacity: no chunk, no row (per-device like `like`)."""
  zero = filled_like(like, (), 0, jnp.int32)
  return zero, zero


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
  fp8 = config.dispatch_quant == "fp8"
  if fp8 and axis_size == 1:
    warnings.warn(
      "dispatch_quant='fp8' quantizes the rows an expert axis exchanges; this call's expert "
      "axis has one device, nothing is exchanged: the rows stay as they are",
      stacklevel=2,
    )
    fp8 = False
  if scheme == "all_gather":
    return AllGather(axis, axis_size, local_experts, fp8)
  return AllToAll(axis, axis_size, local_experts, ragged, config.receive_capacity_factor, fp8)
