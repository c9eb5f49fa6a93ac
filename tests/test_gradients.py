"""Gradients of the router's aux losses (the layer's own gradients are in test_layer_contract)."""

import jax
import jax.numpy as jnp

from moejax import MoEConfig, MoEParams, moe_apply
from moejax.testing import poison, random_params, rank_mask
from tests.helpers import assert_close, mesh_of, seed_of

ROWS_PER_RANK = 6


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
