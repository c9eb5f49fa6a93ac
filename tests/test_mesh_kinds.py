"""Every public function on the meshes users make: explicit axes (`jax.make_mesh`'s default)
and automatic ones, called inside `jax.set_mesh` and outside it, on inputs split over the
data axis as a user's batch is. Each result equals what the same call gives on one device
(or the reference). The fast tier runs explicit axes outside `jax.set_mesh` (JAX's default,
and the kind with the least context; the automatic ones are what the rest of the suite
uses), the slow tier all four."""

import contextlib
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moejax
from moejax import (
  MoELayer,
  MoEParams,
  checkpoint,
  eplb,
  hf,
  linen,
  lora,
  moe_apply,
  reference_moe,
)
from moejax.models import MoETransformer, TransformerConfig, shard_model
from moejax.stacking import layer_of
from moejax.testing import poison
from moejax.train import train_step
from tests.helpers import SMALL_SHARED, assert_close, random_adapters, seed_of, slow
from tests.hf_checkpoints import write_checkpoint

CONFIG = SMALL_SHARED

MESH_KINDS = [
  slow((AxisType.Explicit, True), id="explicit-in-set_mesh"),
  pytest.param((AxisType.Explicit, False), id="explicit"),
  slow((AxisType.Auto, True), id="auto-in-set_mesh"),
  slow((AxisType.Auto, False), id="auto"),
]


@pytest.fixture(params=MESH_KINDS)
def mesh(request):
  """The 2x4 (data, expert) mesh of the kind asked, set as the current mesh or not."""
  axis_type, inside = request.param
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
  with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
    yield mesh


def batch_of(mesh, *arrays):
  """`arrays` split over the data axis along their first dimension, as a user's batch."""
  return [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in arrays]


def random_batch(seed: int):
  """x [4, 6, D] and a mask [4, 6] with one sequence empty, one full."""
  x = jax.random.normal(jax.random.key(seed), (4, 6, CONFIG.hidden_size))
  mask = jnp.arange(6)[None, :] < jnp.array([6, 0, 2, 5])[:, None]
  return x, mask


def test_the_layer_its_gradient_and_moe_apply(mesh, request):
  """On each kind, with the router and shared experts split over the mesh too (shared_fsdp)."""
  seed = seed_of(request.node.name)
  config = dataclasses.replace(CONFIG, shared_fsdp=True)
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(seed))
  x, mask = random_batch(seed)
  xs, masks = batch_of(mesh, poison(x, mask), mask)
  y = layer(xs, token_mask=masks)
  params = layer.moe_params()
  want = reference_moe(params, x, config, mask)
  assert_close(y, want, what="y")
  if mesh.axis_types[0] == AxisType.Explicit:
    assert jax.typeof(y).sharding.spec == jax.typeof(xs).sharding.spec
  applied, aux = moe_apply(params, xs, config=config, mesh=mesh, token_mask=masks)
  assert_close(applied, want, what="moe_apply's y")
  replayed, _ = moe_apply(
    params, xs, config=config, mesh=mesh, token_mask=masks, expert_ids=aux.expert_ids
  )
  assert np.array_equal(replayed, applied), "routing replay of the call's own ids"
  if mesh.axis_types[0] == AxisType.Explicit:  # the ids come back split like the tokens
    assert tuple(jax.typeof(aux.expert_ids).sharding.spec)[:1] == ("data",)
  loss = lambda y: jnp.sum(jnp.where(mask[..., None], y, 0.0) ** 2)
  # Jitted: JAX's eager `grad` on an explicit mesh wants `jax.set_mesh` (for any function).
  grads = nnx.jit(nnx.grad(lambda m: loss(m(xs, token_mask=masks))))(layer)
  host = jax.device_get(params)
  expected = jax.grad(lambda p: loss(reference_moe(p, x, config, mask)))(host)
  for name in ("w_down", "router_kernel", "shared_w_down"):
    assert_close(getattr(grads, name)[...], getattr(expected, name), what=f"d {name}")


def test_the_linen_module(mesh, request):
  seed = seed_of(request.node.name)
  module = linen.moe_linen(CONFIG, mesh=mesh)
  x, mask = random_batch(seed)
  xs, masks = batch_of(mesh, poison(x, mask), mask)
  variables = module.init(jax.random.key(seed), xs, masks)
  y = module.apply(variables, xs, masks)
  params = MoEParams(**jax.device_get(nn.unbox(variables)["params"]))
  assert_close(y, reference_moe(params, x, CONFIG, mask), what="linen's y")


def test_the_linen_module_rebalances(mesh, request):
  seed = seed_of(request.node.name)
  config = dataclasses.replace(CONFIG, num_redundant_experts=8)
  module = linen.moe_linen(config, mesh=mesh)
  x, mask = random_batch(seed)
  xs, masks = batch_of(mesh, x, mask)
  variables = module.init(jax.random.key(seed), xs, masks)
  before, counted = module.apply(variables, xs, masks, mutable=["ExpertLoad"])
  variables, _ = linen.rebalance({**variables, **counted}, config)
  assert_close(module.apply(variables, xs, masks), before, what="linen's y after rebalancing")


def test_rebalancing_and_summing_replicas(mesh, request):
  """`layer.rebalance` (EPLB on the counted load, the weights moved over the mesh),
  `eplb.place` and `eplb.sum_replicas` on weights and gradients split over the expert axis."""
  seed = seed_of(request.node.name)
  config = dataclasses.replace(CONFIG, num_redundant_experts=8)
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(seed))
  x, mask = random_batch(seed)
  xs, masks = batch_of(mesh, x, mask)
  before = layer(xs, token_mask=masks)
  placement = layer.rebalance()
  assert_close(layer(xs, token_mask=masks), before, what="y after rebalancing")
  params = layer.moe_params()
  host = jax.device_get(params)
  moved = eplb.place(params, placement, config, current=placement)
  chex.assert_trees_all_equal(jax.device_get(moved), host)
  summed = eplb.sum_replicas(params, placement)
  chex.assert_trees_all_close(jax.device_get(summed), eplb.sum_replicas(host, placement), rtol=1e-6)


def test_merging_adapters(mesh, request):
  config = dataclasses.replace(CONFIG, lora_rank=2)
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(seed_of(request.node.name)))
  params = layer.moe_params()
  merged, merged_config = lora.merge(params, config)
  want, _ = lora.merge(jax.device_get(params), config)
  chex.assert_trees_all_close(jax.device_get(merged), want, rtol=1e-6)
  assert merged_config.lora_rank == 0
  # Adapters on the other kind of mesh (as ones created on one device come back from a
  # jitted training step over quantized weights: on the compiler's automatic mesh).
  other = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
  adapters = jax.device_put(params.lora, NamedSharding(other, P("expert")))
  mixed, _ = lora.merge(params._replace(lora=adapters), config)
  chex.assert_trees_all_close(jax.device_get(mixed), want, rtol=1e-6)


def test_loading_a_checkpoint_and_adapters_onto_the_mesh(mesh, tmp_path, request):
  """`hf.load_layer`, `hf.load_stack` and `hf.load_lora` with `mesh=`: what the host gets."""
  hf_config, _ = write_checkpoint(tmp_path, "qwen3_moe", layer=1)
  host = hf.load_layer(tmp_path, 1)
  on_mesh = hf.load_layer(tmp_path, 1, mesh=mesh)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, on_mesh), host)
  assert on_mesh.w_gate_up.sharding.mesh == mesh
  stack = hf.load_stack(tmp_path, layers=(1, 1), mesh=mesh, progress=False)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, layer_of(stack, 1)), host)
  config = hf.config_from_hf(hf_config, lora_rank=2)
  expert, _ = random_adapters(config, jax.random.key(seed_of(request.node.name)))
  hf.save_lora(
    tmp_path / "adapter", {1: host._replace(lora=expert)}, config, model_type="qwen3_moe"
  )
  adapters = hf.load_lora(tmp_path / "adapter", 1, config, model_type="qwen3_moe", mesh=mesh)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, adapters.lora), expert, rtol=1e-6)


def test_a_transformer_trains_and_checkpoints(mesh, tmp_path, request):
  """One optimizer step of `MoETransformer` on a batch split over data (the embedding's gather
  included), its loss the one-device model's; saved, then restored into a fresh model."""
  seed = seed_of(request.node.name)
  config = TransformerConfig(vocab_size=32, num_layers=2, num_heads=2, moe=CONFIG)

  def step(mesh):
    model = MoETransformer(config, mesh=mesh, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(seed), (4, 6), 0, 32)
    mask = random_batch(seed)[1]
    if mesh is not None:
      shard_model(model, mesh)
      shard_model(optimizer, mesh)
      tokens, mask = batch_of(mesh, tokens, mask)
    return model, optimizer, train_step(model, optimizer, tokens, tokens, mask)

  model, optimizer, metrics = step(mesh)
  assert_close(metrics["loss"], step(None)[2]["loss"], what="loss")
  checkpoint.save(tmp_path / "ckpt", model, optimizer, step=1)
  restored = MoETransformer(config, mesh=mesh, rngs=nnx.Rngs(seed + 1))
  shard_model(restored, mesh)
  checkpoint.restore(tmp_path / "ckpt", restored)
  chex.assert_trees_all_equal(
    jax.device_get(nnx.state(restored, nnx.Param)), jax.device_get(nnx.state(model, nnx.Param))
  )


@pytest.mark.parametrize(
  "axis_type", [AxisType.Explicit, slow(AxisType.Auto)], ids=lambda kind: kind.name.lower()
)
def test_the_ambient_mesh_when_no_mesh_is_passed(axis_type, request):
  """Under `jax.set_mesh`, `mesh=` may be left out: the layer, `moe_apply` (eager and inside
  `jax.jit`, where only the abstract mesh is visible) and the Linen module take the ambient
  mesh; a different mesh passed beside it is an error naming both."""
  seed = seed_of(request.node.name)
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
  x, mask = random_batch(seed)
  with jax.set_mesh(mesh):
    layer = MoELayer(CONFIG, rngs=nnx.Rngs(seed))
    assert layer.mesh == mesh
    params = layer.moe_params()
    want = reference_moe(params, x, CONFIG, mask)
    xs, masks = batch_of(mesh, poison(x, mask), mask)
    assert_close(layer(xs, token_mask=masks), want, what="layer")
    in_jit = jax.jit(lambda p, x, m: moe_apply(p, x, config=CONFIG, token_mask=m)[0])
    assert_close(in_jit(params, xs, masks), want, what="moe_apply under jit")
    module = linen.moe_linen(CONFIG)
    variables = module.init(jax.random.key(seed), xs, masks)
    linen_params = MoEParams(**jax.device_get(nn.unbox(variables)["params"]))
    want_linen = reference_moe(linen_params, x, CONFIG, mask)
    assert_close(module.apply(variables, xs, masks), want_linen, what="linen")
    other = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(axis_type,) * 2)
    with pytest.raises(ValueError, match=r"mesh=.*'data': 4.* differs from the ambient mesh"):
      moe_apply(params, x, config=CONFIG, mesh=other)


def test_an_eager_gradient_on_explicit_axes_of_tokens_made_off_the_mesh(request):
  """Under `jax.set_mesh` of explicit axes, eager `jax.grad` (no jit) of a loss in which tokens
  made off the mesh feed the caller's own code (a router) and `moejax.moe_mlp`: every
  gradient equals the one-device one. (JAX before 0.12 returned the cotangent of an
  `auto_axes` input typed for its automatic mesh, which the caller's code cannot add to.)"""
  keys = jax.random.split(jax.random.key(seed_of(request.node.name)), 4)
  e, k, d, f = CONFIG.num_experts, CONFIG.top_k, CONFIG.hidden_size, CONFIG.intermediate_size
  args = (
    jax.random.normal(keys[0], (4, 6, d)),  # x [B, T, D], on no mesh
    jax.random.normal(keys[1], (d, e)),
    jax.random.normal(keys[2], (e, d, 2 * f)) / d**0.5,
    jax.random.normal(keys[3], (e, f, d)) / f**0.5,
  )

  def loss(x, w_router, w_gate_up, w_down):
    logits = x @ w_router
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits), k)
    y, _ = moejax.moe_mlp(x, ids, weights, w_gate_up, w_down)
    return jnp.sum(y * x) + jnp.sum(logits**2)

  grads = jax.grad(loss, argnums=(0, 1, 2, 3))
  want = grads(*args)
  with jax.set_mesh(jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)):
    got = grads(*args)
  for name, g, w in zip(("x", "w_router", "w_gate_up", "w_down"), got, want, strict=True):
    assert_close(jax.device_get(g), w, what=f"d {name}")
