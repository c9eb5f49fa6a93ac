"""Expert-parallel load balancing: where each expert's replicas live.

A `Placement` maps P = E + R physical expert slots (split over the expert axis, P / S per
device) to E logical experts (`moejax.expert_placement`); `place` moves weights to a placement and
`sum_replicas` folds replica gradients back (`moejax.replicas`). `rebalance` computes a
placement (host NumPy) from measured per-expert load with
DeepSeek's policy (deepseek-ai/EPLB, `rebalance_experts`), exactly: hierarchical when the
expert groups divide evenly over nodes (pack groups onto nodes, replicate within each node,
pack replicas onto devices), else the same with one group and one node.

>>> load = np.array([90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86])
>>> placement = rebalance(load, num_physical=16, num_devices=8, num_groups=4, num_nodes=2)
>>> placement.physical_to_logical.tolist()
[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]
>>> placement.replica_counts.tolist()
[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]
"""

from __future__ import annotations

import numpy as np

from moejax import id_spaces
from moejax.config import MoEConfig
from moejax.expert_placement import Placement, from_physical_to_logical, initial_placement
from moejax.params import MoEParams
from moejax.replicas import expert_axis_devices, place, sum_replicas
from moejax.stacking import layer_of, stack_layers

__all__ = [
  "Placement",
  "balanced_packing",
  "balancedness",
  "from_physical_to_logical",
  "initial_placement",
  "place",
  "rebalance",
  "rebalance_weights",
  "replicate_experts",
  "sum_replicas",
]


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
  """Packs n weighted items into `num_packs` packs of n / num_packs items each: heaviest first,
  each into the lightest pack that still has room (the lowest-numbered among equals).

  Args:
    weight: [X, n] item weights, per row independently.
    num_packs: packs per row; must divide n.

  Returns:
    (pack [X, n], rank_in_pack [X, n]) int64.
  """
  rows, items = weight.shape
  per_pack = items // num_packs
  if per_pack == 1:
    return np.tile(np.arange(items), (rows, 1)), np.zeros((rows, items), np.int64)
  pack = np.full((rows, items), -1, np.int64)
  rank = np.full((rows, items), -1, np.int64)
  for row in range(rows):
    pack_weight, pack_items = np.zeros(num_packs), np.zeros(num_packs, np.int64)
    for item in np.argsort(-weight[row], kind="stable"):
      open_packs = np.flatnonzero(pack_items < per_pack)
      chosen = open_packs[np.argmin(pack_weight[open_packs])]
      pack[row, item], rank[row, item] = chosen, pack_items[chosen]
      pack_weight[chosen] += weight[row, item]
      pack_items[chosen] += 1
  return pack, rank


def replicate_experts(weight: np.ndarray, num_physical: int):
  """Gives each of the P - E spare slots to the expert with the largest load per replica.

  Args:
    weight: [X, E] loads.
    num_physical: P >= E.

  Returns:
    (physical_to_logical [X, P], replica rank of each slot [X, P], replica counts [X, E]).
  """
  rows, experts = weight.shape
  physical = np.tile(np.arange(num_physical), (rows, 1))
  rank = np.zeros((rows, num_physical), np.int64)
  counts = np.ones((rows, experts), np.int64)
  every_row = np.arange(rows)
  for slot in range(experts, num_physical):
    busiest = np.argmax(weight / counts, axis=-1)  # the first among equals
    physical[:, slot] = busiest
    rank[:, slot] = counts[every_row, busiest]
    counts[every_row, busiest] += 1
  return physical, rank, counts


def _inverse(permutation: np.ndarray) -> np.ndarray:
  """The inverse of each row's permutation."""
  inverse = np.empty_like(permutation)
  np.put_along_axis(inverse, permutation, np.arange(permutation.shape[1])[None], axis=1)
  return inverse


def _hierarchical(weight, num_physical: int, num_groups: int, num_nodes: int, num_devices: int):
  """DeepSeek's hierarchical policy on [layers, E] loads: (physical_to_logical, rank, counts)."""
  layers, experts = weight.shape
  group_size = experts // num_groups
  groups_per_node = num_groups // num_nodes
  per_device = num_physical // num_devices
  # 1. Expert groups onto nodes; "mlog" numbers the experts node by node.
  group_load = weight.reshape(layers, num_groups, group_size).sum(-1)
  group_pack, group_rank = balanced_packing(group_load, num_nodes)
  first = (group_pack * groups_per_node + group_rank) * group_size  # [L, groups]
  log_to_mlog = (first[..., None] + np.arange(group_size)).reshape(layers, experts)
  mlog_to_log = _inverse(log_to_mlog)
  # 2. Replicas within each node.
  mlog_load = np.take_along_axis(weight, mlog_to_log, -1).reshape(-1, experts // num_nodes)
  phy_to_mlog, phy_rank, mlog_count = replicate_experts(mlog_load, num_physical // num_nodes)
  # 3. Replicas onto the node's devices, by load per replica.
  phy_load = np.take_along_axis(mlog_load / mlog_count, phy_to_mlog, -1)
  pack, rank_in_pack = balanced_packing(phy_load, num_devices // num_nodes)
  pphy_to_phy = _inverse(pack * per_device + rank_in_pack)
  pphy_to_mlog = np.take_along_axis(phy_to_mlog, pphy_to_phy, -1)
  node_offset = np.arange(0, experts, experts // num_nodes).reshape(1, -1, 1)
  pphy_to_mlog = (pphy_to_mlog.reshape(layers, num_nodes, -1) + node_offset).reshape(layers, -1)
  physical = np.take_along_axis(mlog_to_log, pphy_to_mlog, -1)
  rank = np.take_along_axis(phy_rank, pphy_to_phy, -1).reshape(layers, -1)
  counts = np.take_along_axis(mlog_count.reshape(layers, -1), log_to_mlog, -1)
  return physical, rank, counts


def rebalance(
  load: np.ndarray,
  *,
  num_physical: int,
  num_devices: int,
  num_groups: int = 1,
  num_nodes: int = 1,
) -> Placement:
  """A placement balancing `load` over devices: DeepSeek's EPLB policy, exactly.

  Args:
    load: [E] or [layers, E] measured load of each logical expert (per layer).
    num_physical: P, physical slots (E + redundant), a multiple of `num_devices`.
    num_devices: devices of the expert axis (a multiple of `num_nodes`).
    num_groups: expert groups (grouped routing); groups stay within a node when they divide
      evenly over the nodes.
    num_nodes: nodes (devices linked faster within a node).

  Returns:
    A `Placement`, with a leading L if `load` has one; replicas of an expert in rank order.

  Raises:
    ValueError: a size that does not divide as required.
  """
  load = np.asarray(load, np.float32)
  weight = load.reshape(-1, load.shape[-1])
  experts = weight.shape[-1]
  for name, value, divisor, of in (
    ("num_physical", num_physical, num_devices, "num_devices"),
    ("num_devices", num_devices, num_nodes, "num_nodes"),
    ("num_experts", experts, num_groups, "num_groups"),
  ):
    if value % divisor:
      raise ValueError(f"{name}={value} must be a multiple of {of}={divisor}")
  if num_physical < experts:
    raise ValueError(f"num_physical={num_physical} must be at least num_experts={experts}")
  if num_groups % num_nodes:
    num_groups, num_nodes = 1, 1  # the global policy
  physical, rank, counts = _hierarchical(weight, num_physical, num_groups, num_nodes, num_devices)
  width = num_physical - experts + 1
  to_physical = np.full((len(weight), experts * width), -1, np.int64)
  np.put_along_axis(to_physical, physical * width + rank, np.arange(num_physical)[None], axis=1)
  lead = load.shape[:-1]
  return Placement(
    physical.reshape(*lead, num_physical).astype(np.int32),
    to_physical.reshape(*lead, experts, width).astype(np.int32),
    counts.reshape(*lead, experts).astype(np.int32),
  )


def balancedness(physical_counts: np.ndarray, num_devices: int) -> float:
  """Mean over max of per-device load (vLLM's metric; 1.0 is perfect), slots split evenly.

  Args:
    physical_counts: [P] rows (or load) sent to each physical slot.
    num_devices: devices of the expert axis; P / num_devices slots each, in order.

  >>> balancedness(np.array([3, 1, 2, 2]), num_devices=2)
  1.0
  >>> balancedness(np.array([4, 2, 1, 1]), num_devices=2)
  0.666...
  """
  counts = np.asarray(physical_counts, np.float64)
  owner = id_spaces.owner_device(np.arange(counts.size), counts.size // num_devices, num_devices)
  per_device = np.bincount(owner, weights=counts, minlength=num_devices)
  peak = per_device.max()
  return float(per_device.mean() / peak) if peak > 0 else 1.0


def rebalance_weights(
  params: MoEParams, config: MoEConfig, *, current: Placement, load: np.ndarray
) -> tuple[MoEParams, Placement]:
  """`rebalance` for one node of the expert axis's devices, then `place`: new slots for the
  experts by their load, and the weights moved there (what `MoELayer.rebalance` and
  `moejax.linen.rebalance` run). A stack of layers (built by `nnx.vmap` or `nn.scan`) has a
  leading layer axis on every parameter, on `current`'s fields and on `load`: each layer is
  re-placed by its own load.

  Args:
    params: physical expert weights [P, ...] (or [layers, P, ...]) laid out by `current`, sharded
      over the config's expert axis (its size is the device count) or on one device.
    config: the layer's config (with `num_redundant_experts`).
    current: the placement `params` are laid out by.
    load: [E] (or [layers, E]) load of each logical expert.

  Returns:
    (the params with their expert weights moved, each array where it was; the new placement).

  Raises:
    ValueError: `load` is not [E] ([layers, E] for a stack), or what `rebalance` and `place`
      raise.
  """
  layers = np.shape(current.physical_to_logical)[:-1]
  if np.shape(load) != (*layers, config.num_experts):
    raise ValueError(
      f"load has shape {np.shape(load)}, expected {(*layers, config.num_experts)} "
      f"([{'layers, ' if layers else ''}E]: one load per logical expert"
      f"{' of each stacked layer' if layers else ''})"
    )
  new = rebalance(
    np.asarray(load),
    num_physical=config.num_physical_experts,
    num_devices=expert_axis_devices(params, config),
  )
  if not layers:
    return place(params, new, config, current=current), new
  moved = [
    place(layer_of(params, i), layer_of(new, i), config, current=layer_of(current, i))
    for i in range(layers[0])
  ]
  return stack_layers(moved, like=params), new
