"""`moejax.integrations.maxtext.on_moejax(RoutedMoE)` against MaxText's own `RoutedMoE` on its
dense path (`sparse_matmul=False`, the oracle), both built from one seed: the same parameters,
and the same output, load-balance loss, routed bias updates and gradients of the inputs and
every parameter, on one device (softmax routing, silu) and on a 2 x 4 mesh (data x expert;
sigmoid routing with MaxText's routed bias, its scaling factor and tanh gelu). Needs maxtext
(Python >= 3.12: installed by .ci/run in its GPU venv); skipped without it."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from tests.helpers import assert_trees_close
from tests.peers import maxtext_pair

SHAPE = (8, 2, 16, 24)  # experts, top k, model width, expert width
pytestmark = [
  pytest.mark.slow,  # MaxText's dense layer beside moejax's, compiled for this module alone
  pytest.mark.skipif(
    importlib.util.find_spec("maxtext") is None, reason="needs maxtext (Python >= 3.12; .ci/run)"
  ),
]
DEEPSEEK_ROUTING = dict(
  decoder_block="deepseek", routed_score_func="sigmoid", routed_bias=True,
  routed_bias_update_rate=1e-3, routed_scaling_factor=2.5, mlp_activations=["gelu", "linear"],
)  # fmt: skip


def _outputs_and_grads(layer, x, cotangent):
  """(output, lb loss, bias updates) and the gradients of <output, cotangent> + lb loss."""
  graph, params, rest = nnx.split(layer, nnx.Param, ...)  # rest: its random streams

  def loss(params, x):
    output, lb_loss, bias_updates = nnx.merge(graph, params, rest)(x)
    return jnp.sum(output * cotangent) + lb_loss, (output, lb_loss, bias_updates)

  (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return outputs, grads


@pytest.mark.parametrize(
  "overrides, sizes",
  [({}, {}), (DEEPSEEK_ROUTING, dict(data=2, expert=4))],
  ids=["one device", "data 2 x expert 4"],
)
def test_matches_maxtext_dense_routed_moe(overrides, sizes):
  with jax.numpy_rank_promotion("allow"):  # MaxText's routing broadcasts
    theirs, ours = maxtext_pair(SHAPE, sizes, **overrides)
  with jax.set_mesh(theirs.mesh), jax.numpy_rank_promotion("allow"):
    assert_trees_close(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param), what="parameters")
    keys = jax.random.split(jax.random.key(1))
    x = jax.random.normal(keys[0], (4, 8, SHAPE[2]))  # [B, S, M]
    cotangent = jax.random.normal(keys[1], x.shape)
    want = _outputs_and_grads(theirs, x, cotangent)
    got = _outputs_and_grads(ours, x, cotangent)
  assert (want[0][2] is None) == ("routed_bias" not in overrides)  # the updates when asked
  assert_trees_close(got, want, what="outputs and gradients")


def test_a_setting_it_does_not_take_is_named():
  with pytest.raises(ValueError, match="mlp_bias"):
    maxtext_pair(SHAPE, mlp_bias=True)
