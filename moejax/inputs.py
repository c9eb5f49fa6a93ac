"""The one check of a call's arguments against its `moejax.call_record.CallRecord`, at trace
time, each argument named when wrong with what was expected and what came: the parameters
(float, quantized, adapters), the inputs, the placement of replicas and the mesh. One set of
checks for the fast path (`moejax.moe_apply`), the oracle (`moejax.reference_moe`, which
shares no other code with it), the layers and the loaders."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.formats import FORMATS
from kernels_pallas.quantized import is_block_scaled
from moejax import meshes
from moejax.call_record import CallRecord, QuantizedExpected
from moejax.config import MoEConfig
from moejax.expert_placement import Placement
from moejax.params import (
  ADAPTER_PARAMS,
  EXPERT_PARAMS,
  QUANTIZED_PARAMS,
  SHARED_FSDP_PARAMS,
  MoEParams,
)


def check_call(
  record: CallRecord,
  params,
  x,
  token_mask=None,
  router_logits=None,
  expert_ids=None,
  combine_weights=None,
  placement=None,
) -> None:
  """A call's arguments against `record` (types, dtypes, shapes; the mesh where the record
  has one), each named when wrong. Given `expert_ids` outside a trace (concrete values) must
  also be in range and distinct per valid token (`check_expert_id_values`); `combine_weights`
  come with them, one per id."""
  config = record.config
  if not isinstance(params, MoEParams):
    raise TypeError(
      f"params must be a moejax.MoEParams (e.g. `layer.moe_params()`), got {type(params).__name__}"
    )
  check_params(params, record)
  named = (("x", x), ("token_mask", token_mask), ("router_logits", router_logits))
  for name, value in (*named, ("expert_ids", expert_ids), ("combine_weights", combine_weights)):
    if value is not None and not hasattr(value, "shape"):
      raise TypeError(f"{name} must be an array (JAX or NumPy), got {type(value).__name__}")
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"x must be a floating array, got dtype {jnp.result_type(x)}")
  if x.ndim < 1 or x.shape[-1] != record.widths["x"]:
    raise ValueError(f"x has shape {x.shape}; expected [..., hidden_size={record.widths['x']}]")
  if token_mask is not None:
    if token_mask.shape != x.shape[:-1]:
      raise ValueError(
        f"token_mask has shape {token_mask.shape}; expected x.shape[:-1]={x.shape[:-1]}"
      )
    if jnp.result_type(token_mask) != jnp.bool_:
      raise TypeError(f"token_mask must be bool, got dtype {jnp.result_type(token_mask)}")
  if router_logits is None and config.external_router and combine_weights is None:
    raise ValueError(
      "router_logits is None, but this layer has no router (external_router=True): pass the "
      f"logits of its router, [..., {record.widths['router_logits']}]"
    )
  if router_logits is not None:
    expected = (*x.shape[:-1], record.widths["router_logits"])
    if router_logits.shape != expected:
      raise ValueError(f"router_logits has shape {router_logits.shape}; expected {expected}")
    if not jnp.issubdtype(jnp.result_type(router_logits), jnp.floating):
      raise TypeError(f"router_logits must be floating, got dtype {jnp.result_type(router_logits)}")
  if expert_ids is not None:
    expected = (*x.shape[:-1], record.widths["expert_ids"])
    if expert_ids.shape != expected:
      raise ValueError(
        f"expert_ids has shape {expert_ids.shape}; expected [..., top_k] = {expected}"
      )
    if not jnp.issubdtype(jnp.result_type(expert_ids), jnp.integer):
      raise TypeError(
        f"expert_ids must be integer (int32), got dtype {jnp.result_type(expert_ids)}"
      )
    check_expert_id_values(expert_ids, token_mask, config)
  if combine_weights is not None:
    _check_combine_weights(combine_weights, expert_ids, config)
  check_placement(placement, record)
  if record.mesh is not None:
    check_mesh(record)


def check_unmeshed(params: MoEParams, x) -> None:
  """For a call without a mesh: neither `x` nor a parameter is sharded over explicit mesh
  axes (a ValueError naming the first that is, and the mesh to pass)."""
  arrays = {"x": x, **{f"params.{name}": v for name, v in params._asdict().items()}}
  for name, value in arrays.items():
    leaf = next((a for a in jax.tree.leaves(value) if meshes.explicitly_sharded(a)), None)
    if leaf is not None:
      raise ValueError(
        f"{name} is sharded over explicit mesh axes ({jax.typeof(leaf).sharding.spec}) but "
        "the call has no mesh: pass that mesh (`moe_apply(..., mesh=mesh)`, "
        "`MoELayer(config, mesh=mesh)`, or `jax.set_mesh(mesh)` around the call), or "
        "unsharded arrays"
      )


def check_params(params: MoEParams, record: CallRecord) -> None:
  """Raises ValueError if a parameter is missing, unexpected, of the wrong shape, or of
  another format than `config.expert_quant` asks; adapters likewise."""
  check_adapters("lora", params.lora, record.lora)
  check_adapters("shared_lora", params.shared_lora, record.shared_lora)
  for name in MoEParams._fields:
    if name in ADAPTER_PARAMS:
      continue
    value = getattr(params, name)
    if name not in record.params:
      if value is not None:
        raise ValueError(f"params.{name} is given but the config does not use it")
      continue
    expected = record.params[name].shape
    if value is None:
      raise ValueError(f"params.{name} is missing; expected shape {expected}")
    if tuple(value.shape) != expected:
      raise ValueError(f"params.{name} has shape {tuple(value.shape)}, expected {expected}")
    _check_format(name, value, record.quantized.get(name), record.config)


def _check_format(name: str, value, quantized: QuantizedExpected | None, config: MoEConfig) -> None:
  """A quantized parameter is a `BlockScaled` of the record's leaves; no other one is."""
  if quantized is None:
    if is_block_scaled(value):
      raise ValueError(
        f"params.{name} is a BlockScaled but the config does not quantize it "
        f"(expert_quant={config.expert_quant!r})"
      )
    return
  if not is_block_scaled(value):
    raise ValueError(
      f"params.{name} must be a BlockScaled (values and scales) with "
      f"expert_quant={config.expert_quant!r}, got {type(value).__name__} "
      "(see moejax.quant.quantize_experts)"
    )
  form = FORMATS[config.expert_quant]
  scales_dtype = jnp.result_type(value.scales)
  if not form.takes_scales(scales_dtype):
    expected = " or ".join(str(d) for d in (form.scales, *form.other_scales))
    raise ValueError(
      f"params.{name} has scales dtype {scales_dtype}, expected {expected} for "
      f"expert_quant={config.expert_quant!r}"
    )
  want_global = quantized.global_scale
  found = {
    "values dtype": (jnp.result_type(value.values), quantized.values.dtype),
    "block": (value.block, quantized.block),
    "scales shape": (tuple(value.scales.shape), quantized.scales.shape),
    "global_scale (dtype, shape)": (
      _dtype_and_shape(value.global_scale),
      None if want_global is None else (str(want_global.dtype), want_global.shape),
    ),
  }
  for what, (got, want) in found.items():
    if got != want:
      raise ValueError(
        f"params.{name} has {what} {got}, expected {want} for expert_quant={config.expert_quant!r}"
      )


def _dtype_and_shape(a) -> tuple[str, tuple[int, ...]] | None:
  return None if a is None else (str(jnp.result_type(a)), tuple(a.shape))


def check_adapters(name: str, value, expected) -> None:
  """Raises ValueError unless `value` (params.`name`) is what the record holds: None without
  adapters, else an `ExpertLoRA` / `SharedLoRA` of floating arrays of the expected shapes."""
  if expected is None:
    if value is not None:
      raise ValueError(f"params.{name} is given but the config has no adapters for it")
    return
  kind = type(expected)
  if not isinstance(value, kind):
    got = "None" if value is None else type(value).__name__
    raise ValueError(f"params.{name} must be a moejax.lora.{kind.__name__}, got {got}")
  for field, array, want in zip(kind._fields, value, expected, strict=True):
    if tuple(jnp.shape(array)) != want.shape:
      raise ValueError(
        f"params.{name}.{field} has shape {tuple(jnp.shape(array))}, expected {want.shape}"
      )
    if not jnp.issubdtype(jnp.result_type(array), jnp.floating):
      raise ValueError(f"params.{name}.{field} must be floating, got {jnp.result_type(array)}")


def check_placement(placement: Placement | None, record: CallRecord) -> None:
  """A `placement=` argument against the record: present exactly when the config has
  redundant experts, one layer's fields, each of the right shape and int dtype.

  Raises:
    ValueError: naming the argument or field.
  """
  config = record.config
  redundant = config.num_redundant_experts
  if placement is None:
    if redundant:
      raise ValueError(
        f"placement= is required: config.num_redundant_experts={redundant} (see "
        "moejax.eplb.initial_placement and moejax.eplb.rebalance)"
      )
    return
  if not redundant:
    raise ValueError("placement= is given but config.num_redundant_experts is 0 (no replicas)")
  if not isinstance(placement, Placement):
    raise ValueError(f"placement must be a moejax.eplb.Placement, got {type(placement).__name__}")
  for name, value, want in zip(Placement._fields, placement, record.placement, strict=True):
    if tuple(jnp.shape(value)) != want.shape:
      raise ValueError(
        f"placement.{name} has shape {tuple(jnp.shape(value))}, expected {want.shape} "
        f"(E={config.num_experts}, P=E+R={config.num_physical_experts})"
      )
    if not jnp.issubdtype(jnp.result_type(value), jnp.integer):
      raise ValueError(f"placement.{name} must be integer, got dtype {jnp.result_type(value)}")


def check_mesh(record: CallRecord) -> None:
  """Raises ValueError unless the config's two groups name every axis of the record's mesh
  of size > 1 (axes of size 1, a framework's unused ones, may be left out) and only its
  axes, the expert group divides the physical experts, P = E + R, and with `expert_fsdp`
  the data group splits every expert weight's dim 1 evenly, scale blocks included."""
  mesh, config = record.mesh, record.config
  groups = f"data_axis={config.data_axis!r}, expert_axis={config.expert_axis!r}"
  for field, axes in (("data_axis", config.data_axes), ("expert_axis", config.expert_axes)):
    for name in axes:
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
  experts = record.expert_devices
  if config.num_physical_experts % experts:
    redundant = config.num_redundant_experts
    physical = f" + num_redundant_experts={redundant}" if redundant else ""
    raise ValueError(
      f"num_experts={config.num_experts}{physical} must be divisible by the size of "
      f"expert_axis={config.expert_axis!r}, {experts}"
    )
  if config.expert_fsdp:
    _check_fsdp_split(record, record.data_devices)
  if config.shared_fsdp:
    devices = record.data_devices * experts
    name = unsplit_shared(record, devices)
    if name is not None:
      shape = record.params[name].shape
      raise ValueError(
        f"shared_fsdp=True splits {name} {shape} along dim 0 over every device of the mesh "
        f"({devices}): {shape[0]} is not divisible into {devices} shards"
      )


def unsplit_shared(record: CallRecord, devices: int) -> str | None:
  """The first of the router's and shared experts' matrices whose dim 0 `shared_fsdp` cannot
  split evenly over `devices`, or None when all split."""
  shapes = record.shapes
  return next((n for n in SHARED_FSDP_PARAMS if n in shapes and shapes[n][0] % devices), None)


def _check_fsdp_split(record: CallRecord, shards: int) -> None:
  """With `expert_fsdp`, every expert weight's dim 1 (and its scale blocks) split evenly into
  `shards` pieces."""
  config = record.config
  block_rows = 1 if config.quant_block is None else config.quant_block[0]
  shapes = {name: e.shape for name, e in record.params.items() if name in EXPERT_PARAMS}
  if record.lora is not None:
    shapes.update({f"lora.{f}": e.shape for f, e in record.lora._asdict().items()})
  for name, quantized in record.quantized.items():  # NVFP4's [E, out]
    if quantized.global_scale is not None:
      shapes[f"{name}.global_scale"] = quantized.global_scale.shape
  for name, shape in shapes.items():
    blocks = block_rows if name in QUANTIZED_PARAMS else 1  # matrices' scale blocks
    if shape[1] % (shards * blocks):
      straddle = f" in whole {blocks}-row scale blocks" if blocks > 1 else ""
      raise ValueError(
        f"expert_fsdp=True splits {name} {shape} along dim 1 over data_axis="
        f"{config.data_axis!r} ({shards} devices): {shape[1]} is not divisible into "
        f"{shards} shards{straddle}"
      )


def _check_combine_weights(combine_weights, expert_ids, config) -> None:
  """`combine_weights` beside the `expert_ids` they weigh: floating, of their shape."""
  if expert_ids is None:
    raise ValueError(
      "combine_weights is given without expert_ids: pass the ids they weigh, [..., top_k]"
    )
  if combine_weights.shape != expert_ids.shape:
    raise ValueError(
      f"combine_weights has shape {combine_weights.shape}; expected expert_ids' shape "
      f"{expert_ids.shape}"
    )
  if not jnp.issubdtype(jnp.result_type(combine_weights), jnp.floating):
    raise TypeError(
      f"combine_weights must be floating, got dtype {jnp.result_type(combine_weights)}"
    )
  if config.shared_expert_scores:
    raise ValueError(
      "combine_weights cannot weigh this layer's shared experts, which the router scores "
      "(shared_expert_scores=True): route with the router, or use a config without it"
    )


def check_expert_id_values(expert_ids, token_mask, config) -> None:
  """Concrete `expert_ids` (outside a trace): each valid token's K ids in [0, E + Z) and
  distinct, else a ValueError naming the first bad token. Traced ones are not read (no host
  sync): under `jit` an invalid id routes nowhere and is counted
  (`moejax.MoEAux.invalid_expert_ids`)."""
  if isinstance(expert_ids, jax.core.Tracer) or isinstance(token_mask, jax.core.Tracer):
    return
  ids = np.asarray(expert_ids).reshape(-1, config.top_k)
  mask = np.ones(len(ids), bool) if token_mask is None else np.asarray(token_mask).reshape(-1)
  outputs = config.num_router_outputs
  out_of_range = ((ids < 0) | (ids >= outputs)).any(-1)
  ranked = np.sort(ids, axis=-1)
  repeated = (ranked[:, 1:] == ranked[:, :-1]).any(-1)
  for bad, what in ((out_of_range, f"outside [0, {outputs})"), (repeated, "repeated")):
    found = np.flatnonzero(bad & mask)
    if found.size:
      token = np.unravel_index(found[0], np.shape(expert_ids)[:-1])
      raise ValueError(
        f"expert_ids: token {tuple(int(i) for i in token)} has ids {ids[found[0]].tolist()}, "
        f"{what} ({found.size} such tokens); each token takes top_k={config.top_k} distinct "
        f"expert ids in [0, num_experts + num_zero_experts = {outputs})"
      )
