"""Axis groups: the mesh axes a layer treats as one data axis or one expert axis.

`MoEConfig.data_axis` and `.expert_axis` each name one mesh axis or a tuple of them (a group).
Tokens are split over every axis of both groups, experts over the expert group, and the
expert-axis exchange runs over the whole expert group: a group of axes (a, b) acts as one
axis of size |a|·|b|, its devices ordered a-major (as `PartitionSpec(("a", "b"))` and
`jax.lax.axis_index(("a", "b"))` order them).

An attention tensor-parallel axis that leaves its outputs replicated joins the expert group
(vLLM's sequence-parallel MoE: each tensor rank takes its share of the tokens), so that every
token is computed once.

>>> names(("expert", "tensor")), names("data")
(('expert', 'tensor'), ('data',))
>>> spec_entry(("expert",)), spec_entry(("expert", "tensor"))
('expert', ('expert', 'tensor'))
"""

from __future__ import annotations

import math

from jax.sharding import Mesh

AxisGroup = str | tuple[str, ...]


def names(group: AxisGroup) -> tuple[str, ...]:
  """The mesh axis names of a group, in order."""
  return (group,) if isinstance(group, str) else tuple(group)


def check_group(field: str, group: AxisGroup) -> None:
  """Raises ValueError unless `group` is a non-empty str or a non-empty tuple of distinct,
  non-empty strs; `field` names it in the message."""
  axes = (group,) if isinstance(group, str) else group
  if (
    not isinstance(axes, tuple)
    or not axes
    or not all(isinstance(axis, str) and axis for axis in axes)
  ):
    raise ValueError(f"{field} must be a mesh axis name or a tuple of names, got {group!r}")
  repeated = sorted({axis for axis in axes if axes.count(axis) > 1})
  if repeated:
    raise ValueError(f"{field}={group!r} names mesh axis {repeated[0]!r} more than once")


def spec_entry(axes: tuple[str, ...]) -> str | tuple[str, ...]:
  """The `PartitionSpec` entry splitting one dimension over `axes`: the name itself for one
  axis (so that specs equal those written by hand, and so do jit signatures)."""
  return axes[0] if len(axes) == 1 else axes


def size(mesh: Mesh | None, group: AxisGroup) -> int:
  """Devices in the group on `mesh` (the product of its axes' sizes); 1 without a mesh."""
  return 1 if mesh is None else math.prod(mesh.shape[axis] for axis in names(group))
