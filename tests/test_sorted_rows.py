"""moejax.sorted_rows: the rows into expert order and back, against plain indexing."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.sorted_rows import rows_in_expert_order, sort_by_expert, summed_choices
from tests.helpers import assert_close

TOKENS, TOP_K, DIM, LOCAL_EXPERTS = 37, 3, 5, 4


def test_both_moves_and_their_gradients_are_plain_indexing_and_scatter_nothing():
  """Round trip x -> rows in expert order -> f(rows) -> each token's K rows summed, against
  the same with plain indexing (`x[order // K]` and a scatter back), forward and the
  gradients of x and of the sorted rows' function; ids past the local experts (held
  elsewhere) included. Neither the moves nor their gradients scatter: each move's gradient is
  the other move."""
  keys = jax.random.split(jax.random.key(7), 3)
  expert_ids = jax.random.randint(keys[0], (TOKENS, TOP_K), 0, LOCAL_EXPERTS + 2)
  x = jax.random.normal(keys[1], (TOKENS, DIM))
  scale = jax.random.normal(keys[2], (TOKENS * TOP_K, DIM))
  sorted_ = sort_by_expert(expert_ids, LOCAL_EXPERTS)
  order, ids = np.asarray(sorted_.order), np.asarray(expert_ids).reshape(-1)
  key = np.minimum(ids, LOCAL_EXPERTS)  # the experts held elsewhere last
  assert np.array_equal(order, np.argsort(key, kind="stable"))
  assert np.array_equal(np.asarray(sorted_.position)[order], np.arange(order.size))
  counts = np.bincount(key, minlength=LOCAL_EXPERTS + 1)[:LOCAL_EXPERTS]
  assert sorted_.group_sizes.tolist() == counts.tolist()

  def ours(x, scale):
    rows = rows_in_expert_order(x, sorted_, TOP_K)
    return summed_choices(jnp.sin(rows) * scale, sorted_, TOP_K)

  def plain(x, scale):
    rows = jnp.sin(x[sorted_.order // TOP_K]) * scale
    back = jnp.zeros_like(rows).at[sorted_.order].set(rows)
    return jnp.sum(back.reshape(TOKENS, TOP_K, DIM), axis=1)

  probe = jax.random.normal(jax.random.key(8), (TOKENS, DIM))
  value_and_grads = lambda f: jax.value_and_grad(
    lambda x, scale: jnp.sum(f(x, scale) * probe), argnums=(0, 1)
  )
  (got, got_grads), (want, want_grads) = (value_and_grads(f)(x, scale) for f in (ours, plain))
  assert_close(got, want, jnp.float32, "sum")
  for name, g, w in zip(("d x", "d scale"), got_grads, want_grads, strict=True):
    assert_close(g, w, jnp.float32, name)
  jaxpr = str(jax.make_jaxpr(value_and_grads(ours))(x, scale))
  assert "scatter" not in jaxpr, jaxpr
