"""Meshes and where arrays live on them, for explicit and automatic axes alike: helpers that
know nothing of the layer (`moejax.sharding` has the layer's specs)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import platform
from moejax import axis_groups


def named_sharding(mesh: Mesh, spec: P | None) -> NamedSharding:
  """`spec` on `mesh`; replicated where a variable has no sharding metadata (`spec` None)."""
  return NamedSharding(mesh, P() if spec is None else spec)


def ambient() -> Mesh | AbstractMesh | None:
  """The mesh `jax.set_mesh` (or `jax.sharding.use_abstract_mesh`) made current, or None.

  Outside a trace it is the concrete `Mesh`; inside `jax.jit` JAX shows only its
  `AbstractMesh`, which the layer runs on as well. A mesh of one device is no mesh (so is one
  with manual axes: inside a `shard_map` the layer runs on what the caller's body holds).
  """
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # inside a trace: only the abstract mesh is visible
    mesh = None
  if mesh is None or mesh.empty:
    mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or math.prod(mesh.shape.values()) == 1 or mesh.manual_axes:
    return None
  return mesh


def of_call(mesh: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh | None:
  """The mesh a call runs on: `mesh`, else the ambient one (`ambient`), else None (one device).

  Raises:
    ValueError: `mesh` and the ambient mesh differ in axes, sizes or devices.
  """
  current = ambient()
  if mesh is None or current is None:
    return mesh if mesh is not None else current
  same_shape = dict(mesh.shape) == dict(current.shape)
  both_concrete = isinstance(mesh, Mesh) and isinstance(current, Mesh)
  if not same_shape or (both_concrete and mesh.device_ids.tolist() != current.device_ids.tolist()):
    raise ValueError(
      f"mesh={_describe(mesh)} differs from the ambient mesh {_describe(current)} (set by "
      "jax.set_mesh): pass that mesh, or leave mesh= out to use the ambient one"
    )
  return mesh


def _describe(mesh: Mesh | AbstractMesh) -> str:
  devices = f", devices {mesh.device_ids.tolist()}" if isinstance(mesh, Mesh) else ""
  return f"({dict(mesh.shape)}{devices})"


def running_on(mesh: Mesh | AbstractMesh | None):
  """Makes the device-dependent decisions inside (`kernels_pallas.platform`) for the devices a
  call on `mesh` runs on (None: the default device), not the process's default device."""
  if isinstance(mesh, AbstractMesh):
    return platform.running_on(mesh.abstract_device)
  return platform.running_on(None if mesh is None else mesh.devices.flat[0])


def is_explicit(mesh: Mesh) -> bool:
  """Whether any mesh axis uses explicit sharding (the default of `jax.make_mesh`)."""
  return any(axis_type == AxisType.Explicit for axis_type in mesh.axis_types)


def explicitly_sharded(x) -> bool:
  """Whether x's type says it is split over an explicit mesh axis."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not mesh.axis_names:
    return False
  kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  used = [name for entry in sharding.spec if entry for name in axis_groups.names(entry)]
  return any(kinds[name] == AxisType.Explicit for name in used)


def rows_sharded_like(index: jax.Array) -> NamedSharding | None:
  """The layout of a gather `table[index]` (rows of a table [N, D]) split as `index` is over
  explicit mesh axes, the row dimension whole; None (the compiler's choice) for an index not
  split over an explicit axis. Explicit sharding asks a gather for its output's layout."""
  if not explicitly_sharded(index):
    return None
  layout = jax.typeof(index).sharding
  return NamedSharding(layout.mesh, P(*layout.spec, None))


def on_mesh_of(x: jax.Array, reference: jax.Array) -> jax.Array:
  """x, laid out as it is, on the mesh `reference` is on: for eager code combining arrays of
  the same devices under different meshes (an adapter created on one device and trained under
  `jax.jit` comes back on the compiler's automatic mesh, its base weights sit on an explicit
  one). Traced values, and arrays not both on a mesh, as they are."""
  if any(isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array) for a in (x, reference)):
    return x
  layouts = (x.sharding, reference.sharding)
  if not all(isinstance(layout, NamedSharding) for layout in layouts):
    return x
  if layouts[0].mesh == layouts[1].mesh:
    return x
  return jax.device_put(x, NamedSharding(layouts[1].mesh, layouts[0].spec))


def placed_explicitly(x: Any, mesh: Mesh | AbstractMesh) -> Any:
  """An array as an argument of `with_auto_axes`' function on the explicit `mesh`: one on no
  mesh (made outside it) placed whole, and its cotangent resharded back to its own layout
  (`jax.sharding.auto_axes` can return an input's cotangent typed for its automatic mesh,
  which the caller's explicit code cannot add to anything: "Mesh for all inputs should be
  equal"). Anything but an array as it is."""
  if not isinstance(x, jax.Array):
    return x
  if jax.typeof(x).sharding.mesh.empty:
    x = jax.reshard(x, NamedSharding(mesh, P()))
  return _cotangent_resharded(x, jax.typeof(x).sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cotangent_resharded(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  return x


def _cotangent_resharded_fwd(x, sharding):
  return x, None


def _cotangent_resharded_bwd(sharding, _, cotangent):
  return (jax.reshard(cotangent, sharding),)


_cotangent_resharded.defvjp(_cotangent_resharded_fwd, _cotangent_resharded_bwd)


def gathered(tree: Any) -> Any:
  """`tree` with every leaf split over an explicit mesh axis made whole (replicated on its
  mesh), the others as they are: for code that computes on whole arrays (the reference)."""

  def whole(leaf):
    if leaf is None or not explicitly_sharded(leaf):
      return leaf
    return jax.reshard(leaf, NamedSharding(jax.typeof(leaf).sharding.mesh, P()))

  return jax.tree.map(whole, tree)


def with_auto_axes(fn: Callable, mesh: Mesh | AbstractMesh, out_specs: Any) -> Callable:
  """`fn(auto_mesh, *args)` run on an explicit-axes mesh, its axes automatic inside.

  The layer reshapes and pads token arrays whose sharding explicit mode would make part of
  their type; inside `jax.sharding.auto_axes` XLA places them. `fn` gets the same devices
  with every axis automatic; its outputs come back laid out as `out_specs` on `mesh`.
  """
  auto = (AxisType.Auto,) * len(mesh.axis_names)
  if isinstance(mesh, AbstractMesh):  # the ambient mesh inside a trace
    auto_mesh = mesh.update_axis_types(dict(zip(mesh.axis_names, auto, strict=True)))
  else:
    auto_mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
  out_sharding = jax.tree.map(
    lambda spec: NamedSharding(mesh, spec), out_specs, is_leaf=lambda s: isinstance(s, P)
  )
  return jax.sharding.auto_axes(functools.partial(fn, auto_mesh), out_sharding=out_sharding)


def constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
  """Lays `x` out as `spec` on `mesh`, for explicit and automatic meshes alike."""
  sharding = NamedSharding(mesh, spec)
  if is_explicit(mesh):
    return jax.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def expert_and_token_axes(
  mesh: Mesh | AbstractMesh | None, expert_axis: str
) -> tuple[str, str | tuple[str, ...]]:
  """(expert group, data group) of a framework's mesh: its `expert_axis` (without one, an
  axis of size 1), every other axis splitting the tokens; without a mesh, ("expert", "data").

  Raises:
    ValueError: a mesh without `expert_axis` or an axis of size 1 to stand for it, or
      without a second axis for the tokens.
  """
  if mesh is None:
    return "expert", "data"
  expert = expert_axis
  if expert not in mesh.axis_names:
    ones = [name for name in mesh.axis_names if mesh.shape[name] == 1]
    if not ones:
      raise ValueError(
        f"mesh has axes {mesh.axis_names} and no {expert_axis!r} axis: add one (of size 1 "
        "for no expert parallelism)"
      )
    expert = ones[0]
  data = tuple(name for name in mesh.axis_names if name != expert)
  if not data:
    raise ValueError(
      f"mesh has only the axis {expert!r}: add an axis for the tokens' data parallelism (of "
      "size 1 for none), e.g. jax.make_mesh((1, ep), ('data', 'expert'))"
    )
  return expert, data
