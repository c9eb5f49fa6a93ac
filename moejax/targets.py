"""GPU targets: compile moejax (or a whole model) for GPU nodes on a machine without a GPU.

XLA's GPU compiler runs without a GPU: given a target description (a
`stream_executor.GpuTargetConfigProto`), JAX's CUDA plugin makes compile-only devices that
report the GPU's platform, kind, compute capability and SM count, and `jax.jit(...).lower(...)
.compile()` on a mesh of them builds the real GPU program: its kernels, collectives, layouts
and `memory_analysis()`. That proves a program builds and fits (shared-memory overflows,
layout and typing errors, out-of-memory show up); it proves nothing about numerics, races or
speed, which need a real GPU (`benchmarks/gpu_check.py`).

Needs JAX's CUDA plugin (`pip install 'jax[cuda13]'`), not a GPU or its driver.

The GPUs it knows are `GPUS` (`kernels_pallas.gpus`): A100, H100, H200 and B200, SXM.

>>> sorted(GPUS)
['a100', 'b200', 'h100', 'h200']
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from jax.sharding import Mesh

from kernels_pallas.gpus import GPUS, Gpu

__all__ = ["GPUS", "Gpu", "compile_only_devices", "target_mesh"]


@functools.cache
def compile_only_devices(target: str, nodes: int = 1, gpus_per_node: int = 8) -> list[jax.Device]:
  """`nodes` x `gpus_per_node` compile-only devices of `target` (a name in `GPUS`), each
  node one process (`process_index`). Programs compile for them; none runs.

  Raises:
    ValueError: an unknown target or a count below 1.
    RuntimeError: JAX's CUDA plugin is not installed.
  """
  if target not in GPUS:
    raise ValueError(f"target={target!r}; expected one of {sorted(GPUS)}")
  if nodes < 1 or gpus_per_node < 1:
    raise ValueError(f"{nodes=} and {gpus_per_node=} must be >= 1")
  from jax.experimental import topologies

  # Without a GPU driver the CUDA plugin refuses to load unless told to skip its checks of
  # the driver's libraries; it reads this when JAX first initializes its backends.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  try:
    topology = topologies.get_topology_desc(
      target,
      "cuda",
      target_config=GPUS[target].description(),
      topology=f"1x{nodes}x{gpus_per_node}",
    )
  except Exception as error:  # the plugin's absence surfaces as several error types
    raise RuntimeError(
      "compile-only GPU devices need JAX's CUDA plugin (pip install 'jax[cuda13]' or "
      "'jax[cuda12]' at the installed JAX's version; no GPU needed) and, on a machine "
      "without a GPU driver, JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 or JAX_PLATFORMS=cpu set "
      f"before JAX first initializes its backends: {error}"
    ) from error
  return list(topology.devices)


def target_mesh(
  target: str,
  axis_shape: tuple[int, ...],
  axis_names: tuple[str, ...] = ("data", "expert"),
  *,
  nodes: int = 1,
  gpus_per_node: int = 8,
  axis_types: tuple[jax.sharding.AxisType, ...] | None = None,
) -> Mesh:
  """A mesh of `compile_only_devices`, nodes major (as `jax.make_mesh` lays out hosts).

  Args:
    target: a name in `GPUS`.
    axis_shape: the mesh's shape; its product must be nodes * gpus_per_node.
    axis_names: one name per axis.
    nodes: GPU nodes (processes).
    gpus_per_node: GPUs per node.
    axis_types: the axes' types (default: Auto, as `jax.sharding.Mesh`'s).
  """
  devices = compile_only_devices(target, nodes, gpus_per_node)
  if int(np.prod(axis_shape)) != len(devices):
    raise ValueError(
      f"axis_shape={tuple(axis_shape)} holds {int(np.prod(axis_shape))} devices; "
      f"expected nodes * gpus_per_node = {len(devices)}"
    )
  if len(axis_names) != len(axis_shape):
    raise ValueError(f"axis_names={tuple(axis_names)} must name each of {len(axis_shape)} axes")
  grid = np.array(devices).reshape(axis_shape)
  if axis_types is None:
    return Mesh(grid, tuple(axis_names))
  return Mesh(grid, tuple(axis_names), axis_types=tuple(axis_types))
