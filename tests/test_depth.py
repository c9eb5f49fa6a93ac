"""Stacks of MoE layers as deep models build them (`nnx.vmap` to create, `nnx.scan` to apply):
placed by their metadata without silent mis-sharding, equal to unrolled layers (forward,
gradients, aux losses), rebalanced layer by layer, and holding no copy of a layer's weights
for the backward pass."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

from moejax import MoEConfig, MoELayer, eplb, linen, param_shapes
from moejax.expert_placement import logical_load
from moejax.models import MoETransformer, TransformerConfig, shard_model
from moejax.train import LossWeights, loss_fn, summed_aux
from tests.helpers import assert_close, mesh_of, seed_of, slow, tolerance
from tests.stacks import CONFIG, LAYERS, Stack


class Unrolled(nnx.Module):
  """The same layers as a list, weights copied from a `Stack`."""

  def __init__(self, stack: Stack):
    self.layers = nnx.List([MoELayer(CONFIG, rngs=nnx.Rngs(0)) for _ in range(LAYERS)])
    for i, layer in enumerate(self.layers):
      for name in param_shapes(CONFIG):
        getattr(layer, name).set_value(getattr(stack.layers, name).get_value()[i])

  def __call__(self, x):
    for layer in self.layers:
      x = x + layer(x)
    return x


def test_a_stack_without_layer_metadata_is_refused_not_mis_sharded():
  """Without `transform_metadata` a stacked weight [layers, E, D, 2F] keeps the spec of one layer,
  ("expert", None, None): placed as is it would split the layer axis over "expert"."""
  with pytest.raises(
    ValueError, match=r"layers\.\w+: .* rank \d, the array .* rank \d.*transform_metadata"
  ):
    shard_model(Stack(None, rngs=nnx.Rngs(0)), mesh_of(2, 4))


@pytest.mark.parametrize("layer_axis", [None, "layers"])
def test_a_stack_with_its_layer_axis_named_none_or_layers_is_placed(layer_axis):
  stack = Stack({nnx.PARTITION_NAME: layer_axis}, rngs=nnx.Rngs(0))
  shard_model(stack, mesh_of(2, 4))
  weight = stack.layers.w_gate_up.get_value()
  chex.assert_shape(weight, (LAYERS, 8, 16, 64))
  assert weight.sharding.spec == P(None, "expert", None, None), weight.sharding


def test_scanned_aux_losses_sum_as_unrolled(request):
  """A scanned stack equals the unrolled layers, and `summed_aux` gives the same losses and
  per-layer expert counts for both (collect_aux: one [layers] entry against one [] entry per
  layer)."""
  stack = Stack({nnx.PARTITION_NAME: None}, rngs=nnx.Rngs(seed_of(request.node.name) % 2**31))
  unrolled = Unrolled(stack)
  x = jax.random.normal(jax.random.key(1), (24, CONFIG.hidden_size))
  y_stack, stacked = nnx.capture(stack, nnx.Intermediate)(x)
  y_unrolled, each = nnx.capture(unrolled, nnx.Intermediate)(x)
  chex.assert_trees_all_close(y_stack, y_unrolled, **tolerance())
  got, want = summed_aux(stacked), summed_aux(each)
  chex.assert_shape(got["expert_counts"], (LAYERS, CONFIG.num_experts))
  chex.assert_trees_all_close(got, want, **tolerance())
  assert float(got["load_balancing_loss"]) > LAYERS * 0.5  # three layers' losses, each ~1


def _unrolled_value(stacked: dict, path: tuple, moe_every: int) -> jax.Array:
  """The value at an unrolled `MoETransformer`'s `path` in a scanned one's flat state: block i
  is group i // moe_every's dense (first of two) or moe block."""
  if path[0] != "blocks":
    return stacked[path].get_value()
  group, within = divmod(path[1], moe_every)
  role = "moe" if within == moe_every - 1 else "dense"
  return stacked[("blocks", "groups", role, *path[2:])].get_value()[group]


def test_the_transformer_config_refuses_what_it_cannot_scan_or_remat():
  with pytest.raises(ValueError, match="scan_layers must be a bool, got 'yes'"):
    TransformerConfig(vocab_size=32, num_layers=2, num_heads=2, moe=CONFIG, scan_layers="yes")
  with pytest.raises(ValueError, match=r"num_layers must be an int, got 2\.0"):
    TransformerConfig(vocab_size=32, num_layers=2.0, num_heads=2, moe=CONFIG)
  with pytest.raises(ValueError, match="vocab_size must be a positive int, got 0"):
    TransformerConfig(vocab_size=0, num_layers=2, num_heads=2, moe=CONFIG)
  with pytest.raises(TypeError, match=r"moe must be a moejax\.MoEConfig, got dict"):
    TransformerConfig(vocab_size=32, num_layers=2, num_heads=2, moe={})
  with pytest.raises(ValueError, match="moe_every=2 blocks: num_layers=3 must divide by it"):
    TransformerConfig(
      vocab_size=32, num_layers=3, num_heads=2, moe=CONFIG, moe_every=2, scan_layers=True
    )
  with pytest.raises(TypeError, match=r"remat_policy must be None or a jax\.checkpoint policy"):
    TransformerConfig(vocab_size=32, num_layers=2, num_heads=2, moe=CONFIG, remat_policy="full")


def test_scanned_transformer_equals_the_unrolled_one(request):
  """`TransformerConfig(scan_layers=True)` (dense and MoE blocks alternating, on the 2x4 mesh)
  gives the unrolled model's loss, aux losses and gradients, its weights copied in."""
  mesh = mesh_of(2, 4)
  moe = dataclasses.replace(CONFIG, chunk_size=8)
  config = TransformerConfig(
    vocab_size=32,
    num_layers=4,
    num_heads=2,
    moe=moe,
    moe_every=2,
    dense_ffn_size=24,
    scan_layers=True,
  )
  key = jax.random.key(seed_of(request.node.name))
  scanned = MoETransformer(config, mesh=mesh, rngs=nnx.Rngs(seed_of(request.node.name) % 2**31))
  unrolled = MoETransformer(
    dataclasses.replace(config, scan_layers=False), mesh=mesh, rngs=nnx.Rngs(0)
  )
  shard_model(scanned, mesh)
  weight = scanned.blocks.groups.moe.ffn.w_gate_up.get_value()
  assert weight.sharding.spec == P(None, "expert", None, None), weight.sharding
  stacked = dict(nnx.to_flat_state(nnx.state(scanned, nnx.Param)))
  for path, variable in nnx.to_flat_state(nnx.state(unrolled, nnx.Param)):
    variable.set_value(_unrolled_value(stacked, path, config.moe_every))
  tokens = jax.random.randint(key, (4, 8), 0, config.vocab_size)
  mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.75, (4, 8))
  grad_fn = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True), static_argnums=4)
  (loss, metrics), grads = grad_fn(scanned, tokens, tokens, mask, LossWeights())
  (want_loss, want_metrics), want_grads = grad_fn(unrolled, tokens, tokens, mask, LossWeights())
  chex.assert_trees_all_close((loss, metrics), (want_loss, want_metrics), **tolerance())
  chex.assert_shape(metrics["expert_counts"], (2, 8))
  stacked_grads = dict(nnx.to_flat_state(grads))
  for path, grad in nnx.to_flat_state(want_grads):
    got = _unrolled_value(stacked_grads, path, config.moe_every)
    assert_close(got, grad.get_value(), what=".".join(map(str, path)))


def _moved_as_placed(before: np.ndarray, after: np.ndarray, old, new) -> None:
  """Layer i's slot p holds, after the move, what expert new[i, p]'s first slot held."""
  for i in range(len(before)):
    first = [
      int(np.flatnonzero(old.physical_to_logical[i] == e)[0]) for e in new.physical_to_logical[i]
    ]
    np.testing.assert_array_equal(after[i].view(np.uint8), before[i][first].view(np.uint8))


def test_a_stacked_layer_rebalances_each_layer_by_its_own_load(request):
  """`MoELayer.rebalance()` on an `nnx.vmap` stack on the 2x4 mesh: DeepSeek's placement of
  each layer's counted load, each layer's weights moved, the load zeroed, the output kept, and
  the next step compiles nothing."""
  mesh = mesh_of(2, 4)
  config = dataclasses.replace(CONFIG, chunk_size=8, num_redundant_experts=4)
  stack = Stack({nnx.PARTITION_NAME: "layers"}, rngs=nnx.Rngs(0), config=config, mesh=mesh)
  shard_model(stack, mesh)
  x = jax.random.normal(jax.random.key(seed_of(request.node.name)), (64, 16))
  graphdef, state = nnx.split(stack)

  @jax.jit
  def step(state, x):
    stack = nnx.merge(graphdef, state)
    return stack(x), nnx.state(stack)  # the counted load in the state

  before = stack.layers.w_gate_up.get_value()
  y, counted = step(state, x)
  nnx.update(stack, counted)
  step(nnx.state(stack), x)  # the signature of every later step: the state as steps return it
  compiled = step._cache_size()
  load = jax.device_get(stack.layers.expert_load.get_value())  # [LAYERS, P]
  old = jax.device_get(stack.layers.placement.get_value())
  with pytest.raises(ValueError, match=r"load has shape \(8,\), expected \(3, 8\) \(\[layers, E\]"):
    stack.layers.rebalance(np.ones(8))  # one layer's load for a stack of three
  new = stack.layers.rebalance()
  expected = eplb.rebalance(logical_load(load, old), num_physical=12, num_devices=4)
  chex.assert_trees_all_equal(jax.device_get(new), expected)
  assert not np.array_equal(new.physical_to_logical, old.physical_to_logical)
  after = stack.layers.w_gate_up.get_value()
  assert after.sharding.is_equivalent_to(before.sharding, after.ndim), after.sharding
  _moved_as_placed(np.asarray(before), np.asarray(after), old, expected)
  np.testing.assert_array_equal(stack.layers.expert_load.get_value(), np.zeros_like(load))
  y_after, _ = step(nnx.state(stack), x)
  assert_close(y_after, y, what="after vs before rebalance")
  assert step._cache_size() == compiled


class LinenStep(nn.Module):
  """One step of an `nn.scan` stack: a residual `moe_linen` layer."""

  config: MoEConfig

  @nn.compact
  def __call__(self, x, _):
    return x + linen.moe_linen(self.config, name="moe")(x), None


def test_a_quantized_linen_stack_rebalances_each_layer_by_its_own_load(request):
  """`linen.rebalance` on an `nn.scan` stack of NVFP4 layers with redundant experts: each
  layer placed by its own counted load, its values, scales and global scales moved, the
  output kept."""
  config = dataclasses.replace(
    CONFIG, hidden_size=32, chunk_size=8, num_redundant_experts=4, expert_quant="nvfp4"
  )
  stack = nn.scan(LinenStep, variable_axes={True: 0}, split_rngs={"params": True}, length=LAYERS)(
    config, name="layers"
  )
  key = jax.random.key(seed_of(request.node.name))
  x = jax.random.normal(key, (48, 32))
  variables = stack.init(jax.random.fold_in(key, 1), x, None)
  (y, _), counted = stack.apply(variables, x, None, mutable=["ExpertLoad"])
  variables = {**variables, **counted}
  own = lambda variables, collection: nn.unbox(variables)[collection]["moe"]
  load = np.asarray(own(counted, "ExpertLoad")["expert_load"])  # [LAYERS, P]
  placed = own(variables, "ExpertPlacement")["placement"]
  old = eplb.Placement(*(np.asarray(placed[field]) for field in eplb.Placement._fields))
  moved, new = linen.rebalance(variables, config, path=("moe",))
  expected = eplb.rebalance(logical_load(load, old), num_physical=12, num_devices=1)
  chex.assert_trees_all_equal(new, expected)
  assert not np.array_equal(new.physical_to_logical, old.physical_to_logical)
  for part in ("values", "scales", "global_scale"):
    before = np.asarray(own(variables, "QuantizedWeight")["w_down"][part])
    after = np.asarray(own(moved, "QuantizedWeight")["w_down"][part])
    _moved_as_placed(before, after, old, expected)
  assert_close(stack.apply(moved, x, None)[0], y, what="after vs before rebalance")


def _training_temp_bytes(layers: int, config: MoEConfig, mesh) -> int:
  """Compiled temp of the gradient of a scanned stack on `mesh` (512 tokens; nothing runs)."""
  stack = Stack(
    {nnx.PARTITION_NAME: None}, rngs=nnx.Rngs(0), config=config, mesh=mesh, layers=layers
  )
  shard_model(stack, mesh)
  graphdef, state = nnx.split(stack)
  x = jax.ShapeDtypeStruct((512, config.hidden_size), jnp.float32)
  loss = lambda state, x: jnp.sum(nnx.merge(graphdef, state)(x) ** 2)
  compiled = jax.jit(jax.grad(loss)).lower(state, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
  "expert_fsdp", [slow(False, id="replicated"), pytest.param(True, id="fsdp")]
)
def test_a_scanned_stack_keeps_no_copy_of_its_weights_for_the_backward_pass(expert_fsdp):
  """Training a scanned stack on the 2x4 mesh without remat, each added layer grows the
  compiled temp by at most a quarter of its local expert weights: the backward pass reads
  the layer's slice of the stacked parameters, not a per-layer copy (the chunk loop saves
  its weights as given and prepares them again). With expert_fsdp, a quarter of a layer's
  gathered weights: the stack holds one layer's gathered weights at a time."""
  config = MoEConfig(
    num_experts=8,
    top_k=2,
    hidden_size=128,
    intermediate_size=256,
    chunk_size=128,
    expert_fsdp=expert_fsdp,
  )
  mesh = mesh_of(2, 4)
  shapes = param_shapes(config)  # float32 [E, D, 2F] and [E, F, D], a quarter per device
  local_expert_bytes = 4 * (np.prod(shapes["w_gate_up"]) + np.prod(shapes["w_down"])) / 4
  temps = {layers: _training_temp_bytes(layers, config, mesh) for layers in (2, 4, 8)}
  growth = [(temps[4] - temps[2]) / 2, (temps[8] - temps[4]) / 4]
  assert max(growth) <= 0.25 * local_expert_bytes, (temps, local_expert_bytes)
