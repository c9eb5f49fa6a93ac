"""Expert weights are read only for tiles that have rows: in the traced program of the tile
loop, forward and backward, every read of an expert weight sits inside a `lax.cond` branch
that runs only for used tiles, so a decode-size call reads the experts it uses, not all El."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from moejax import MoEConfig
from moejax.experts import tile_loop_mlp
from moejax.params import ExpertWeights
from tests.helpers import seed_of


def _sub_jaxprs(eqn):
  """The jaxprs an equation runs whose inputs are the equation's own, in order."""
  for value in eqn.params.values():
    for item in value if isinstance(value, tuple | list) else (value,):
      jaxpr = item.jaxpr if isinstance(item, ClosedJaxpr) else item
      if isinstance(jaxpr, Jaxpr) and len(jaxpr.invars) == len(eqn.invars):
        yield jaxpr


def weight_reads(jaxpr: Jaxpr, weights: set, in_cond: bool = False) -> list[tuple[str, bool]]:
  """(primitive, inside a cond branch) for every equation that reads one of `weights`,
  following the values into scans, jits and custom-derivative calls."""
  held = lambda v: not isinstance(v, Literal) and v in weights
  reads = []
  for eqn in jaxpr.eqns:
    read = [v for v in eqn.invars if held(v)]
    if eqn.primitive.name == "cond":
      for branch in eqn.params["branches"]:
        inner = {b for v, b in zip(eqn.invars[1:], branch.jaxpr.invars, strict=True) if held(v)}
        reads += weight_reads(branch.jaxpr, inner, in_cond=True)
      continue
    subs = list(_sub_jaxprs(eqn))
    for sub in subs:
      inner = {s for v, s in zip(eqn.invars, sub.invars, strict=True) if held(v)}
      reads += weight_reads(sub, inner, in_cond)
    if read and not subs:
      reads.append((eqn.primitive.name, in_cond))
  return reads


@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_tile_loop_reads_weights_only_in_used_tiles(grad, biases, request):
  experts, dim, width, rows, top_k = 8, 16, 24, 3, 2
  keys = jax.random.split(jax.random.key(seed_of(request.node.name)), 6)
  x = jax.random.normal(keys[0], (rows, dim))
  ids = jax.random.randint(keys[1], (rows, top_k), 0, experts)
  weights = jax.random.uniform(keys[2], (rows, top_k))
  w_gate_up = jax.random.normal(keys[3], (experts, dim, 2 * width))
  w_down = jax.random.normal(keys[4], (experts, width, dim))
  b = (jnp.ones((experts, 2 * width)), jnp.ones((experts, dim))) if biases else (None, None)
  config = MoEConfig(num_experts=experts, top_k=top_k, hidden_size=dim, intermediate_size=width)

  def layer(w_gate_up, w_down, x):
    experts = ExpertWeights(w_gate_up, w_down, *b)
    return tile_loop_mlp(x, ids, weights, experts, activation=config.gated_activation, tile_rows=8)

  fn = jax.grad(lambda *a: jnp.sum(layer(*a) ** 2), argnums=(0, 1, 2)) if grad else layer
  jaxpr = jax.make_jaxpr(fn)(w_gate_up, w_down, x).jaxpr
  reads = weight_reads(jaxpr, set(jaxpr.invars[:2]))
  assert any(in_cond for _, in_cond in reads), "no weight read found: the walk is broken"
  outside = [name for name, in_cond in reads if not in_cond]
  assert not outside, f"expert weights read outside the used-tile cond by {outside}"


def test_the_walk_sees_a_read_outside_a_cond():
  """The checker itself: an unconditional slice of the weights is reported."""

  def leaky(w, i):
    return jax.lax.cond(i > 0, lambda: w[0] * 2, lambda: w[1]) + w[i]

  jaxpr = jax.make_jaxpr(leaky)(jnp.ones((4, 3)), 1).jaxpr
  reads = weight_reads(jaxpr, {jaxpr.invars[0]})
  chex.assert_equal(sorted({in_cond for _, in_cond in reads}), [False, True])
  assert np.any([not in_cond for _, in_cond in reads])
