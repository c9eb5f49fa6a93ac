"""The (row, choice) assignments in local-expert order, and rows moved between the two orders.

The expert paths compute on rows in expert order: each token's row once per choice,
`x[order // K]`, and back, each token's K results summed. Both moves are gathers, forward and
backward (`moved_rows`: a gather that reads each row at most once has a gather by the inverse
index for its transpose), where autodiff of a gather would scatter-add, a [N*K, D]
accumulation in the rows' dtype whose order a GPU's atomics leave to chance, and the way
back, written as a scatter, would fill [N*K, D] zeros first.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax import id_spaces


class SortedAssignments(NamedTuple):
  """The N*K (row, choice) assignments sorted by local expert, those held elsewhere last.

  Attributes:
    order: [N*K] int32, the assignment (n*K + k) at each sorted position.
    position: [N*K] int32, the sorted position of each assignment (`order`'s inverse).
    group_sizes: [El] int32 assignments of each local expert.
  """

  order: jax.Array
  position: jax.Array
  group_sizes: jax.Array


def sort_by_expert(expert_ids: jax.Array, local_experts: int) -> SortedAssignments:
  """The assignments of `expert_ids` [N, K] (local ids; those outside [0, El) belong to no
  local expert) sorted by local expert, stably.

  >>> sorted_ = sort_by_expert(jnp.array([[1, 0], [1, 7]]), local_experts=2)
  >>> sorted_.order.tolist(), sorted_.position.tolist(), sorted_.group_sizes.tolist()
  ([1, 0, 2, 3], [1, 0, 2, 3], [1, 2])
  """
  flat = expert_ids.reshape(-1)
  key = jnp.where(id_spaces.is_local(flat, local_experts), flat, local_experts)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  every = jnp.arange(flat.size, dtype=jnp.int32)
  position = jnp.zeros_like(order).at[order].set(every, unique_indices=True)
  group_sizes = jnp.zeros(local_experts + 1, jnp.int32).at[key].add(1)[:local_experts]
  return SortedAssignments(order, position, group_sizes)


@jax.custom_vjp
def moved_rows(table: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
  """[A, ...] `table[index]`, 0 where the index is R or more, for an `index` [A] (non-negative)
  that reads each of table's R rows at most once; `inverse` [R] names the entry that reads
  each row (A or more: none). Its gradient is a gather by `inverse` (0 for a row no entry
  reads), where autodiff's would scatter-add.

  >>> moved_rows(jnp.array([10.0, 20.0]), jnp.array([1, 2, 0]), jnp.array([2, 0])).tolist()
  [20.0, 0.0, 10.0]
  """
  del inverse
  return jnp.take(table, index, axis=0, mode="fill", fill_value=0)


def _moved_rows_fwd(table, index, inverse):
  return moved_rows(table, index, inverse), (index, inverse)


def _moved_rows_bwd(indices, d_rows):
  index, inverse = indices
  return moved_rows(d_rows, inverse, index), None, None


moved_rows.defvjp(_moved_rows_fwd, _moved_rows_bwd)


def rows_in_expert_order(x: jax.Array, sorted_: SortedAssignments, top_k: int) -> jax.Array:
  """[N*K, ...] each sorted assignment's row of `x` [N, ...]: `x[order // K]`. Its gradient
  gathers each token's K rows' gradients and sums them in float32, rounded to x's dtype once.
  """
  repeated = jnp.repeat(x.astype(jnp.float32), top_k, axis=0)  # [N*K, ...] in assignment order
  return moved_rows(repeated, sorted_.order, sorted_.position).astype(x.dtype)


def summed_choices(rows: jax.Array, sorted_: SortedAssignments, top_k: int) -> jax.Array:
  """[N, ...] float32: each token's K rows of `rows` [N*K, ...] (sorted order) gathered and
  summed in choice order, `sum_k rows[position[n*K + k]]`.

  >>> sorted_ = sort_by_expert(jnp.array([[1, 0], [1, 7]]), local_experts=2)
  >>> summed_choices(jnp.array([10.0, 1.0, 2.0, 0.0]), sorted_, top_k=2).tolist()
  [11.0, 2.0]
  """
  picked = moved_rows(rows, sorted_.position, sorted_.order)  # [N*K, ...] in assignment order
  return jnp.sum(picked.reshape(-1, top_k, *rows.shape[1:]).astype(jnp.float32), axis=1)
