"""Routing replay (`expert_ids=`) beyond the layer contract (which replays on every path and
scheme), and training-time balancing (`moejax.balancing`)."""

from __future__ import annotations

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from moejax import MoEConfig, MoELayer, balancing, moe_apply, quant, reference_moe
from moejax.apps.cli import parser
from moejax.apps.models import MoETransformer, TransformerConfig
from moejax.apps.train import train_step
from moejax.linen import moe_linen
from moejax.testing import poison, random_params
from tests.helpers import BASE, assert_close, mesh_of, random_adapters, seed_of

CONFIG = MoEConfig(**BASE, scoring="sigmoid", renormalize=True, use_routing_bias=True)


def inputs(config: MoEConfig, seed: int, tokens: int = 12):
  key = jax.random.key(seed)
  params = random_params(config, key)
  if config.use_routing_bias:
    params = params._replace(routing_bias=0.1 * jax.random.normal(key, (config.num_experts,)))
  x = jax.random.normal(jax.random.fold_in(key, 1), (tokens, config.hidden_size))
  ids = jnp.asarray(
    np.stack(
      [np.random.default_rng(seed + t).permutation(8)[: config.top_k] for t in range(tokens)]
    )
  )
  return params, x, ids


def test_bad_expert_ids_are_named(request):
  params, x, ids = inputs(CONFIG, seed_of(request.node.name))
  apply = lambda ids, mask=None: moe_apply(
    params, x, config=CONFIG, token_mask=mask, expert_ids=ids
  )
  cases = {
    re.escape("expert_ids has shape (12, 3); expected [..., top_k] = (12, 2)"): jnp.zeros(
      (12, 3), jnp.int32
    ),
    "expert_ids must be integer": ids.astype(jnp.float32),
    r"expert_ids: token \(4,\) has ids \[9, .*outside \[0, 8\)": ids.at[4, 0].set(9),
    r"expert_ids: token \(2,\) .* repeated": ids.at[2, 1].set(ids[2, 0]),
  }
  for message, bad in cases.items():
    with pytest.raises((ValueError, TypeError), match=message):
      apply(bad)
  mask = jnp.arange(12) != 4
  y, _ = apply(ids.at[4, 0].set(-1), mask)  # a masked token's ids are ignored
  chex.assert_trees_all_equal(y[4], jnp.zeros(16))


def test_invalid_ids_under_jit_route_nowhere_and_are_counted(request):
  """Traced ids are not read on the host: an out-of-range or repeated id adds nothing (the
  reference drops it alike), is counted, and shows as E + Z in the ids the call used; the
  router still gets its gradient through the valid ones."""
  params, x, ids = inputs(CONFIG, seed_of(request.node.name))
  bad = ids.at[3, 1].set(42).at[5, 1].set(ids[5, 0]).at[7].set(jnp.array([-1, 99]))
  run = jax.jit(lambda p, ids: moe_apply(p, x, config=CONFIG, expert_ids=ids))
  y, aux = run(params, bad)
  reference = jax.jit(lambda p, ids: reference_moe(p, x, CONFIG, expert_ids=ids))
  assert_close(y, reference(params, bad), what="y")
  assert int(aux.invalid_expert_ids) == 4
  np.testing.assert_array_equal(aux.expert_ids[7], [8, 8])
  np.testing.assert_array_equal(aux.expert_ids[3], [ids[3, 0], 8])
  chex.assert_trees_all_equal(y[7], jnp.zeros(16))
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(run(p, bad)[0])))(params)
  want = jax.grad(lambda p: jnp.sum(jnp.sin(reference(p, bad))))(params)
  assert float(jnp.abs(grads.router_kernel).max()) > 0
  assert_close(grads.router_kernel, want.router_kernel, what="router gradient")


def test_replay_over_quantized_experts_with_adapters(request):
  """fp8 experts under LoRA adapters, on a mesh: given ids against the reference."""
  seed = seed_of(request.node.name)
  float_config = dataclasses.replace(
    CONFIG, lora_rank=2, quant_block_size=(8, 8), hidden_size=16, intermediate_size=24
  )
  params, x, ids = inputs(float_config, seed)
  expert, _ = random_adapters(float_config, jax.random.key(seed))
  params, config = quant.quantize_experts(params._replace(lora=expert), float_config, "fp8_block")
  mask = jax.random.bernoulli(jax.random.key(seed), 0.7, (12,))
  y, _ = moe_apply(
    params, poison(x, mask), config=config, mesh=mesh_of(2, 4), token_mask=mask, expert_ids=ids
  )
  assert_close(y, reference_moe(params, x, config, mask, expert_ids=ids), what="y")


def test_linen_and_nnx_layers_replay_and_sow_the_ids(request):
  seed = seed_of(request.node.name)
  layer = MoELayer(CONFIG, rngs=nnx.Rngs(seed))
  _, x, ids = inputs(CONFIG, seed)
  y, sown = nnx.capture(layer, nnx.Intermediate)(x, expert_ids=ids)
  np.testing.assert_array_equal(sown["expert_ids"][0], ids)
  assert_close(y, reference_moe(layer.moe_params(), x, CONFIG, expert_ids=ids), what="nnx y")
  module = moe_linen(CONFIG)
  variables = module.init(jax.random.key(seed), x)
  y_linen = module.apply(variables, x, expert_ids=ids)
  params = nn.meta.unbox(variables["params"])
  want = reference_moe(layer.moe_params()._replace(**params), x, CONFIG, expert_ids=ids)
  assert_close(y_linen, want, what="linen y")


def test_bias_update_moves_each_expert_toward_the_mean():
  counts = jnp.array([[9, 3, 6, 6, 5], [1, 1, 1, 13, 0]])  # two layers, E = 4, Z = 1
  bias = jnp.array([[0.5, 0.0, 0.0, 0.0, 0.3], [0.0, 0.0, 0.0, 0.0, 0.3]])
  got = balancing.bias_update(bias, counts, rate=0.1, num_experts=4)
  want = bias + 0.1 * np.array([[-1, 1, 0, 0, 0], [1, 1, 1, -1, 0]])
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_loss_of_micro_batches_together_is_the_whole_batchs(request):
  params, x, _ = inputs(CONFIG, seed_of(request.node.name), tokens=24)
  mesh = mesh_of(2, 4)
  whole = moe_apply(params, x, config=CONFIG, mesh=mesh)[1]
  halves = [moe_apply(params, half, config=CONFIG, mesh=mesh)[1] for half in (x[:12], x[12:])]
  stacked = lambda name: jnp.stack([getattr(aux, name) for aux in halves])
  together = balancing.global_load_balancing_loss(
    stacked("expert_counts"), stacked("score_sums"), stacked("num_tokens"), top_k=CONFIG.top_k
  )
  assert_close(together, whole.load_balancing_loss, what="loss")
  assert not np.isclose(halves[0].load_balancing_loss, whole.load_balancing_loss)
  counts = np.asarray(whole.expert_counts)
  np.testing.assert_allclose(whole.load_max_over_mean, counts.max() / counts.mean(), rtol=1e-6)


def test_train_step_updates_each_layers_bias(request):
  """`train_step(..., bias_update_rate=)` on unrolled blocks and on a scanned stack: each
  layer's bias moves by its own counts; a layer without a bias is an error naming the option."""
  moe = dataclasses.replace(CONFIG, chunk_size="auto")
  tokens = jax.random.randint(jax.random.key(seed_of(request.node.name)), (2, 8), 0, 16)
  mask = jnp.ones((2, 8), bool)
  for scan in (False, True):
    config = TransformerConfig(vocab_size=16, num_layers=2, num_heads=2, moe=moe, scan_layers=scan)
    model = MoETransformer(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)  # only the update moves it
    before = _biases(model)
    metrics = train_step(model, optimizer, tokens, tokens, mask, bias_update_rate=0.25)
    want = balancing.bias_update(before, metrics["expert_counts"], rate=0.25, num_experts=8)
    np.testing.assert_allclose(_biases(model), want, rtol=1e-6)
    assert not np.array_equal(_biases(model), before)
  unbiased = MoELayer(MoEConfig(**BASE), rngs=nnx.Rngs(0))
  _, sown = nnx.capture(unbiased, nnx.Intermediate)(jnp.ones((4, 16)))
  with pytest.raises(ValueError, match="use_routing_bias=True"):
    balancing.update_routing_biases(unbiased, sown, rate=0.1)
  assert parser().parse_args(["train", "--bias-update-rate", "1e-3"]).bias_update_rate == 1e-3


def _biases(model: nnx.Module) -> np.ndarray:
  """[layers, E]: every MoE layer's selection bias, in module order."""
  layers = [node for _, node in nnx.iter_graph(model) if isinstance(node, MoELayer)]
  return np.concatenate(
    [np.asarray(layer.routing_bias.get_value()).reshape(-1, 8) for layer in layers]
  )
