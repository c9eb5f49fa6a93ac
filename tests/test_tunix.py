"""`moejax.integrations.tunix.MoELayer` against tunix's own Qwen3 `MoELayer` with
`use_megablox=False` (its dense path, the oracle), on the same parameters: forward and
the gradients of x and every parameter, on one device and on 8 devices of tunix's mesh
("fsdp" 4 splitting the experts, "tp" 2); both layers drawn from one seed hold the same
parameters. Needs google-tunix (installed by .ci/run without its
dependencies); skipped without it."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from moejax.integrations import tunix
from tests.helpers import assert_trees_close
from tests.peers import flax_as_tunix_runs, tunix_qwen3

qwen3 = tunix_qwen3()
pytestmark = [
  pytest.mark.slow,  # tunix's dense layer beside moejax's, compiled for this module alone
  pytest.mark.extras,
  pytest.mark.skipif(qwen3 is None, reason="needs google-tunix (see .ci/run)"),
  # tunix's own code: the Param metadata name and the mesh it reads
  pytest.mark.filterwarnings("ignore:'sharding' is deprecated:DeprecationWarning"),
  pytest.mark.filterwarnings("ignore:jax.interpreters.pxla.thread_resources:DeprecationWarning"),
  pytest.mark.filterwarnings("ignore:'.value' access is now deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def tunix_flax_config():
  """flax as tunix runs it, only around these tests (tests/peers.py restores the rest of the
  run's after importing tunix)."""
  with flax_as_tunix_runs():
    yield


def _config():
  return qwen3.ModelConfig(
    num_layers=1, vocab_size=32, embed_dim=16, hidden_dim=24, num_heads=2, head_dim=8,
    num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6, num_experts=8, num_experts_per_tok=2,
  )  # fmt: skip


def _layers():
  """tunix's layer and moejax's from the same seed: the same parameters, name for name."""
  theirs = qwen3.MoELayer(_config(), rngs=nnx.Rngs(0))
  ours = tunix.MoELayer(_config(), rngs=nnx.Rngs(0))
  assert_trees_close(nnx.state(ours), nnx.state(theirs), what="parameters")
  return theirs, ours


def _value_and_grads(layer, x, cotangent, **kwargs):
  graph, params = nnx.split(layer)

  def loss(params, x):
    return jnp.sum(nnx.merge(graph, params)(x, **kwargs) * cotangent)

  return jax.value_and_grad(loss, argnums=(0, 1))(params, x)


@pytest.mark.parametrize("mesh_shape", [None, (4, 2)], ids=["one device", "fsdp 4 x tp 2"])
def test_matches_tunix_dense_layer(mesh_shape):
  theirs, ours = _layers()
  keys = jax.random.split(jax.random.key(2))
  x = jax.random.normal(keys[0], (4, 8, 16))  # [B, T, D]
  cotangent = jax.random.normal(keys[1], x.shape)
  want = _value_and_grads(theirs, x, cotangent, use_megablox=False)
  if mesh_shape is None:
    got = _value_and_grads(ours, x, cotangent)
  else:
    with jax.set_mesh(jax.make_mesh(mesh_shape, ("fsdp", "tp"))):  # explicit axes
      got = _value_and_grads(ours, x, cotangent)
  assert_trees_close(got, want, what="loss and gradients")
