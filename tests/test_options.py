"""The model-family options (GPT-OSS, Llama 4, PhiMoE, Qwen2-MoE, LongCat-Flash, tanh GELU)
against the reference: meshes, both dispatch schemes, NaN padding, gradients, the kernels'
fallback."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax import MoEConfig, MoELayer, moe_apply, param_shapes, reference_moe, routing
from moejax.testing import poison, random_params, rank_mask
from tests.helpers import (
  BASE,
  OPTIONS,
  check_layer,
  count_compiles,
  mesh_of,
  seed_of,
  slow,
  tolerance,
)

ROWS_PER_RANK = 9


def make_inputs(config: MoEConfig, name: str):
  key = jax.random.key(seed_of(name))
  params = random_params(config, key)
  x = jax.random.normal(jax.random.fold_in(key, 1), (8 * ROWS_PER_RANK, config.hidden_size))
  probe = jax.random.normal(jax.random.fold_in(key, 2), x.shape)
  return params, 2.0 * x, probe


ALL_AT_ONCE = MoEConfig(
  **{**BASE, "top_k": 3},
  activation="swiglu_oai",
  swiglu_limit=1.5,
  expert_bias=True,
  router_bias=True,
  num_zero_experts=2,
  use_routing_bias=True,
  num_shared_experts=1,
  shared_intermediate_size=8,
  shared_expert_gate=True,
)


@pytest.mark.parametrize("mesh_shape", [None, slow((1, 8)), slow((8, 1)), (4, 2)], ids=str)
def test_options_together_on_every_mesh_and_token_pattern(mesh_shape, request):
  params, x, _ = make_inputs(ALL_AT_ONCE, request.node.name)
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
  layer = jax.jit(lambda p, x, m: moe_apply(p, x, config=ALL_AT_ONCE, mesh=mesh, token_mask=m))
  masks = [rank_mask(c, ROWS_PER_RANK) for c in ([0, 4, 9, 2, 0, 7, 1, 9], [0] * 8, [9] * 8)]
  inputs = [poison(x, mask) for mask in masks]
  expected = [reference_moe(params, x, ALL_AT_ONCE, mask) for mask in masks]
  jax.block_until_ready(layer(params, inputs[0], masks[0]))
  with count_compiles() as compiles:
    got = [layer(params, x, mask) for x, mask in zip(inputs, masks, strict=True)]
    jax.block_until_ready(got)
  assert compiles == [], "one executable for every token pattern"
  for (y, aux), want, mask in zip(got, expected, masks, strict=True):
    chex.assert_trees_all_close(y, want, **tolerance())
    chex.assert_shape(aux.expert_counts, (8 + 2,))
    assert int(aux.expert_counts.sum()) == 3 * int(mask.sum())


def test_zero_experts_return_the_weighted_input(request):
  """Routed only to zero-computation experts, a token's output is its input times the sum of
  its weights: no expert compute, nothing sent."""
  config = MoEConfig(**BASE, num_zero_experts=2, dispatch="all_to_all")
  params, x, _ = make_inputs(config, request.node.name)
  logits = jnp.zeros((x.shape[0], 10)).at[:, 8:].set(20.0)  # both picks: ids 8 and 9
  y, aux = moe_apply(params, x, config=config, mesh=mesh_of(2, 4), router_logits=logits)
  weights = jax.nn.softmax(logits)[:, 8:].sum(-1, keepdims=True)
  chex.assert_trees_all_close(y, weights * x, **tolerance())
  chex.assert_trees_all_equal(np.asarray(aux.dispatch_rows), np.zeros(8, np.int32))


# ZAYA's layer: the logits come with each call; one choice, of 8 experts or the skip class.
ZAYA = MoEConfig(
  **{**BASE, "top_k": 1},
  num_zero_experts=1,
  zero_expert_output="none",
  use_routing_bias=True,
  external_router=True,
  dispatch="all_to_all",
)


def test_an_external_router_and_a_skip_class(request):
  """No router kernel: the logits come with the call and their gradient goes back with it;
  the skip class takes a choice and returns nothing. Against the reference on the 2x4 mesh
  (forward, the gradients of the weights, the logits and x; NaN padding); the tokens that
  chose the skip class get 0; a call without logits is refused."""
  params, x, _ = make_inputs(ZAYA, request.node.name)
  assert params.router_kernel is None
  logits = jax.random.normal(jax.random.key(seed_of(request.node.name)), (x.shape[0], 9))
  logits = logits.at[::3, 8].add(4.0)  # every third token's skip class far ahead
  mask, mesh = rank_mask([3, 9, 0, 5, 1, 0, 9, 2], ROWS_PER_RANK), mesh_of(2, 4)
  ours = lambda p, x, m: moe_apply(
    p[0], x, config=ZAYA, mesh=mesh, token_mask=m, router_logits=p[1]
  )[0]
  theirs = lambda p, x, m: reference_moe(p[0], x, ZAYA, m, router_logits=p[1])
  check_layer(ours, theirs, (params, logits), x, mask, seed=seed_of(request.node.name))
  y, aux = moe_apply(params, x, config=ZAYA, mesh=mesh, token_mask=mask, router_logits=logits)
  skipped = np.asarray(aux.expert_ids[:, 0] == 8) & np.asarray(mask)
  assert skipped.sum() >= 5 and not np.asarray(y)[skipped].any()
  with pytest.raises(ValueError, match=r"no router \(external_router=True\): pass the logits"):
    moe_apply(params, x, config=ZAYA)


# Activations the kernels' epilogues lack, each against the reference on the XLA tile loop.
ONE_SHARED = dict(num_shared_experts=1, shared_intermediate_size=8)
EPILOGUE_LACKS = {
  "gpt_oss": OPTIONS["gpt_oss"],
  "gelu_tanh": OPTIONS["gelu_tanh"],
  # The clamps bind; the shared expert unclamped, as Hunyuan v4's.
  "swiglu_clamped": dict(
    activation="swiglu_clamped", swiglu_limit=1.0, **ONE_SHARED, shared_activation="silu"
  ),
  "swiglu_softcapped": dict(activation="swiglu_softcapped", gate_softcap=0.5, up_softcap=0.8),
  # Step-3.7's: the clamps bind, the shared expert's at a limit of its own.
  "swiglu_clamped_after": dict(
    activation="swiglu_clamped_after",
    swiglu_limit=0.5,
    **ONE_SHARED,
    shared_activation="swiglu_clamped_after",
    shared_swiglu_limit=0.8,
  ),
}


@pytest.mark.parametrize("option", EPILOGUE_LACKS)
def test_pallas_backend_falls_back_to_xla_for_an_epilogue_it_lacks(option, request):
  config = MoEConfig(**{**BASE, **EPILOGUE_LACKS[option]}, expert_backend="pallas")
  params, x, _ = make_inputs(config, request.node.name)
  mask = rank_mask([3, 9, 0, 5, 1, 0, 9, 2], ROWS_PER_RANK)
  with pytest.warns(UserWarning, match="falls back to the XLA tile loop"):
    y, _ = moe_apply(params, x, config=config, mesh=mesh_of(2, 4), token_mask=mask)
  chex.assert_trees_all_close(y, reference_moe(params, x, config, mask), **tolerance())


def test_sparsemixer_weights_follow_the_window():
  """Hand-made logits, eps 0.05: pick 1 = expert 0 (logit 2.0), whose window keeps the logits
  within 2 * 0.05 * 2.0 = 0.2 of it (2.0, 1.9, 1.85; not 1.75). Pick 2 = expert 1 (1.9),
  whose window, 0.19 wide, keeps 1.9, 1.85 and 1.75, pick 1 excluded."""
  config = MoEConfig(**{**BASE, "num_experts": 5}, scoring="sparsemixer", sparsemixer_eps=0.05)
  logits = jnp.array([[2.0, 1.9, 1.85, 1.75, -3.0]])
  params = random_params(config, jax.random.key(0))
  x = jnp.ones((1, 16))
  got = routing.route(logits, jnp.ones(1, bool), config, None)
  chex.assert_trees_all_equal(np.asarray(got.expert_ids), np.array([[0, 1]], np.int32))
  first = np.exp(2.0) / (np.exp(2.0) + np.exp(1.9) + np.exp(1.85))
  second = np.exp(1.9) / (np.exp(1.9) + np.exp(1.85) + np.exp(1.75))
  chex.assert_trees_all_close(
    got.weights, np.array([[first, second]]), **tolerance(comparison="reordered")
  )
  chex.assert_trees_all_close(
    moe_apply(params, x, config=config, router_logits=logits)[0],
    reference_moe(params, x, config, router_logits=logits),
    **tolerance(),
  )


def test_config_options_are_part_of_the_checkpoint_format():
  assert param_shapes(ALL_AT_ONCE) == {
    "router_kernel": (16, 10),
    "w_gate_up": (8, 16, 48),
    "w_down": (8, 24, 16),
    "routing_bias": (10,),
    "shared_w_gate_up": (16, 16),
    "shared_w_down": (8, 16),
    "router_bias": (10,),
    "b_gate_up": (8, 48),
    "b_down": (8, 16),
    "shared_gate_kernel": (16, 1),
  }


def test_layer_creates_the_options_parameters_on_the_mesh(request):
  mesh = mesh_of(2, 4)
  layer = MoELayer(ALL_AT_ONCE, mesh=mesh, rngs=nnx.Rngs(seed_of(request.node.name) % 2**31))
  assert layer.b_gate_up[...].sharding.spec[0] == "expert"
  chex.assert_trees_all_equal(np.asarray(layer.router_bias[...]), np.zeros(10, np.float32))
  x = jax.random.normal(jax.random.key(0), (4, 10, 16))
  mask = jnp.arange(10)[None, :] < jnp.array([10, 3, 0, 7])[:, None]
  params = jax.device_get(layer.moe_params())
  chex.assert_trees_all_close(
    layer(x, mask), reference_moe(params, x, ALL_AT_ONCE, mask), **tolerance()
  )


def test_pallas_backend_without_any_kernel_runs_the_tile_loop_checked(monkeypatch, request):
  """No kernel can run (here: Pallas Triton gone, no Hopper): the layer warns, takes the tile
  loop, and keeps shard_map's varying-axes check on, as for the path it really runs."""
  from kernels_pallas import compat
  from moejax.plan import plan_experts

  monkeypatch.setattr(compat, "pallas_triton", lambda: None)
  config = MoEConfig(**{**BASE, "chunk_size": 3}, expert_backend="pallas")  # traced only here
  with pytest.warns(UserWarning, match="Pallas Triton was removed"):
    plan = plan_experts(config, num_rows=64, local_experts=2)
  assert plan.path == "tile_loop" and plan.check_vma
  params, x, _ = make_inputs(config, request.node.name)
  mask = rank_mask([3, 9, 0, 5, 1, 0, 9, 2], ROWS_PER_RANK)
  with pytest.warns(UserWarning, match="Pallas Triton was removed"):
    y, _ = moe_apply(params, x, config=config, mesh=mesh_of(2, 4), token_mask=mask)
  chex.assert_trees_all_close(y, reference_moe(params, x, config, mask), **tolerance())


@pytest.mark.parametrize("capability", [None, "8.0", "9.0"])
@pytest.mark.parametrize("backend", ["xla", "pallas", "auto"])
def test_expert_biases_always_plan_the_tile_loop(backend, capability, monkeypatch):
  """Only the tile loop and the fused path have expert biases: every other backend on every
  device plans the tile loop for them (the grouped-matmul kernels and ragged_dot would drop
  them), with a warning where kernels were asked."""
  import warnings

  from kernels_pallas import api, platform
  from moejax import plan

  # kernels "faster" from any row count
  monkeypatch.setattr(api, "KERNEL_FASTER_FROM_ROWS", {"mosaic": 0, "triton": 0})
  config = MoEConfig(**{**BASE, "expert_bias": True}, expert_backend=backend)
  device = (
    platform.Target(platform="cpu")
    if capability is None
    else platform.Target(platform="gpu", compute_capability=capability)
  )
  with warnings.catch_warnings(record=True) as caught, platform.targeting(device):
    warnings.simplefilter("always")
    chosen = plan.plan_experts(config, num_rows=64, local_experts=2)
  assert chosen == plan.ExpertPlan(path="tile_loop"), chosen
  if backend == "pallas":
    assert any("expert biases" in str(w.message) for w in caught), caught
