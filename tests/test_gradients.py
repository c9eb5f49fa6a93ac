"""Gradients of the layer against jax.grad of the reference, with NaN-poisoned padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import MoEConfig, MoEParams, moe_apply, reference_moe
from tests.helpers import assert_close, mesh_of, poison, random_params, rank_mask, seed_of

ROWS_PER_RANK = 6
CONFIG = MoEConfig(
  num_experts=8,
  top_k=2,
  hidden_size=16,
  intermediate_size=24,
  chunk_size=4,
  use_routing_bias=True,
  num_expert_groups=2,
  topk_groups=2,
  num_shared_experts=1,
  shared_intermediate_size=8,
)


def loss(y: jax.Array, probe: jax.Array) -> jax.Array:
  """A scalar that weighs every output element differently."""
  return jnp.sum(jnp.sin(y) * probe)


@pytest.mark.parametrize("mesh_shape", [None, (2, 4), (8, 1), (1, 8)], ids=str)
def test_gradients_match_reference(mesh_shape, request):
  key = jax.random.key(seed_of(request.node.name))
  params = random_params(CONFIG, key)
  params = params._replace(routing_bias=jax.random.normal(jax.random.fold_in(key, 1), (8,)))
  x = jax.random.normal(jax.random.fold_in(key, 2), (8 * ROWS_PER_RANK, 16))
  probe = jax.random.normal(jax.random.fold_in(key, 3), x.shape)
  # Ranks 0 and 5 empty, rank 3 full: with (2, 4) one data group skips chunks the other runs.
  mask = rank_mask([0, 2, 4, 6, 1, 0, 0, 0], ROWS_PER_RANK)
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)

  def moejax_loss(p: MoEParams, x: jax.Array) -> jax.Array:
    y, _ = moe_apply(p, x, config=CONFIG, mesh=mesh, token_mask=mask)
    return loss(y, probe)

  def reference_loss(p: MoEParams, x: jax.Array) -> jax.Array:
    return loss(reference_moe(p, x, CONFIG, mask), probe)

  grads = jax.grad(moejax_loss, argnums=(0, 1))(params, poison(x, mask))
  expected = jax.grad(reference_loss, argnums=(0, 1))(params, x)
  for name, got, want in zip(MoEParams._fields, grads[0], expected[0], strict=True):
    if want is not None:  # parameters this config does not use are None in both
      assert_close(got, want, what=f"d/d {name}")
  assert_close(grads[1], expected[1], what="d/dx")
  assert np.all(np.asarray(grads[1])[~np.asarray(mask)] == 0), "gradient leaked into padding"


def test_aux_losses_have_gradients_and_match_across_meshes(request):
  key = jax.random.key(seed_of(request.node.name))
  config = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=24, chunk_size=4)
  params = random_params(config, key)
  x = jax.random.normal(jax.random.fold_in(key, 1), (8 * ROWS_PER_RANK, 16))
  mask = rank_mask([0, 2, 6, 6, 1, 0, 3, 0], ROWS_PER_RANK)

  def aux_loss(p: MoEParams, mesh) -> jax.Array:
    _, aux = moe_apply(p, poison(x, mask), config=config, mesh=mesh, token_mask=mask)
    return aux.load_balancing_loss + 0.1 * aux.router_z_loss

  single = jax.value_and_grad(aux_loss)(params, None)
  sharded = jax.value_and_grad(aux_loss)(params, mesh_of(2, 4))
  assert_close(sharded[0], single[0], what="aux loss")
  assert_close(sharded[1].router_kernel, single[1].router_kernel, what="d aux / d router")
  assert float(jnp.abs(single[1].router_kernel).max()) > 0
