"""Every PartitionSpec of the layer, in one place (the mesh is checked with the call's other
arguments: `moejax.inputs.check_mesh`).

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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.axis_groups import spec_entry
from moejax.config import MoEConfig
from moejax.meshes import named_sharding
from moejax.params import PER_EXPERT_FIELDS, SHARED_FSDP_PARAMS, MoEParams


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
