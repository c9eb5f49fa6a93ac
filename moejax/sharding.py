"""Mesh checks and every PartitionSpec of the layer, in one place.

Tokens are split over the data and expert groups jointly, expert weights over the expert
group (and with `expert_fsdp` their dim 1 over the data group), with `shared_fsdp` the
router's and shared experts' matrices along dim 0 over both groups, everything else is
replicated. The groups come from `MoEConfig.data_axis` / `.expert_axis` (`moejax.axis_groups`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.formats import FORMATS
from moejax import axis_groups, lora
from moejax.axis_groups import spec_entry
from moejax.config import MoEConfig
from moejax.meshes import named_sharding
from moejax.params import (
  EXPERT_PARAMS,
  PER_EXPERT_FIELDS,
  QUANTIZED_PARAMS,
  SHARED_FSDP_PARAMS,
  MoEParams,
  param_shapes,
)


@dataclasses.dataclass(frozen=True)
class LayerSpecs:
  """PartitionSpecs of the layer's arrays on a mesh of its data and expert groups.

  Attributes:
    tokens_t: token-major arrays [T, ...]: T over (data group, expert group).
    experts_e: expert weights [E, ...]: E over the expert group; with `expert_fsdp`, dim 1
      over the data group too.
    shared_d: the router's and shared experts' matrices (`SHARED_FSDP_PARAMS`): with
      `shared_fsdp`, dim 0 over (data group, expert group); else replicated.
    replicated: biases, shared adapters, aux losses.
    batch_b: a model's input batches [B, ...] (B sequences): B over the data group.
  """

  tokens_t: P
  experts_e: P
  shared_d: P
  replicated: P
  batch_b: P

  @classmethod
  def from_config(cls, config: MoEConfig) -> LayerSpecs:
    data, experts = config.data_axes, config.expert_axes
    fsdp = (spec_entry(data),) if config.expert_fsdp else ()
    return cls(
      tokens_t=P(data + experts),
      experts_e=P(spec_entry(experts), *fsdp),
      shared_d=P(data + experts) if config.shared_fsdp else P(),
      replicated=P(),
      batch_b=P(spec_entry(data)),
    )

  def params(self, params: MoEParams) -> MoEParams:
    """The spec of each parameter present (None for absent ones)."""
    return MoEParams(
      *(
        None if value is None else self.param(name)
        for name, value in zip(MoEParams._fields, params, strict=True)
      )
    )

  def param(self, name: str) -> P:
    """The spec of the `MoEParams` field `name`: experts (and their adapters) over the
    expert group, the router's and shared experts' matrices as `shared_d`, the rest
    replicated."""
    if name in PER_EXPERT_FIELDS:
      return self.experts_e
    return self.shared_d if name in SHARED_FSDP_PARAMS else self.replicated

  def expert_leaf(self, ndim: int) -> P:
    """An expert leaf's spec [P, ...] written out to its rank, as `MoELayer` creates them (an
    equal but shorter spec would be another jit signature)."""
    return P(*written_out(self.experts_e, ndim))

  def aux(self, fields: tuple[str, ...], per_device: tuple[str, ...]) -> list[P]:
    """Specs of the aux outputs: per-device counts over (data, expert), the rest replicated."""
    return [self.tokens_t if name in per_device else self.replicated for name in fields]


def written_out(spec: P, ndim: int) -> tuple:
  """`spec`'s entries followed by None up to rank `ndim`."""
  return (*spec, *[None] * (ndim - len(spec)))


def map_params(fn: Callable[[jax.Array, P], Any], specs: MoEParams, params: MoEParams) -> MoEParams:
  """`fn(leaf, spec)` on every leaf of every parameter, with the parameter's spec (a
  `BlockScaled` has two leaves: values and scales share the spec); absent ones stay None."""
  return jax.tree.map(
    lambda spec, value: jax.tree.map(lambda leaf: fn(leaf, spec), value),
    specs,
    params,
    is_leaf=lambda spec: isinstance(spec, P),
  )


def param_sharding(config: MoEConfig) -> dict[str, tuple]:
  """Per-parameter sharding names (nnx `out_sharding` metadata), keyed by parameter name."""
  specs = LayerSpecs.from_config(config)
  return {
    name: written_out(specs.param(name), len(shape)) for name, shape in param_shapes(config).items()
  }


# The logical name of a layer-stack axis (MaxText's "layers"): on no mesh axis unless the mesh
# has one of that name.
LAYER_AXIS = "layers"


def metadata_placement(name: str, value, spec: P | None, mesh: Mesh) -> NamedSharding:
  """Where a variable goes by its sharding metadata `spec`: replicated without one; a
  `LAYER_AXIS` entry on no mesh axis unless `mesh` has it.

  Raises:
    ValueError: the spec's rank is not the array's (a variable stacked by `nnx.vmap` or
      `nnx.scan` without its layer axis in the metadata would shard the wrong dimension).
  """
  if spec is None or len(spec) == 0:
    return named_sharding(mesh, None)
  ndim = len(getattr(value, "shape", ()))
  if len(spec) != ndim:
    raise ValueError(
      f"{name}: its sharding metadata {spec} has rank {len(spec)}, the array "
      f"{tuple(value.shape)} rank {ndim}; a layer stack built with nnx.vmap / nnx.scan needs "
      f"transform_metadata={{nnx.PARTITION_NAME: None}} (or {LAYER_AXIS!r}) so that the layer "
      "axis has an entry"
    )
  if LAYER_AXIS not in mesh.axis_names:
    spec = P(*(None if axis == LAYER_AXIS else axis for axis in spec))
  return named_sharding(mesh, spec)


def check_mesh(mesh: Mesh | AbstractMesh, config: MoEConfig) -> None:
  """Raises ValueError unless the config's two groups name every axis of `mesh` of size > 1
  (axes of size 1, a framework's unused ones, may be left out) and only its axes, the expert
  group divides the physical experts, P = E + R, and with
  `expert_fsdp` the data group splits every expert weight's dim 1 evenly, scale blocks
  included."""
  if not isinstance(mesh, Mesh | AbstractMesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
  groups = f"data_axis={config.data_axis!r}, expert_axis={config.expert_axis!r}"
  for field in ("data_axis", "expert_axis"):
    for name in axis_groups.names(getattr(config, field)):
      if name not in mesh.axis_names:
        raise ValueError(
          f"mesh has axes {mesh.axis_names} but config.{field} names {name!r}: build the mesh "
          f"with every axis of {groups}, e.g. jax.make_mesh((dp, ep), "
          f"({config.data_axis!r}, {config.expert_axis!r})) for one axis each"
        )
  for name in mesh.axis_names:
    if name not in config.data_axes + config.expert_axes and mesh.shape[name] > 1:
      raise ValueError(
        f"mesh axis {name!r} (size {mesh.shape[name]}) is in neither group ({groups}): the "
        "layer would repeat its work on each of its devices; add it to expert_axis (a tensor "
        "axis whose outputs are replicated) or data_axis"
      )
  experts = axis_groups.size(mesh, config.expert_axis)
  if config.num_physical_experts % experts:
    redundant = config.num_redundant_experts
    physical = f" + num_redundant_experts={redundant}" if redundant else ""
    raise ValueError(
      f"num_experts={config.num_experts}{physical} must be divisible by the size of "
      f"expert_axis={config.expert_axis!r}, {experts}"
    )
  if config.expert_fsdp:
    _check_fsdp_split(config, axis_groups.size(mesh, config.data_axis))
  if config.shared_fsdp:
    _check_shared_split(
      config, axis_groups.size(mesh, config.data_axis) * axis_groups.size(mesh, config.expert_axis)
    )


def unsplit_shared(config: MoEConfig, devices: int) -> str | None:
  """The first of the router's and shared experts' matrices whose dim 0 `shared_fsdp` cannot
  split evenly over `devices`, or None when all split."""
  shapes = param_shapes(config)
  return next((n for n in SHARED_FSDP_PARAMS if n in shapes and shapes[n][0] % devices), None)


def _check_shared_split(config: MoEConfig, devices: int) -> None:
  """With `shared_fsdp`, dim 0 of the router's and shared experts' matrices split evenly over
  all `devices`."""
  name = unsplit_shared(config, devices)
  if name is not None:
    shape = param_shapes(config)[name]
    raise ValueError(
      f"shared_fsdp=True splits {name} {shape} along dim 0 over every device of the mesh "
      f"({devices}): {shape[0]} is not divisible into {devices} shards"
    )


def _check_fsdp_split(config: MoEConfig, shards: int) -> None:
  """With `expert_fsdp`, every expert weight's dim 1 (and its scale blocks) split evenly into
  `shards` pieces."""
  block_rows = 1 if config.quant_block is None else config.quant_block[0]
  adapters = lora.expert_lora_shapes(config)
  shapes = {name: shape for name, shape in param_shapes(config).items() if name in EXPERT_PARAMS}
  if adapters is not None:
    shapes.update({f"lora.{field}": s for field, s in zip(adapters._fields, adapters, strict=True)})
  if config.expert_quant and FORMATS[config.expert_quant].global_scale:  # NVFP4's [E, out]
    for name in QUANTIZED_PARAMS:
      experts, _, out = shapes[name]
      shapes[f"{name}.global_scale"] = (experts, out)
  for name, shape in shapes.items():
    blocks = block_rows if name in QUANTIZED_PARAMS else 1  # matrices' scale blocks
    if shape[1] % (shards * blocks):
      straddle = f" in whole {blocks}-row scale blocks" if blocks > 1 else ""
      raise ValueError(
        f"expert_fsdp=True splits {name} {shape} along dim 1 over data_axis="
        f"{config.data_axis!r} ({shards} devices): {shape[1]} is not divisible into "
        f"{shards} shards{straddle}"
      )
