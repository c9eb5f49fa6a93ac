"""The record of what a layer call expects, derived once from its config and mesh alone.

`call_record(config, mesh)` holds every array a call takes: each parameter's shape, storage
dtype and sharding (routed and shared experts, router, biases, adapters, quantized matrices'
values and scales, the placement of replicas) and each input's trailing width. Everything
that needs a shape reads it here: the check of a call's arguments (`moejax.inputs`), the
layers that create parameters (`moejax.MoELayer`, `moejax.linen`), `moejax.testing`'s
parameters, the checkpoint loaders, `fit` and the call plan. A new option is taught here once.

>>> config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, lora_rank=2)
>>> record = call_record(config)
>>> record.params["w_gate_up"].shape, record.lora.down_b.shape, record.widths["expert_ids"]
((4, 8, 32), (4, 2, 8), 2)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from kernels_pallas.formats import FORMATS
from kernels_pallas.quantized import BlockScaled
from moejax.config import MoEConfig
from moejax.expert_placement import Placement
from moejax.lora import ExpertLoRA, SharedLoRA
from moejax.params import (
  QUANTIZED_PARAMS,
  ROUTER_PARAMS,
  MoEParams,
)
from moejax.sharding import LayerSpecs, map_params, written_out


@dataclasses.dataclass(frozen=True)
class Expected:
  """One array a call takes.

  Attributes:
    shape: its shape.
    dtype: the dtype a new one is stored in (a call takes any floating dtype for a float
      parameter: the layer casts to `config.dtype`).
    spec: its sharding on a mesh, one entry per dimension (`MoELayer`'s `out_sharding`).
  """

  shape: tuple[int, ...]
  dtype: jnp.dtype
  spec: tuple

  def abstract(self) -> jax.ShapeDtypeStruct:
    """The array as a `jax.ShapeDtypeStruct` (placed by `CallRecord.abstract_params`)."""
    return jax.ShapeDtypeStruct(self.shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class QuantizedExpected:
  """A quantized expert matrix (`BlockScaled`) in the config's format.

  Attributes:
    values: the quantized values: the matrix's shape, the format's dtype.
    scales: [..., ceil(in/bi), ceil(out/bo)] one per block, the dtype quantizing writes.
    block: (bi, bo), `config.quant_block`.
    global_scale: [..., out] float32 (NVFP4), or None.
  """

  values: Expected
  scales: Expected
  block: tuple[int, int]
  global_scale: Expected | None


@dataclasses.dataclass(frozen=True)
class CallRecord:
  """What a call of a layer of `config` on `mesh` expects (static; one per config and mesh).

  Attributes:
    config: the layer's config.
    mesh: the mesh the call runs on, or None.
    specs: the `moejax.sharding.LayerSpecs` of the layer's arrays.
    params: every `MoEParams` array field the config uses (not the adapters), by name: expert
      parameters [P, ...] (P = E + R physical experts); a quantized matrix's entry is its
      float shape (what quantizing takes), its stored leaves are in `quantized`.
    quantized: with `config.expert_quant`, `w_gate_up` and `w_down`'s `QuantizedExpected`.
    lora: the routed experts' adapters, an `ExpertLoRA` of `Expected`, or None.
    shared_lora: the shared experts' `SharedLoRA` of `Expected`, or None.
    placement: with redundant experts, a `moejax.eplb.Placement` of `Expected`, else None.
    data_devices: devices in the config's data group on the mesh (1 without one; an axis
      the mesh lacks counts 1, and `moejax.inputs.check_mesh` names it).
    expert_devices: devices in its expert group, likewise.
    widths: the last dimension of each token-major input: x [..., D], router_logits
      [..., E + Z], expert_ids [..., K] (token_mask is x's [...], combine_weights
      expert_ids' shape).
  """

  config: MoEConfig
  mesh: Mesh | AbstractMesh | None
  specs: LayerSpecs
  params: Mapping[str, Expected]
  quantized: Mapping[str, QuantizedExpected]
  lora: ExpertLoRA | None
  shared_lora: SharedLoRA | None
  placement: Placement | None
  data_devices: int
  expert_devices: int
  widths: Mapping[str, int]

  @property
  def shapes(self) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape by name (`moejax.param_shapes`)."""
    return {name: expected.shape for name, expected in self.params.items()}

  def abstract_params(self) -> MoEParams:
    """Every parameter as a `jax.ShapeDtypeStruct` (a `BlockScaled` of them where quantized),
    laid out on the record's mesh where it has one: for `jax.jit(...).lower(...)` without a
    byte of weights."""
    arrays = {name: expected.abstract() for name, expected in self.params.items()}
    for name, q in self.quantized.items():
      global_scale = None if q.global_scale is None else q.global_scale.abstract()
      arrays[name] = BlockScaled(q.values.abstract(), q.scales.abstract(), q.block, global_scale)
    adapters = lambda held: None if held is None else type(held)(*(e.abstract() for e in held))
    params = MoEParams(**arrays, lora=adapters(self.lora), shared_lora=adapters(self.shared_lora))
    if self.mesh is None:
      return params
    place = lambda leaf, spec: jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype, sharding=NamedSharding(self.mesh, spec)
    )
    return map_params(place, self.specs.params(params), params)


def call_record(config: MoEConfig, mesh: Mesh | AbstractMesh | None = None) -> CallRecord:
  """The `CallRecord` of a layer of `config` on `mesh` (built once per config and mesh; the
  mesh's axes are checked by `moejax.inputs.check_mesh`).

  Raises:
    TypeError: `config` is not a `MoEConfig`, or `mesh` not a mesh.
  """
  if not isinstance(config, MoEConfig):
    raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
  if mesh is not None and not isinstance(mesh, Mesh | AbstractMesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
  return _record(config, mesh)


@functools.lru_cache(maxsize=256)
def _record(config: MoEConfig, mesh: Mesh | AbstractMesh | None) -> CallRecord:
  specs = LayerSpecs.from_config(config)
  d, p, f = config.hidden_size, config.num_physical_experts, config.intermediate_size
  w, outputs = config.expert_width, config.num_router_outputs

  def expected(name: str, shape: tuple[int, ...]) -> Expected:
    dtype = jnp.float32 if name in ROUTER_PARAMS else config.param_dtype
    return Expected(shape, jnp.dtype(dtype), written_out(specs.param(name), len(shape)))

  shapes = {} if config.external_router else {"router_kernel": (d, outputs)}
  shapes.update(w_gate_up=(p, w, 2 * f), w_down=(p, f, w))
  if config.use_routing_bias:
    shapes["routing_bias"] = (outputs,)
  if config.has_shared_experts:
    fs = config.shared_intermediate_size
    shapes.update(shared_w_gate_up=(d, 2 * fs), shared_w_down=(fs, d))
  if config.router_bias:
    shapes["router_bias"] = (outputs,)
  if config.expert_bias:
    shapes.update(b_gate_up=(p, 2 * f), b_down=(p, w))
  if config.shared_expert_gate:
    shapes["shared_gate_kernel"] = (d, 1)
  if config.output_bias:
    shapes["output_bias"] = (d,)
  if config.latent_size:
    shapes.update(latent_in=(d, w), latent_out=(w, d))
  if config.shared_expert_scores:
    shapes["shared_router_kernel"] = (d, config.num_shared_experts)
  params = {name: expected(name, shape) for name, shape in shapes.items()}
  return CallRecord(
    config=config,
    mesh=mesh,
    specs=specs,
    params=params,
    quantized=_quantized(config, params),
    lora=_adapters(config, specs),
    shared_lora=_shared_adapters(config, specs),
    placement=_placement(config),
    data_devices=_devices(mesh, config.data_axes),
    expert_devices=_devices(mesh, config.expert_axes),
    widths={"x": d, "router_logits": outputs, "expert_ids": config.top_k},
  )


def _devices(mesh: Mesh | AbstractMesh | None, axes: tuple[str, ...]) -> int:
  """The product of the sizes of `axes` on `mesh` (1 for an axis it lacks, or no mesh)."""
  return 1 if mesh is None else math.prod(dict(mesh.shape).get(axis, 1) for axis in axes)


def _quantized(config: MoEConfig, params: Mapping[str, Expected]) -> dict[str, QuantizedExpected]:
  """The stored leaves of each quantized matrix, where `config.expert_quant` is set."""
  if config.expert_quant is None:
    return {}
  form, (bi, bo) = FORMATS[config.expert_quant], config.quant_block
  quantized = {}
  for name in QUANTIZED_PARAMS:
    matrix = params[name]
    *lead, rows, cols = matrix.shape
    scales = (*lead, math.ceil(rows / bi), math.ceil(cols / bo))
    global_scale = None
    if form.global_scale:
      global_scale = Expected((*lead, cols), jnp.dtype(jnp.float32), matrix.spec[:-1])
    quantized[name] = QuantizedExpected(
      values=Expected(matrix.shape, jnp.dtype(form.values), matrix.spec),
      scales=Expected(scales, jnp.dtype(form.scales), matrix.spec),
      block=(bi, bo),
      global_scale=global_scale,
    )
  return quantized


def _adapters(config: MoEConfig, specs: LayerSpecs) -> ExpertLoRA | None:
  """The routed experts' adapters [P, ...] (`moejax.lora.ExpertLoRA`), or None without them."""
  if not config.lora_rank:
    return None
  p, d, f, r = (
    config.num_physical_experts,
    config.expert_width,
    config.intermediate_size,
    config.lora_rank,
  )
  shapes = ((p, d, r), (p, r, 2 * f), (p, f, r), (p, r, d))
  spec = written_out(specs.param("lora"), 3)
  return ExpertLoRA(*(Expected(s, jnp.dtype(config.param_dtype), spec) for s in shapes))


def _shared_adapters(config: MoEConfig, specs: LayerSpecs) -> SharedLoRA | None:
  """The shared experts' adapters, or None without adapters or shared experts."""
  if not config.lora_rank or not config.has_shared_experts:
    return None
  d, fs, r = config.hidden_size, config.shared_intermediate_size, config.lora_rank
  shapes = ((d, r), (r, 2 * fs), (fs, r), (r, d))
  spec = written_out(specs.param("shared_lora"), 2)
  return SharedLoRA(*(Expected(s, jnp.dtype(config.param_dtype), spec) for s in shapes))


def _placement(config: MoEConfig) -> Placement | None:
  """The fields of a `Placement` of the P = E + R slots, replicated, or None without replicas."""
  redundant = config.num_redundant_experts
  if not redundant:
    return None
  e, p = config.num_experts, config.num_physical_experts
  shapes = ((p,), (e, redundant + 1), (e,))
  return Placement(*(Expected(s, jnp.dtype(jnp.int32), (None,) * len(s)) for s in shapes))


def param_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
  """Shape of every parameter the config needs, keyed by `MoEParams` field name (expert
  parameters [P, ...], P = E + R physical experts): its `CallRecord`'s."""
  return call_record(config).shapes
