"""The chunk loop's backward pass: gradient seeds accumulate in place, and the tile loop's
forward is not run again to differentiate a chunk."""

import re

import chex
import jax
import jax.numpy as jnp
import pytest

from moejax import MoEConfig, moe_apply
from moejax.activations import GatedActivation
from moejax.chunking import seed_gradient
from moejax.experts import tile_loop_mlp
from moejax.params import ExpertWeights
from moejax.testing import random_params
from tests.helpers import mesh_of, seed_of, tolerance

EXPERTS, DIM, WIDTH, ROWS, TOP_K = 8, 16, 24, 12, 2


@pytest.mark.parametrize("biases", [False, True])
def test_tile_loop_accumulates_onto_its_gradient_seeds(biases, request):
  """With seeds, each expert parameter's gradient is its seed plus the unseeded gradient;
  the other gradients (rows, routing weights) do not change."""
  keys = iter(jax.random.split(jax.random.key(seed_of(request.node.name)), 12))
  x = jax.random.normal(next(keys), (ROWS, DIM))
  ids = jax.random.randint(next(keys), (ROWS, TOP_K), 0, EXPERTS)
  weights = jax.random.uniform(next(keys), (ROWS, TOP_K))
  shapes = [(EXPERTS, DIM, 2 * WIDTH), (EXPERTS, WIDTH, DIM), (EXPERTS, 2 * WIDTH), (EXPERTS, DIM)]
  params = ExpertWeights(*(jax.random.normal(next(keys), s) for s in shapes[: 4 if biases else 2]))
  seeds = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape), params)
  d_out = jax.random.normal(next(keys), (ROWS, DIM))
  activation = GatedActivation("silu")

  def layer(params, x, weights, grad_seeds):
    out = tile_loop_mlp(
      x, ids, weights, params, activation=activation, tile_rows=8, grad_seeds=grad_seeds
    )
    return jnp.sum(out * d_out)

  grad = jax.jit(jax.grad(layer, argnums=(0, 1, 2)))
  plain, seeded = grad(params, x, weights, None), grad(params, x, weights, seeds)
  expected = (jax.tree.map(jnp.add, seeds, plain[0]), *plain[1:])
  chex.assert_trees_all_close(seeded, expected, **tolerance(comparison="reordered"))
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(plain))


def test_seed_gradient_adds_its_seed_to_the_gradient(request):
  key = jax.random.key(seed_of(request.node.name))
  w, seed, scale = jax.random.normal(key, (3, 4, 5))
  d_w, d_seed = jax.grad(lambda w, s: jnp.sum(seed_gradient(w, s) * scale), argnums=(0, 1))(w, seed)
  chex.assert_trees_all_close(d_w, seed + scale, **tolerance(comparison="reordered"))
  chex.assert_trees_all_close(d_seed, jnp.zeros_like(seed))


def _dots_shaped(hlo: str, shape: tuple[int, ...]) -> int:
  """How many dot instructions of the optimized HLO produce a float32 array of `shape`."""
  dims = ",".join(map(str, shape))
  return len(re.findall(rf"= f32\[{dims}\]\{{[0-9,]*\}} dot\(", hlo))


def test_chunk_backward_runs_no_tile_forward(request):
  """The tile loop's backward needs no forward output, so a chunk's recomputed forward is
  dead code: the gate/up matmul ([tile rows, 2F]) is compiled once for the forward pass and
  once for the backward pass's recomputed pre-activation, not a third time."""
  config = MoEConfig(
    num_experts=EXPERTS, top_k=TOP_K, hidden_size=DIM, intermediate_size=WIDTH, chunk_size=8
  )
  params = random_params(config, jax.random.key(seed_of(request.node.name)))
  x = jax.random.normal(jax.random.key(1), (32, DIM))
  loss = lambda params, x: jnp.sum(moe_apply(params, x, config=config)[0] ** 2)
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
  tile_rows = 8  # `experts.default_tile_rows(8 * 2, 8)`
  chex.assert_equal(_dots_shaped(hlo, (tile_rows, 2 * WIDTH)), 2)


def test_a_scanned_stack_stores_nothing_per_chunk(request):
  """Under `jax.grad`, a layer inside a `lax.scan` over layers is split by the partial
  evaluation of that scan (what depends only on the token mask is hoisted out of it); the
  chunk loop must stay whole, or it stores each chunk's mask-only values and exchange buffers:
  on this 1x8 mesh, 32 chunks of them took 5x the layer's own temp (at DeepSeek-V3's shapes
  on 256 H100s, 128 GiB against 4 GiB). The scanned layer's compiled temp stays within 1.5x
  of the same layer's called alone."""
  config = MoEConfig(
    num_experts=16,
    top_k=4,
    hidden_size=256,
    intermediate_size=32,
    chunk_size=8,
    dispatch="all_to_all",
  )
  params = random_params(config, jax.random.key(seed_of(request.node.name)))
  stack = jax.tree.map(lambda a: a[None], params)  # one layer, scanned
  x = jax.ShapeDtypeStruct((8 * 256, 256), jnp.float32)  # 32 chunks on each device
  mesh = mesh_of(1, 8)
  layer = lambda x, params: x + moe_apply(params, x, config=config, mesh=mesh)[0]

  def temp_bytes(scanned: bool) -> int:
    def loss(stack, x):
      if scanned:
        y = jax.lax.scan(lambda x, params: (layer(x, params), None), x, stack)[0]
      else:
        y = layer(x, jax.tree.map(lambda a: a[0], stack))
      return jnp.mean(jnp.square(y))

    compiled = jax.jit(jax.grad(loss)).lower(stack, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(scanned=True) <= 1.5 * temp_bytes(scanned=False)
