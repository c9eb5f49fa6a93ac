"""LoRA adapters on the experts: against W + s·A·B per expert, trained alone, merged."""

import collections
import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import kernels_pallas
from kernels_pallas import platform
from moejax import (
  MoEConfig,
  MoELayer,
  eplb,
  linen,
  lora,
  moe_apply,
  param_shapes,
  plan,
  quant,
  reference_moe,
)
from moejax.activations import GatedActivation
from moejax.call_record import call_record
from moejax.expert_placement import initial_placement
from moejax.experts import adapted_mlp
from moejax.linen import moe_linen
from moejax.lora import ExpertLoRA
from moejax.models import shard_model
from moejax.params import ExpertWeights
from moejax.stacking import layer_of
from moejax.testing import random_params
from tests.helpers import (
  check_against_reference,
  check_layer,
  mesh_of,
  random_adapters,
  seed_of,
  slow,
  tolerance,
)
from tests.lowering import block_scaled_spec, cuda_custom_calls
from tests.stacks import Stack

BASE = MoEConfig(
  num_experts=8,
  top_k=2,
  hidden_size=64,
  intermediate_size=64,
  chunk_size=8,
  num_shared_experts=1,
  shared_intermediate_size=32,
  lora_rank=4,
  lora_alpha=6.0,
)


def with_adapters(config: MoEConfig, key: jax.Array):
  """Random parameters with random (non-zero) adapters of the kinds the config has: s · A @ B
  about half the size of the base weights."""
  expert, shared = random_adapters(config, key)
  return random_params(config, key)._replace(lora=expert, shared_lora=shared)


def tokens(seed: int, count: int = 48):
  x = jax.random.normal(jax.random.key(seed), (count, BASE.hidden_size))
  return x, jax.random.bernoulli(jax.random.key(seed + 1), 0.75, (count,))


def expect_path(config: MoEConfig, path: str, monkeypatch) -> None:
  """Makes calls of `config` plan `path` on this CPU: ragged_dot as on a GPU with few local
  experts, the Pallas kernels in their interpreter."""
  if path == "ragged_dot":
    # Plans as a GPU does, run on the CPU (a GPU `Target` would also take its collectives).
    monkeypatch.setattr(platform, "on_cpu", lambda: False)
  assert plan.plan_experts(config, num_rows=64, local_experts=2).path == path


@pytest.mark.filterwarnings("ignore:expert_backend='pallas' on a CPU:UserWarning")
@pytest.mark.filterwarnings("ignore:expert_backend='fused' on a CPU:UserWarning")
@pytest.mark.parametrize(
  "options, mesh_shape, path",
  [
    (dict(expert_bias=True, activation="gelu"), None, "tile_loop"),
    (dict(dispatch="all_to_all", expert_fsdp=True, lora_rslora=True), (2, 4), "tile_loop"),
    (dict(expert_backend="xla", activation="gelu"), None, "ragged_dot"),
    (dict(expert_backend="pallas", dispatch="all_to_all"), (2, 4), "pallas"),
    (dict(expert_backend="fused", expert_bias=True, expert_output_norm_eps=1e-6), None, "fused"),
    slow(dict(expert_backend="fused", dispatch="all_to_all"), (2, 4), "fused"),
  ],
  ids=[
    "biases-no mesh",
    "2x4-all_to_all-fsdp-rslora",
    "ragged_dot-gelu",
    "pallas-2x4",
    "fused-biases-output-norm",
    "fused-2x4",
  ],
)
def test_adapters_match_the_reference(options, mesh_shape, path, request, monkeypatch):
  """Output and every gradient (base, adapters, router, x) as the reference computes them
  with W + s·A·B per expert, on NaN-poisoned padding, on each expert path (the fused one
  with output norms too: its backward's aligned cotangent reaches the adapters)."""
  seed = seed_of(request.node.name)
  config = dataclasses.replace(BASE, **options)
  expect_path(config, path, monkeypatch)
  x, mask = tokens(seed)
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
  check_against_reference(
    with_adapters(config, jax.random.key(seed)), x, config, mesh, mask, seed=seed
  )


@pytest.mark.filterwarnings("ignore:expert_backend='pallas' on a CPU:UserWarning")
@pytest.mark.filterwarnings("ignore:expert_backend='fused' on a CPU:UserWarning")
@pytest.mark.parametrize(
  "backend, path", [("xla", "tile_loop"), ("pallas", "pallas"), slow("fused", "fused")]
)
def test_adapters_over_a_quantized_base(backend, path, request, monkeypatch):
  """fp8_block experts stay quantized (sliced per tile, or in the kernels): the output is the
  reference's on the dequantized weights plus the adapters, and the adapters, router and x
  get its gradients."""
  seed = seed_of(request.node.name)
  float_config = dataclasses.replace(BASE, quant_block_size=(32, 32), expert_backend=backend)
  params, config = quant.quantize_experts(
    with_adapters(float_config, jax.random.key(seed)), float_config, "fp8_block"
  )
  expect_path(config, path, monkeypatch)
  dequantized, _ = quant.dequantize_experts(params, config)
  x, mask = tokens(seed)
  mesh = mesh_of(2, 4)
  trainable = dict(
    lora=params.lora, shared_lora=params.shared_lora, router_kernel=params.router_kernel
  )
  check_layer(
    lambda t, x, mask: moe_apply(
      params._replace(**t), x, config=config, mesh=mesh, token_mask=mask
    )[0],
    lambda t, x, mask: reference_moe(dequantized._replace(**t), x, float_config, mask),
    trainable,
    x,
    mask,
    seed=seed + 2,
  )


def test_a_new_adapter_changes_nothing_and_trains_alone(request):
  """PEFT's initialization (B = 0) leaves the layer's output exactly the base layer's; an
  optimizer over `nnx.LoRAParam` lowers the loss and leaves every base weight as it was."""
  mesh = mesh_of(2, 4)
  seed = seed_of(request.node.name)
  layer = MoELayer(BASE, mesh=mesh, rngs=nnx.Rngs(seed))
  base = MoELayer(dataclasses.replace(BASE, lora_rank=0), mesh=mesh, rngs=nnx.Rngs(seed))
  x, _ = tokens(seed)
  chex.assert_trees_all_equal(layer(x), base(x))
  assert not np.any(np.asarray(layer.lora.gate_up_b[...])) and np.any(layer.lora.gate_up_a[...])
  assert layer.lora.gate_up_a[...].sharding.spec[0] == "expert"
  optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.LoRAParam)
  target = jnp.tanh(x)
  adapters_only = nnx.DiffState(0, nnx.LoRAParam)

  @nnx.jit
  def step(layer, optimizer):
    loss_of = lambda layer: jnp.mean((layer(x) - target) ** 2)
    loss, grads = nnx.value_and_grad(loss_of, argnums=adapters_only)(layer)
    optimizer.update(layer, grads)
    return loss

  before = nnx.state(layer, nnx.Not(nnx.LoRAParam))
  losses = [float(step(layer, optimizer)) for _ in range(15)]
  assert losses[-1] < 0.8 * losses[0], losses
  chex.assert_trees_all_equal(nnx.state(layer, nnx.Not(nnx.LoRAParam)), before)


@pytest.mark.parametrize("path", ["tile_loop", "ragged_dot"])
def test_adapter_gradients_compute_no_base_weight_gradient(path, request, monkeypatch):
  """Differentiating the adapters only, the compiled program builds no buffer shaped like a
  device's base expert weights (the full gradient does: its accumulator)."""
  mesh = mesh_of(2, 4)
  config = dataclasses.replace(BASE, expert_backend="xla")
  expect_path(config, path, monkeypatch)
  params = with_adapters(config, jax.random.key(seed_of(request.node.name)))
  x, mask = tokens(0)
  loss = lambda adapters, params: jnp.sum(
    moe_apply(params._replace(lora=adapters), x, config=config, mesh=mesh, token_mask=mask)[0] ** 2
  )
  local = "f32[2,64,128]"  # El = 2 experts' w_gate_up on each device
  computed = lambda argnums: _ops_producing(
    jax.jit(jax.grad(loss, argnums=argnums)).lower(params.lora, params).compile().as_text(), local
  )
  assert {"dynamic-update-slice", "broadcast"} & set(computed((0, 1)))  # the check can fail
  assert set(computed(0)) <= {"parameter", "get-tuple-element", "tuple", "copy"}, computed(0)


def _ops_producing(hlo: str, shape: str) -> collections.Counter:
  """How many instructions of each opcode produce an array of `shape` (e.g. "f32[2,64,128]")."""
  found = collections.Counter()
  for match in re.finditer(r"= (\w+\[[\d,]*\])\S* ([\w-]+)\(", hlo):
    if match.group(1) == shape:
      found[match.group(2)] += 1
  return found


@pytest.mark.parametrize("expert_quant", [None, "nvfp4"], ids=["float", "nvfp4"])
def test_merge_computes_what_the_adapters_do(expert_quant, request):
  """The merged layer (no adapters, float weights) gives the adapted layer's output (over
  float experts, and over NVFP4 ones: adapters on a quantized base)."""
  seed = seed_of(request.node.name)
  config = dataclasses.replace(BASE, quant_block_size=(32, 32))
  params = with_adapters(config, jax.random.key(seed))
  if expert_quant:
    params, config = quant.quantize_experts(params, config, expert_quant)
  merged, merged_config = lora.merge(params, config)
  assert merged.lora is None and merged.shared_lora is None
  assert merged_config.lora_rank == 0 and merged_config.expert_quant is None
  x, mask = tokens(seed)
  adapted = moe_apply(params, x, config=config, token_mask=mask)[0]
  chex.assert_trees_all_close(
    moe_apply(merged, x, config=merged_config, token_mask=mask)[0], adapted, **tolerance()
  )


class TestErrors:
  def params(self, **changes):
    return with_adapters(BASE, jax.random.key(0))._replace(**changes)

  @pytest.mark.parametrize(
    "change, message",
    [
      ("drop", r"params.lora must be a moejax.lora.ExpertLoRA, got None"),
      ("shape", r"params.lora.down_b has shape \(8, 4, 63\), expected \(8, 4, 64\)"),
      ("int", r"params.lora.gate_up_a must be floating, got int32"),
    ],
  )
  def test_adapters_that_do_not_fit(self, change, message):
    params = self.params()
    adapters = {
      "drop": None,
      "shape": params.lora._replace(down_b=jnp.ones((8, 4, 63))),
      "int": params.lora._replace(gate_up_a=jnp.ones((8, 64, 4), jnp.int32)),
    }[change]
    with pytest.raises(ValueError, match=message):
      moe_apply(params._replace(lora=adapters), jnp.ones((4, 64)), config=BASE)

  def test_adapters_without_a_rank(self):
    config = dataclasses.replace(BASE, lora_rank=0)
    with pytest.raises(ValueError, match=r"params\.lora is given but the config has no adapters"):
      moe_apply(self.params(shared_lora=None), jnp.ones((4, 64)), config=config)

  def test_fsdp_needs_the_rank_split_over_data(self):
    config = dataclasses.replace(BASE, lora_rank=3, expert_fsdp=True)
    with pytest.raises(ValueError, match=r"lora.gate_up_b \(8, 3, 128\) along dim 1"):
      MoELayer(config, mesh=mesh_of(2, 4), rngs=nnx.Rngs(0))


def test_a_scanned_stack_trains_its_adapters_alone(request):
  """Adapters stack with their layers (`nnx.vmap`, FSDP included): the scanned stack equals
  the loop of its layers' calls, and trains its adapters alone."""
  config = dataclasses.replace(
    BASE, expert_fsdp=True, num_shared_experts=0, shared_intermediate_size=0
  )
  mesh = mesh_of(2, 4)
  stack = Stack(
    {nnx.PARTITION_NAME: None},
    rngs=nnx.Rngs(seed_of(request.node.name)),
    config=config,
    mesh=mesh,
    layers=3,
  )
  shard_model(stack, mesh)
  assert stack.layers.lora.gate_up_b[...].sharding.spec == P(None, "expert", "data", None)
  x, _ = tokens(seed_of(request.node.name), count=32)
  optimizer = nnx.Optimizer(stack, optax.adam(1e-2), wrt=nnx.LoRAParam)

  @nnx.jit
  def step(stack, optimizer):
    loss_of = lambda stack: jnp.mean((stack(x) - jnp.sin(x)) ** 2)
    loss, grads = nnx.value_and_grad(loss_of, argnums=nnx.DiffState(0, nnx.LoRAParam))(stack)
    optimizer.update(stack, grads)
    return loss

  losses = [float(step(stack, optimizer)) for _ in range(5)]
  assert losses[-1] < losses[0], losses
  looped = x
  for layer in range(3):
    params = layer_of(stack.layers.moe_params(), layer)
    looped = looped + moe_apply(params, looped, config=config, mesh=mesh)[0]
  chex.assert_trees_all_close(stack(x), looped, **tolerance())


def test_replicas_hold_their_experts_adapters(request):
  """With redundant experts each replica computes with its expert's adapters (`eplb.place`
  moves them with the weights; `eplb.sum_replicas` sums their gradients into the logical
  expert's): the reference's output and gradients, and a rebalanced layer's output is the
  one before, adapters moved with the weights."""
  seed = seed_of(request.node.name)
  config = MoEConfig(
    num_experts=8,
    top_k=2,
    hidden_size=16,
    intermediate_size=16,
    chunk_size=4,
    num_redundant_experts=8,
    dispatch="all_to_all",
    lora_rank=2,
  )
  logical = dataclasses.replace(config, num_redundant_experts=0)
  placement = initial_placement(8, 8)
  x = jax.random.normal(jax.random.key(seed), (24, 16))
  mask = jnp.arange(24) % 4 != 1
  mesh = mesh_of(2, 4)
  params = with_adapters(logical, jax.random.key(seed))
  check_against_reference(params, x, config, mesh, mask, seed=seed, placement=placement)
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(seed))
  _load(layer, eplb.place(params, placement, config))
  before = layer(x, mask)
  layer.rebalance(np.arange(1.0, 9.0) ** 3)  # expert 7 the busiest: it gets replicas
  moved = eplb.Placement(*layer.placement.get_value())
  assert not np.array_equal(moved.physical_to_logical, placement.physical_to_logical)
  chex.assert_trees_all_close(layer(x, mask), before, **tolerance())
  adapters = jax.device_get(layer.lora.get_value())
  placed = jax.tree.map(lambda a: a[moved.physical_to_logical], params.lora)
  chex.assert_trees_all_equal(adapters, placed)


def _load(layer: MoELayer, params) -> None:
  """Sets the layer's parameters and adapters to `params`, each on the devices of the value
  it replaces."""
  variables = [(getattr(layer, name), getattr(params, name)) for name in param_shapes(layer.config)]
  for name in ("lora", "shared_lora"):
    if getattr(params, name) is None:
      continue
    adapters = getattr(layer, name)
    variables += [
      (getattr(adapters, f), v)
      for f, v in zip(adapters.kind._fields, getattr(params, name), strict=True)
    ]
  for variable, value in variables:
    variable.set_value(jax.device_put(value, variable.get_value().sharding))


def test_linen_rebalance_moves_the_adapters(request):
  """In a Linen model the adapters sit in the `LoRAParam` collection; `linen.rebalance` moves
  them with the weights: each slot's adapter is its new expert's, the output unchanged."""
  config = MoEConfig(
    num_experts=4,
    top_k=2,
    hidden_size=8,
    intermediate_size=16,
    lora_rank=2,
    num_redundant_experts=2,
  )
  module = moe_linen(config)
  x = jax.random.normal(jax.random.key(seed_of(request.node.name)), (6, 8))
  variables = nn.unbox(module.init(jax.random.key(0), x))
  old = np.asarray(variables["ExpertPlacement"]["placement"]["physical_to_logical"])
  logical_b = np.asarray(jax.random.normal(jax.random.key(1), (4, 2, 32)))  # [E, r, 2F]
  variables["LoRAParam"]["lora"]["gate_up_b"] = jnp.asarray(logical_b[old])  # replicas equal
  before = module.apply(variables, x)
  moved, new = linen.rebalance(variables, config, load=np.array([1.0, 1.0, 1.0, 9.0]))
  assert not np.array_equal(new.physical_to_logical, old)
  chex.assert_trees_all_equal(
    moved["LoRAParam"]["lora"]["gate_up_b"], logical_b[new.physical_to_logical]
  )
  chex.assert_trees_all_close(module.apply(moved, x), before, **tolerance())


@pytest.mark.parametrize("base", ["bf16", "fp8_block"])
def test_the_adapted_grouped_matmul_mlp_lowers_to_mosaic_gpu_kernels(base):
  """On the Pallas path the adapters are rank-r grouped matmuls of their own (r = 4, padded to
  the kernel's blocks): forward and gradient lower for cuda to Mosaic GPU kernels only."""
  spec = jax.ShapeDtypeStruct
  groups, rows, dim, width, rank = 4, 256, 128, 256, 4
  w_gate_up, w_down = (groups, dim, 2 * width), (groups, width, dim)
  if base == "bf16":
    matrices = spec(w_gate_up, jnp.bfloat16), spec(w_down, jnp.bfloat16)
  else:
    matrices = block_scaled_spec(w_gate_up, base), block_scaled_spec(w_down, base)
  shapes = dict(num_experts=groups, hidden_size=dim, intermediate_size=width, lora_rank=rank)
  adapter_shapes = call_record(dataclasses.replace(BASE, **shapes)).lora
  adapters = ExpertLoRA(*(spec(e.shape, jnp.bfloat16) for e in adapter_shapes))

  def loss(x, adapters, matrices, group_sizes):
    experts = ExpertWeights(*matrices, lora=adapters)
    gmm = functools.partial(kernels_pallas.gmm, group_sizes=group_sizes, implementation="mosaic")
    out = adapted_mlp(x, experts, jnp.ones(rows), GatedActivation("silu"), gmm)
    return jnp.sum(out**2)

  args = (spec((rows, dim), jnp.bfloat16), adapters, matrices, spec((groups,), jnp.int32))
  mlir = cuda_custom_calls(jax.grad(loss, argnums=(0, 1)), *args)
  kernels = re.findall(r"custom_call @(\S+)\(", mlir)
  # Forward: 6 grouped matmuls; backward at least as many (d(rows) of each, d(A) and d(B) as
  # tgmms; a lowering may share one kernel between identical calls).
  assert len(kernels) >= 12 and set(kernels) == {"mosaic_gpu_v2"}, kernels
  assert "ragged_dot" not in mlir
