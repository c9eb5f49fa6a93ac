"""`MoELayer`: the Flax NNX module that holds the weights and calls `moe_apply`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from kernels_pallas.quantized import BlockScaled
from moejax import eplb, lora, meshes
from moejax.call_plan import CallPlan, plan_call
from moejax.call_record import call_record
from moejax.config import MoEConfig
from moejax.expert_placement import Placement, initial_placement, logical_load
from moejax.forward import MoEAux, moe_apply
from moejax.inputs import check_mesh
from moejax.params import (
  ADAPTER_PARAMS,
  BIAS_PARAMS,
  EXPERT_PARAMS,
  MoEParams,
  expert_arrays,
)
from moejax.quant import quantize

# The `MoEAux` fields a call sows under `nnx.capture` (the per-device ones stay out).
_AUX_NAMES = (
  "expert_counts",
  "load_balancing_loss",
  "router_z_loss",
  "expert_ids",
  "expert_weights",
  "invalid_expert_ids",
  "score_sums",
  "num_tokens",
  "load_max_over_mean",
)

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


class ExpertPlacement(nnx.Variable):
  """A field of a layer's `moejax.eplb.Placement` (non-trainable state: data the layer
  computes by)."""


class PlacementState(nnx.Module):
  """A `Placement` as one `ExpertPlacement` variable per field (plain arrays, so that
  `nnx.get_partition_spec`, `shard_model` and orbax handle them like any variable)."""

  def __init__(self, placement: Placement):
    for name, value in zip(Placement._fields, placement, strict=True):
      setattr(self, name, ExpertPlacement(jnp.asarray(value)))

  def get_value(self) -> Placement:
    return Placement(*(getattr(self, name).get_value() for name in Placement._fields))

  def set_value(self, placement: Placement) -> None:
    for name, value in zip(Placement._fields, placement, strict=True):
      getattr(self, name).set_value(jnp.asarray(value))


class QuantizedWeight(nnx.Variable):
  """A leaf of a quantized expert matrix (values, scales, global scale): computed with, never
  trained."""


class QuantizedMatrix(nnx.Module):
  """A `BlockScaled` expert matrix as one `QuantizedWeight` variable per leaf (`values`,
  `scales`, NVFP4's `global_scale`), each with the expert axis's sharding metadata (`names`
  cut to its rank, so `nnx.get_partition_spec`, `shard_model` and orbax see plain arrays).
  `get_value()` gives the `BlockScaled`, as `nnx.Param.get_value()` gives an array."""

  def __init__(self, weight: BlockScaled, names: tuple[str | None, ...], on_mesh: dict):
    for part, leaf in weight.parts().items():
      leaf_names = names[: leaf.ndim]
      setattr(self, part, QuantizedWeight(leaf, out_sharding=leaf_names, **on_mesh))
    self.part_names = tuple(weight.parts())
    self.block = weight.block

  def get_value(self) -> BlockScaled:
    parts = {part: getattr(self, part).get_value() for part in self.part_names}
    return BlockScaled.from_parts(parts, self.block)


class Adapters(nnx.Module):
  """An `ExpertLoRA` or `SharedLoRA` as one `nnx.LoRAParam` per field, each with its
  sharding metadata; `get_value()` gives the typed value."""

  def __init__(self, adapters: lora.ExpertLoRA | lora.SharedLoRA, names, on_mesh: dict):
    self.kind = type(adapters)
    for field, value in zip(adapters._fields, adapters, strict=True):
      setattr(self, field, nnx.LoRAParam(value, out_sharding=names, **on_mesh))

  def get_value(self) -> lora.ExpertLoRA | lora.SharedLoRA:
    return self.kind(*(getattr(self, field).get_value() for field in self.kind._fields))


class SelectionBias(nnx.Variable):
  """The routing bias (`MoEParams.routing_bias`, [E + Z] float32): state that
  `moejax.balancing` moves toward balance, never a gradient-trained parameter, so that an
  optimizer over `nnx.Param` (weight decay included) leaves it alone."""


class ExpertLoad(nnx.Variable):
  """[P] int32 (token, choice) pairs each physical expert received since the last rebalance."""


def fan_in_init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
  """Truncated normal with std 1/sqrt(fan_in), fan_in = shape[-2] (per expert for [E, in, out])."""
  std = shape[-2] ** -0.5 / 0.87962566  # undo the truncation at ±2 std
  return (jax.random.truncated_normal(key, -2.0, 2.0, shape) * std).astype(dtype)


class MoELayer(nnx.Module):
  """A Mixture-of-Experts FFN block, optionally spread over a (data, expert) mesh.

  Parameters (the checkpoint format, `moejax.MoEParams`): `router_kernel` [D, E + Z],
  `w_gate_up` [E, D, 2F], `w_down` [E, F, D], and as the config asks `routing_bias` and
  `router_bias` [E + Z], `b_gate_up` [E, 2F], `b_down` [E, D], `shared_w_gate_up` [D, 2Fs],
  `shared_w_down` [Fs, D], `shared_gate_kernel` [D, 1], `output_bias` [D],
  `shared_router_kernel` [D, S]. Each carries
  `out_sharding` metadata (E over the expert axis); with a mesh they are created sharded on
  it. Biases start at `bias_init`, matrices at `kernel_init`.

  Under `nnx.capture(..., nnx.Intermediate)` each call sows its aux outputs (`moejax.MoEAux`):
  `expert_counts` [E + Z], `load_balancing_loss` [], `router_z_loss` [], `expert_ids` and
  `expert_weights` [..., K] (replay the ids with `expert_ids=`), `invalid_expert_ids` [],
  `score_sums` [E + Z], `num_tokens` [], `load_max_over_mean` [] (a tuple of values per
  name, one per call). `moejax.moe_apply` returns them directly.

  With `config.use_routing_bias` the selection bias `routing_bias` is a `SelectionBias`
  variable, not an `nnx.Param`: `moejax.balancing` moves it; no gradient or optimizer does.

  With `config.num_redundant_experts` R > 0 the expert parameters hold P = E + R physical
  slots, and the layer keeps non-trainable state that optax (given `wrt=nnx.Param`) never
  sees: `placement`, a `PlacementState` of `ExpertPlacement` variables whose `get_value()`
  is a `moejax.eplb.Placement` (a new layer holds expert e at slot e and expert i mod E at
  slot E + i, each replica starting with its expert's weights), and `expert_load`
  (`ExpertLoad`, [P] int32: the `physical_counts` of every call since the last
  `rebalance`). Replicas must keep equal weights: an optimizer stepping the physical slots
  independently lets them drift apart, so train on logical weights with
  `moejax.eplb.sum_replicas` and `moejax.eplb.place` (docs/design.md, "Redundant experts").

  With `config.lora_rank` r > 0 the layer also holds LoRA adapters (`moejax.lora`): `lora`,
  an `Adapters` module of `nnx.LoRAParam`s whose `get_value()` is an `ExpertLoRA` (P over the
  expert axis, as the experts), and with shared experts `shared_lora` (a `SharedLoRA`),
  initialized as PEFT does (A Kaiming-uniform, B zero: a new adapter changes nothing).
  `nnx.Optimizer(layer, tx, wrt=nnx.LoRAParam)` trains only them; the base weights, float or
  quantized, then get no gradient computed.

  With `config.expert_quant`, `w_gate_up` and `w_down` are `QuantizedMatrix` modules (values,
  scales and NVFP4's global scale as `QuantizedWeight` variables, quantized from
  `kernel_init`'s draw; load real ones with `moejax.hf`): fixed weights, never trained.

  Args:
    config: the layer's `MoEConfig`.
    mesh: a mesh whose every axis is in the config's data or expert group; None takes the
      ambient mesh (`jax.set_mesh`) if one is set, else one device.
    rngs: `nnx.Rngs` with a `params` stream.
    kernel_init: initializer of the router, expert and shared-expert matrices.
    bias_init: initializer of the biases (`routing_bias`, `router_bias`, `b_gate_up`,
      `b_down`, `output_bias`).

  >>> config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16)
  >>> layer = MoELayer(config, rngs=nnx.Rngs(0))
  >>> x = jnp.ones((2, 3, 8))
  >>> layer(x, token_mask=jnp.array([[True, True, False]] * 2)).shape
  (2, 3, 8)
  >>> _, aux = nnx.capture(layer, nnx.Intermediate)(x)
  >>> aux["expert_counts"][0].sum()  # 6 tokens, 2 experts each
  Array(12, dtype=int32)
  """

  def __init__(
    self,
    config: MoEConfig,
    *,
    mesh: Mesh | None = None,
    rngs: nnx.Rngs,
    kernel_init: Initializer = fan_in_init,
    bias_init: Initializer = nnx.initializers.zeros,
  ):
    mesh = meshes.of_call(mesh)
    record = call_record(config, mesh)
    if mesh is not None:
      check_mesh(record)
    self.config = config
    self.mesh = mesh
    # With a mesh, flax places each parameter by its metadata; without one there is nowhere
    # to place it, and the metadata is kept for later use (nnx.get_partition_spec).
    on_mesh = {"mesh": mesh} if mesh is not None else {"eager_sharding": False}
    slots = initial_placement(config.num_experts, config.num_redundant_experts)
    to_slots = jnp.asarray(slots.physical_to_logical)
    replicated = config.num_redundant_experts > 0  # each replica starts as its expert
    for name, expected in record.params.items():
      init = bias_init if name in BIAS_PARAMS else kernel_init
      if name in EXPERT_PARAMS and replicated:
        logical = (config.num_experts, *expected.shape[1:])
        value = init(rngs.params(), logical, expected.dtype)[to_slots]
      else:
        value = init(rngs.params(), expected.shape, expected.dtype)
      if name in record.quantized:
        weight = quantize(value, config.expert_quant, config.quant_block)
        setattr(self, name, QuantizedMatrix(weight, expected.spec, on_mesh))
      else:
        kind = SelectionBias if name == "routing_bias" else nnx.Param
        setattr(self, name, kind(value, out_sharding=expected.spec, **on_mesh))
    if record.lora is not None:  # as PEFT initializes them: the output is the base layer's
      logical = type(record.lora)(*((config.num_experts, *e.shape[1:]) for e in record.lora))
      adapters = lora.init_like(logical, rngs.params(), record.lora.gate_up_a.dtype)
      if replicated:
        adapters = jax.tree.map(lambda a: a[to_slots], adapters)
      self.lora = Adapters(adapters, record.lora.gate_up_a.spec, on_mesh)
      if record.shared_lora is not None:
        shapes = type(record.shared_lora)(*(e.shape for e in record.shared_lora))
        shared = lora.init_like(shapes, rngs.params(), record.shared_lora.gate_up_a.dtype)
        self.shared_lora = Adapters(shared, record.shared_lora.gate_up_a.spec, on_mesh)
    if config.num_redundant_experts:
      self.placement = PlacementState(self._replicated(slots))
      no_load = jnp.zeros(config.num_physical_experts, jnp.int32)
      self.expert_load = ExpertLoad(self._replicated(no_load))

  def _replicated(self, tree):
    """Arrays on every device of the layer's mesh (on the default device without one), as
    the parameters are: the layer's program takes all its arguments from one device set."""
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, tree)
    return jax.device_put(tree, meshes.named_sharding(self.mesh, None))

  def moe_params(self) -> MoEParams:
    """The current weights as an `MoEParams` pytree (for `moejax.moe_apply`)."""
    names = [*call_record(self.config).params, *(a for a in ADAPTER_PARAMS if hasattr(self, a))]
    return MoEParams(**{name: getattr(self, name).get_value() for name in names})

  def __call__(
    self,
    x: jax.Array,
    token_mask: jax.Array | None = None,
    *,
    router_logits: jax.Array | None = None,
    expert_ids: jax.Array | None = None,
    combine_weights: jax.Array | None = None,
  ) -> jax.Array:
    """Applies the layer.

    Args:
      x: [..., D] tokens.
      token_mask: [...] bool, True for real tokens; None means all real.
      router_logits: [..., E + Z] logits from an external router (Z zero-computation
        experts, 0 but for LongCat-Flash); the layer's router then does not run.
      expert_ids: [..., K] int32 logical expert ids to use instead of the router's top-k
        (routing replay; `moejax.moe_apply` says how they are weighted and checked).
      combine_weights: [..., K] weights of those ids, for a caller that routes itself
        (`moejax.moe_apply`'s), or None: the router's scores.

    Returns:
      [..., D] with x's dtype; rows whose mask is False are exactly 0.
    """
    y, aux = moe_apply(
      self.moe_params(),
      x,
      config=self.config,
      mesh=self.mesh,
      token_mask=token_mask,
      router_logits=router_logits,
      expert_ids=expert_ids,
      combine_weights=combine_weights,
      placement=self._placement(),
    )
    if self.config.num_redundant_experts:
      self.expert_load.set_value(self.expert_load.get_value() + aux.physical_counts)
    self._sow_aux(aux)
    return y

  def plan(self, x: jax.Array | jax.ShapeDtypeStruct | tuple[int, ...]) -> CallPlan:
    """What a call on `x` ([..., D], or its shape) will do, and why: its
    `moejax.call_plan.CallPlan` (print it for the decisions in words)."""
    return plan_call(self.config, x, mesh=self.mesh)

  def _placement(self) -> Placement | None:
    if not self.config.num_redundant_experts:
      return None
    return self.placement.get_value()

  def rebalance(self, load: jax.Array | None = None) -> Placement:
    """Re-places the experts by DeepSeek's policy (`moejax.eplb.rebalance`, one node, the
    expert axis's devices) and moves their weights (`moejax.eplb.place`); resets
    `expert_load`. Calls after it run the same executable. A stack of layers (built by
    `nnx.vmap`: every variable has a leading layer axis) re-places each layer by its own load.

    Args:
      load: [E] ([layers, E] for a stack) load of each logical expert; None for the load
        accumulated since the last rebalance (`expert_load` summed over each expert's
        replicas).

    Returns:
      The new placement (fields with a leading layer axis for a stack).

    Raises:
      ValueError: the layer has no redundant experts, or `load` is not [E] ([layers, E]).
    """
    config = self.config
    if not config.num_redundant_experts:
      raise ValueError("rebalance needs redundant experts: config.num_redundant_experts is 0")
    current = self._placement()
    if load is None:
      load = logical_load(jax.device_get(self.expert_load.get_value()), current)
    moved, new = eplb.rebalance_weights(self.moe_params(), config, current=current, load=load)
    for name, part, value in expert_arrays(moved):
      variable = getattr(self, name)
      (variable if part is None else getattr(variable, part)).set_value(value)
    self.placement.set_value(self._replicated(new))
    self.expert_load.set_value(jnp.zeros_like(self.expert_load.get_value()))
    return new

  def _sow_aux(self, aux: MoEAux) -> None:
    # Flax deprecates sow() outside nnx.capture(), and only capture reads the values: sow
    # there only (flax itself tells the two apart by this attribute).
    if not hasattr(self, "__captures__"):
      return
    for name in _AUX_NAMES:
      self.sow(nnx.Intermediate, name, getattr(aux, name))


def collect_aux(intermediates: nnx.State) -> dict[str, list[jax.Array]]:
  """The aux values sown by every `MoELayer` call under `nnx.capture`, by name.

  Args:
    intermediates: the `nnx.Intermediate` state returned by `nnx.capture(model, ...)`.

  Returns:
    {"expert_counts": [...], "load_balancing_loss": [...], ...} (the names the layer sows):
    one entry per layer call, in module order: [E + Z] and [] for a layer called once,
    [layers, E + Z] and [layers] for a stack applied with `nnx.scan` (one entry for the whole
    stack).
    `moejax.train.summed_aux` adds them up either way.
  """
  aux: dict[str, list[jax.Array]] = {name: [] for name in _AUX_NAMES}
  for path, variable in nnx.to_flat_state(intermediates):
    if path[-1] in aux:
      aux[path[-1]].extend(variable.get_value())
  return aux
