"""Moving expert weights between placements, and folding replica gradients back to experts.

`place` lays expert weights out by a `Placement`: from logical [E, ...] weights (a gather), or
from physical [P, ...] weights laid out by another placement. Under a mesh the second is one
jitted program over the expert axis whose plan is data (one executable for every pair of
placements): each new slot takes its expert from a slot of its own device when one holds it,
and only the other slots travel, one `ragged_all_to_all` per ring shift (only the requested
rows are sent where the platform has it; XLA:CPU sends the static buffers of the drop-in).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.quantized import is_block_scaled
from moejax import axis_groups, id_spaces, meshes
from moejax.axis_groups import spec_entry
from moejax.call_record import call_record
from moejax.collectives import filled_like, platform_has_ragged_all_to_all, ragged_all_to_all
from moejax.config import MoEConfig
from moejax.expert_placement import Placement, check_values
from moejax.inputs import check_placement
from moejax.params import PER_EXPERT_FIELDS, MoEParams


class MovePlan(NamedTuple):
  """How physical weights move to a new placement over S expert-axis devices (Pl = P / S
  slots each), one ring shift k = 1 .. S-1 at a time: device d sends to device (d + k) mod S.
  Host NumPy int32, leading axis the device.

  Attributes:
    local_source: [S, Pl] the old local slot each new slot copies, when its device holds the
      expert (else 0, overwritten by a shift).
    send_rows: [S, S-1, Pl] at shift k, the old local slots sent, packed (then 0s).
    send_counts: [S, S-1] rows sent at each shift.
    recv_counts: [S, S-1] rows received at each shift.
    recv_row: [S, S-1, Pl] at shift k, the received row each new slot takes, or -1.
  """

  local_source: np.ndarray
  send_rows: np.ndarray
  send_counts: np.ndarray
  recv_counts: np.ndarray
  recv_row: np.ndarray

  @property
  def rows_moved(self) -> int:
    """Rows (whole experts) sent between devices."""
    return int(self.send_counts.sum())


def move_plan(new: np.ndarray, old: np.ndarray, devices: int) -> MovePlan:
  """The moves from physical layout `old` [P] to `new` [P] (slot -> logical expert).

  Each new slot copies, in order of preference: the same slot, if it already holds the
  expert; another slot of its device holding it; the first slot holding it elsewhere, sent
  once per (source slot, destination device).

  >>> plan = move_plan(np.array([0, 1, 1, 2]), np.array([0, 1, 2, 0]), devices=2)
  >>> plan.local_source.tolist(), plan.rows_moved  # slot 2 needs expert 1 from device 0
  ([[0, 1], [0, 0]], 1)
  """
  per = len(new) // devices
  shifts = max(devices - 1, 1)
  local_source = np.zeros((devices, per), np.int64)
  send_rows = np.zeros((devices, shifts, per), np.int64)
  send_counts = np.zeros((devices, shifts), np.int64)
  recv_row = np.full((devices, shifts, per), -1, np.int64)
  sent = {}  # (source slot, destination device) -> row in that shift's buffer
  owner = lambda slots: id_spaces.owner_device(slots, per, devices)
  for slot, expert in enumerate(new):
    device, holders = owner(slot), np.flatnonzero(old == expert)
    here = holders[owner(holders) == device]
    at = id_spaces.local_id(slot, device, per)
    if old[slot] == expert:
      local_source[device, at] = at
    elif here.size:
      local_source[device, at] = id_spaces.local_id(here[0], device, per)
    else:
      source = holders[0]
      source_device = owner(source)
      shift = (device - source_device) % devices - 1
      if (source, device) not in sent:
        sent[source, device] = send_counts[source_device, shift]
        source_at = id_spaces.local_id(source, source_device, per)
        send_rows[source_device, shift, send_counts[source_device, shift]] = source_at
        send_counts[source_device, shift] += 1
      recv_row[device, shift, at] = sent[source, device]
  # Device d receives at shift k what device d - k sent at shift k.
  recv_counts = np.stack(
    [send_counts[(np.arange(devices) - k - 1) % devices, k] for k in range(shifts)], axis=1
  )
  as32 = lambda a: a.astype(np.int32)
  return MovePlan(*map(as32, (local_source, send_rows, send_counts, recv_counts, recv_row)))


def place(
  params: MoEParams,
  placement: Placement,
  config: MoEConfig,
  *,
  current: Placement | None = None,
) -> MoEParams:
  """The expert parameters laid out by `placement` (the others unchanged).

  Args:
    params: logical expert weights [E, ...] (`current=None`), or physical ones [P, ...] laid
      out by `current`. Sharded over the config's expert axis, the result is too.
    placement: the new layout (values checked on the host).
    config: the layer's config (with `num_redundant_experts`).
    current: the placement `params` are laid out by, or None for logical weights.

  Returns:
    `MoEParams` whose expert parameters are [P, ...]: slot p holds expert
    `placement.physical_to_logical[p]`.

  Raises:
    ValueError: a placement whose values are not one valid map for the config, or expert
      parameters whose leading size is not E (logical) or P (physical).
  """
  record = call_record(config)
  check_placement(placement, record)
  new = check_values(placement, config)
  experts = _expert_leaves(params)
  if current is None:
    _check_leading(experts, config.num_experts, "E (logical weights, current=None)")
    moved = _gather(experts, new.physical_to_logical, _mesh_of(experts, config), config)
  else:
    check_placement(current, record)
    old = check_values(current, config)
    _check_leading(experts, config.num_physical_experts, "P = E + R (laid out by current)")
    mesh = _mesh_of(experts, config)
    devices = axis_groups.size(mesh, config.expert_axis)
    if devices == 1:
      source = [_first_slot(old.physical_to_logical, e) for e in new.physical_to_logical]
      moved = _gather(experts, np.array(source), mesh, config)
    else:
      plan = move_plan(new.physical_to_logical, old.physical_to_logical, devices)
      moved = _move(experts, plan, mesh=mesh, config=config)
  return params._replace(**moved)


def sum_replicas(grads: MoEParams, placement: Placement) -> MoEParams:
  """Gradients of physical expert parameters [P, ...] summed per logical expert [E, ...]:
  the gradients of the logical weights that `place` replicated, adapters included (the
  others unchanged; quantized weights, constants, have none: None)."""
  experts = np.shape(placement.replica_counts)[-1]
  segments = np.asarray(placement.physical_to_logical)
  per_expert = lambda g: jax.ops.segment_sum(g, segments, num_segments=experts)

  def summed(g: jax.Array) -> jax.Array:
    if not meshes.explicitly_sharded(g):
      return per_expert(g)
    # Slots split over an explicit axis: the sums, replicated, placed by the compiler.
    whole = NamedSharding(jax.typeof(g).sharding.mesh, P())
    return jax.sharding.auto_axes(per_expert, out_sharding=whole)(g)

  return grads._replace(
    **{
      name: None if is_block_scaled(value) else jax.tree.map(summed, value)
      for name, value in _expert_leaves(grads).items()
    }
  )


def _expert_leaves(params: MoEParams) -> dict:
  """The per-expert parameters present (arrays, `BlockScaled`s, adapters), by name."""
  present = (name for name in PER_EXPERT_FIELDS if getattr(params, name) is not None)
  return {name: getattr(params, name) for name in present}


def _check_leading(experts: dict, size: int, what: str) -> None:
  for name, value in experts.items():
    for leaf in jax.tree.leaves(value):
      if np.shape(leaf)[0] != size:
        raise ValueError(f"params.{name} has leading size {np.shape(leaf)[0]}, expected {what}")


def _first_slot(physical_to_logical: np.ndarray, expert: int) -> int:
  return int(np.flatnonzero(physical_to_logical == expert)[0])


def expert_axis_devices(params: MoEParams, config: MoEConfig) -> int:
  """Devices of the config's expert axis on the mesh the expert weights are sharded on; 1
  for weights on one device."""
  return axis_groups.size(_mesh_of(_expert_leaves(params), config), config.expert_axis)


def _mesh_of(experts: dict[str, jax.Array], config: MoEConfig) -> Mesh | None:
  """The mesh the expert weights are sharded on, if it has the config's expert axes."""
  found = getattr(jax.tree.leaves(experts["w_gate_up"])[0], "sharding", None)
  if isinstance(found, NamedSharding) and set(config.expert_axes) <= set(found.mesh.axis_names):
    return found.mesh
  return None


def _gather(experts, source: np.ndarray, mesh: Mesh | None, config: MoEConfig):
  """experts[name][source] for each leaf: one jitted gather, laid out as the layer's."""
  take = lambda leaves, index: jax.tree.map(lambda leaf: leaf[index], leaves)
  if mesh is None:
    return jax.jit(take)(experts, jnp.asarray(source))
  specs = _expert_specs(experts, config)
  if meshes.is_explicit(mesh):
    gather = meshes.with_auto_axes(lambda _, leaves, index: take(leaves, index), mesh, specs)
    return jax.jit(gather)(experts, jnp.asarray(source))
  out = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)
  return jax.jit(take, out_shardings=out)(experts, jnp.asarray(source))


def _expert_specs(experts: dict[str, jax.Array], config: MoEConfig) -> dict:
  """The layer's spec of each leaf of each per-expert parameter
  (`sharding.LayerSpecs.expert_leaf`, written out to the leaf's rank)."""
  specs = call_record(config).specs
  return jax.tree.map(lambda leaf: specs.expert_leaf(np.ndim(leaf)), experts)


def _is_spec(node) -> bool:
  return isinstance(node, P)


def _move(experts, plan: MovePlan, *, mesh: Mesh, config: MoEConfig):
  """Runs `plan` on weights sharded over the expert axis: every leaf (a `BlockScaled`'s
  values and scales alike), one program."""
  leaves, structure = jax.tree.flatten(experts)
  moved = _move_leaves(dict(enumerate(leaves)), plan, mesh=mesh, config=config)
  return jax.tree.unflatten(structure, [moved[i] for i in range(len(leaves))])


def _move_leaves(experts, plan: MovePlan, *, mesh: Mesh, config: MoEConfig):
  """`_move` on a dict of arrays."""
  with meshes.running_on(mesh):  # its exchange: the mesh's platform's
    return _move_on_mesh(experts, plan, mesh=mesh, config=config)


def _move_on_mesh(experts, plan: MovePlan, *, mesh: Mesh, config: MoEConfig):
  specs, axis = _expert_specs(experts, config), config.expert_axes
  body = functools.partial(_move_local, axis=axis, devices=axis_groups.size(mesh, axis))
  per_device = P(spec_entry(axis))  # a row of the plan each expert-group device
  moved = lambda on_mesh, leaves, plan: jax.shard_map(
    body,
    mesh=on_mesh,
    in_specs=(specs, MovePlan(*[per_device] * len(MovePlan._fields))),
    out_specs=specs,
  )(leaves, plan)
  if meshes.is_explicit(mesh):
    return jax.jit(meshes.with_auto_axes(moved, mesh, specs))(experts, plan)
  out = {name: NamedSharding(mesh, spec) for name, spec in specs.items()}
  return jax.jit(functools.partial(moved, mesh), out_shardings=out)(experts, plan)


def _move_local(experts, plan: MovePlan, *, axis: tuple[str, ...], devices: int):
  """One device's part of `_move`: its Pl new slots from its old ones and what arrives."""
  plan = MovePlan(*(field[0] for field in plan))  # this device's row
  rank = jax.lax.axis_index(axis)
  zeros = jnp.zeros((devices,), jnp.int32)
  out = {}
  for name, old in experts.items():
    new = old[plan.local_source]
    for k in range(devices - 1):  # shift k + 1: send to rank + k + 1, receive from rank - k - 1
      packed = old[plan.send_rows[k]]  # [Pl, ...]
      received = ragged_all_to_all(
        packed,
        filled_like(packed, packed.shape, 0),
        zeros,
        zeros.at[(rank + k + 1) % devices].set(plan.send_counts[k]),
        zeros,
        zeros.at[(rank - k - 1) % devices].set(plan.recv_counts[k]),
        axis=axis,
        max_slice_rows=packed.shape[0],
        ragged=platform_has_ragged_all_to_all(),
      )
      takes = plan.recv_row[k]
      keep = (takes >= 0).reshape(-1, *[1] * (old.ndim - 1))
      new = jnp.where(keep, received[jnp.maximum(takes, 0)], new)
    out[name] = new
  return out
