"""`moejax.integrations.levanter.moe_mlp` against Levanter grug's own `moe_mlp`: its `scatter`
backend on one device and its `ring` backend on 8 devices of Levanter's mesh, forward and
every gradient. Needs the grug modules (marin-levanter and what they import, installed by
.ci/run without their dependencies); skipped without them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.integrations import levanter
from tests.helpers import assert_close
from tests.peers import grug_modules

grug_moe, Activation = grug_modules()
pytestmark = [
  pytest.mark.slow,  # grug's programs beside moejax's, each compiled for this module alone
  pytest.mark.extras,
  pytest.mark.skipif(grug_moe is None, reason="needs marin-levanter (see .ci/run)"),
  pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # haliax's, as above
]

T, D, E, I, K = 32, 16, 8, 24, 2  # noqa: E741 (grug's letter for the intermediate width)
LEVANTER_AXES = ("replica_dcn", "data", "context", "expert", "model")
BATCH = P(("replica_dcn", "data", "expert"))  # grug's batch spec


def _inputs():
  keys = jax.random.split(jax.random.key(7), 6)
  x = jax.random.normal(keys[0], (T, D))
  scores = jax.nn.softmax(jax.random.normal(keys[1], (T, E)))
  weights, ids = jax.lax.top_k(scores, K)  # distinct experts per token, uneven loads
  w_up_gate = jax.random.normal(keys[2], (E, D, 2 * I)) / np.sqrt(D)
  w_down = jax.random.normal(keys[3], (E, I, D)) / np.sqrt(I)
  cotangent = jax.random.normal(keys[4], (T, D))
  return (x, ids.astype(jnp.int32), weights, w_up_gate, w_down), cotangent


def _value_and_grads(moe_mlp, args, cotangent, **kwargs):
  """y and the gradients of <y, cotangent> to x, combine_weights, w_up_gate and w_down."""
  x, ids, weights, w_up_gate, w_down = args

  def loss(x, weights, w_up_gate, w_down):
    y = moe_mlp(x, ids, weights, w_up_gate, w_down, **kwargs)
    return jnp.sum(y * cotangent), y

  with jax.numpy_rank_promotion("allow"):  # grug's code broadcasts implicitly
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
      x, weights, w_up_gate, w_down
    )
  return y, grads


def _assert_same(moejax_out, grug_out):
  (y, grads), (y_grug, grads_grug) = moejax_out, grug_out
  assert_close(y, y_grug, what="y", comparison="reordered")
  for name, got, want in zip(
    ("x", "weights", "w_up_gate", "w_down"), grads, grads_grug, strict=True
  ):
    assert_close(got, want, what=f"d/d {name}", comparison="reordered")


@pytest.mark.parametrize("activation", ["silu", "relu2", "gelu_new"])
def test_matches_grug_scatter_on_one_device(activation):
  args, cotangent = _inputs()
  grug = _value_and_grads(
    grug_moe.moe_mlp, args, cotangent, activation=Activation(activation), implementation="scatter"
  )
  ours = _value_and_grads(levanter.moe_mlp, args, cotangent, activation=activation)
  _assert_same(ours, grug)


@pytest.mark.parametrize("capacity_factor", [4.0, 1.25], ids=["room for all", "grug's default"])
def test_matches_grug_ring_on_levanters_mesh_of_8_devices(capacity_factor):
  """Levanter's five mesh axes (data 2, expert 4, the rest 1), explicit, tokens split as
  grug splits them; grug's ring with room for every assignment (capacity factor 4, the
  expert axis' size: a shard may take all it gathers) and with its default, which drops
  some: the same assignments drop."""
  mesh = jax.make_mesh((1, 2, 1, 4, 1), LEVANTER_AXES, axis_types=(AxisType.Explicit,) * 5)
  (x, ids, weights, w_up_gate, w_down), cotangent = _inputs()
  batch = NamedSharding(mesh, BATCH)
  args = (*jax.device_put((x, ids, weights), batch), w_up_gate, w_down)
  ring = {"implementation": "ring", "capacity_factor": capacity_factor}
  with jax.set_mesh(mesh):
    cotangent = jax.device_put(cotangent, batch)
    with jax.numpy_rank_promotion("allow"):
      _, dropped = grug_moe.moe_mlp(*args, **ring, report_capacity_overflow=True)
    _, ours_dropped = levanter.moe_mlp(*args, **ring, report_capacity_overflow=True)
    grug = _value_and_grads(grug_moe.moe_mlp, args, cotangent, **ring)
    ours = _value_and_grads(levanter.moe_mlp, args, cotangent, **ring)
  assert int(ours_dropped) == int(dropped)
  assert (int(dropped) > 0) == (capacity_factor < 4)
  _assert_same(ours, grug)
  assert ours[0].sharding.is_equivalent_to(grug[0].sharding, 2)  # y comes back split like x


def test_a_function_activation_and_the_overflow_report():
  """grug takes any act(gate) function; the report counts no dropped assignment."""
  args, cotangent = _inputs()
  act = lambda gate: jnp.tanh(gate) * 2.0
  grug = _value_and_grads(grug_moe.moe_mlp, args, cotangent, activation=act)
  ours = _value_and_grads(levanter.moe_mlp, args, cotangent, activation=act)
  _assert_same(ours, grug)
  _, dropped = levanter.moe_mlp(*args, report_capacity_overflow=True)
  assert dropped.dtype == jnp.int32 and int(dropped) == 0
