"""`moejax.CHECKPOINT_NAMES`: a remat policy built from a name saves that value of the layer
and recomputes the rest, with the gradients of no remat at all."""

import collections
import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import pytest

from moejax import CHECKPOINT_NAMES, MoEConfig, moe_apply, remat
from moejax.testing import poison, random_params
from tests.helpers import mesh_of, seed_of, tolerance

CONFIG = MoEConfig(
  num_experts=8,
  top_k=2,
  hidden_size=16,
  intermediate_size=32,
  chunk_size=8,
  save_dispatched_rows=True,
)
TOKENS = 60  # padded to L = 8 rows on each of the 8 devices: 64 rows in all

# What each name adds to the saved residuals of the 2x4 mesh's layer: (shape, dtype), global.
SAVED = {
  remat.ROUTER_LOGITS: [((64, 8), "float32")],
  remat.ROUTED_ROWS: [((64, 16), "float32"), ((64, 2), "int32"), ((64, 2), "float32")],
  # all_gather: each device's one chunk receives S * C = 32 rows with their ids and weights.
  remat.DISPATCHED_ROWS: [((8, 32, 16), "float32"), ((8, 32, 2), "int32"), ((8, 32, 2), "float32")],
  remat.LAYER_OUTPUT: [((TOKENS, 16), "float32")],
}


def test_every_name_has_its_saved_value():
  assert set(SAVED) == set(CHECKPOINT_NAMES)


def _residuals(vjp) -> collections.Counter:
  """The (shape, dtype) of every array a `jax.vjp` pullback holds: what is saved."""
  return collections.Counter((a.shape, str(a.dtype)) for a in jax.tree.leaves(vjp))


@pytest.fixture(scope="module")
def case():
  """The layer under tanh (so its output is needed by the backward pass), on the 2x4 mesh,
  on padded tokens whose masked rows are NaN; and its pullback without remat."""
  key = jax.random.key(seed_of("test_remat"))
  params = random_params(CONFIG, key)
  mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.8, (TOKENS,))
  x = poison(jax.random.normal(jax.random.fold_in(key, 2), (TOKENS, 16)), mask)
  mesh = mesh_of(2, 4)
  layer = lambda params, x: jnp.tanh(
    moe_apply(params, x, config=CONFIG, mesh=mesh, token_mask=mask)[0]
  )
  cotangent = jax.random.normal(jax.random.fold_in(key, 3), (TOKENS, 16))
  _, pullback = jax.vjp(layer, params, x)
  return layer, params, x, cotangent, pullback(cotangent)


@pytest.mark.parametrize("name", CHECKPOINT_NAMES)
def test_a_policy_saves_the_named_value_and_gives_the_same_gradients(case, name):
  layer, params, x, cotangent, expected = case
  policies = jax.checkpoint_policies
  _, recompute_all = jax.vjp(jax.checkpoint(layer, policy=policies.nothing_saveable), params, x)
  _, save_one = jax.vjp(
    jax.checkpoint(layer, policy=policies.save_only_these_names(name)), params, x
  )
  added = _residuals(save_one) - _residuals(recompute_all)
  assert added == collections.Counter(SAVED[name]), added
  gradients = save_one(cotangent)
  chex.assert_tree_all_finite(gradients)  # nothing from the NaN padding
  chex.assert_trees_all_close(gradients, expected, **tolerance())


@pytest.mark.parametrize(
  "dispatch, mesh_shape", [("all_gather", (2, 4)), ("all_to_all", (2, 4)), ("all_gather", None)]
)
def test_kept_dispatched_rows_spare_the_backward_its_exchange(dispatch, mesh_shape, request):
  """With `save_dispatched_rows` the compiled gradient has one outbound exchange fewer per
  chunk body (rows, ids and weights: three collectives; none to spare without a mesh, where
  the loop runs both stages in one step) and the same gradients."""
  key = jax.random.key(seed_of(request.node.name))
  config = dataclasses.replace(CONFIG, dispatch=dispatch, save_dispatched_rows=False)
  params = random_params(config, key)
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
  x = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, 16))
  collective = {"all_gather": "all-gather", "all_to_all": "all-to-all"}[dispatch]
  found = {}
  for save in (False, True):
    kept = dataclasses.replace(config, save_dispatched_rows=save)
    loss = lambda p, x, c=kept: jnp.sum(jnp.sin(moe_apply(p, x, config=c, mesh=mesh)[0]))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    hlo = grad.lower(params, x).compile().as_text()
    found[save] = (len(re.findall(rf" {collective}(?:-start)?\(", hlo)), grad(params, x))
  spared = 0 if mesh is None else 3
  assert found[True][0] == found[False][0] - spared, (found[False][0], found[True][0])
  chex.assert_trees_all_close(found[True][1], found[False][1], **tolerance())


def test_without_remat_the_layer_keeps_its_tokens_width_once():
  """Without a remat policy, the pullback of a bf16 layer on the 2x4 mesh keeps one [L, D]
  array: the chunk loop's rows, which the router's gradient reads as well. It keeps no
  float32 copy of x for the router, no [L, D] masks of the padding's `where`, and no second
  copy of the rows (the layer used to keep six such arrays, 12 bytes per token value)."""
  config = dataclasses.replace(
    CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, save_dispatched_rows=False
  )
  key = jax.random.key(seed_of("test_remat_width"))
  params = random_params(config, key)
  x = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, 16), jnp.bfloat16)
  mesh = mesh_of(2, 4)
  layer = lambda params, x: moe_apply(params, x, config=config, mesh=mesh)[0]
  _, pullback = jax.vjp(layer, params, x)
  made = [a for a in jax.tree.leaves(pullback) if a is not x]  # x: the caller's own array
  token_wide = [(a.shape, str(a.dtype)) for a in made if a.shape in ((64, 16), (TOKENS, 16))]
  assert token_wide == [((64, 16), "bfloat16")], token_wide  # the rows, [L = 64, D]
