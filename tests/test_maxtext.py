"""`moejax.integrations.maxtext.on_moejax(RoutedMoE)` against MaxText's own `RoutedMoE` on its
dense path (`sparse_matmul=False`, the oracle), both built from one seed: the same parameters,
and the same output, load-balance loss, routed bias updates and gradients of the inputs and
every parameter, on one device (softmax routing, silu) and on a 2 x 4 mesh (data x expert;
sigmoid routing with MaxText's routed bias, its scaling factor and tanh gelu). Needs maxtext
(Python >= 3.12: installed by .ci/run in its GPU venv); skipped without it."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from moejax.integrations.maxtext import on_moejax
from tests.helpers import assert_trees_close

try:
  with jax.numpy_rank_promotion("allow"):  # maxtext's modules broadcast at import
    from maxtext.configs import pyconfig
    from maxtext.layers import initializers, moe
except ImportError:
  moe = None

pytestmark = [
  pytest.mark.slow,  # MaxText's dense layer beside moejax's, compiled for this module alone
  pytest.mark.skipif(moe is None, reason="needs maxtext (Python >= 3.12; see .ci/run)"),
]
E, K, M, F = 8, 2, 16, 24  # experts, top k, model width, expert width
DEEPSEEK_ROUTING = dict(
  decoder_block="deepseek", routed_score_func="sigmoid", routed_bias=True,
  routed_bias_update_rate=1e-3, routed_scaling_factor=2.5, mlp_activations=["gelu", "linear"],
)  # fmt: skip


def _config(**overrides):
  base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
  settings = dict(
    run_name="moejax", enable_checkpointing=False, skip_jax_distributed_system=True,
    base_emb_dim=M, base_mlp_dim=F, base_moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K,
    sparse_matmul=False, capacity_factor=-1, dtype="float32", weight_dtype="float32",
    matmul_precision="highest", load_balance_loss_weight=0.01,
  )  # fmt: skip
  return pyconfig.initialize([None, base], **settings | overrides)


def _mesh(config, **sizes) -> Mesh:
  """MaxText's mesh axes, `sizes` where given, 1 elsewhere."""
  shape = [sizes.get(name, 1) for name in config.mesh_axes]
  devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, config.mesh_axes)


def _layer(cls, config, mesh):
  return cls(
    config=config, num_experts=E, num_experts_per_tok=K, mesh=mesh,
    kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
    kernel_axes=("embed", None), intermediate_dim=F, rngs=nnx.Rngs(0),
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
  config = _config(**overrides)
  mesh = _mesh(config, **sizes)
  with jax.set_mesh(mesh), jax.numpy_rank_promotion("allow"):  # MaxText's routing broadcasts
    theirs = _layer(moe.RoutedMoE, config, mesh)
    ours = _layer(on_moejax(moe.RoutedMoE), config, mesh)
    assert_trees_close(nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param), what="parameters")
    keys = jax.random.split(jax.random.key(1))
    x = jax.random.normal(keys[0], (4, 8, M))  # [B, S, M]
    cotangent = jax.random.normal(keys[1], x.shape)
    want = _outputs_and_grads(theirs, x, cotangent)
    got = _outputs_and_grads(ours, x, cotangent)
  assert (want[0][2] is None) == ("routed_bias" not in overrides)  # the updates when asked
  assert_trees_close(got, want, what="outputs and gradients")


def test_a_setting_it_does_not_take_is_named():
  config = _config(mlp_bias=True)
  with pytest.raises(ValueError, match="mlp_bias"):
    _layer(on_moejax(moe.RoutedMoE), config, _mesh(config))
