"""The (row, choice) assignments in local-expert order, and rows moved between the two orders.

The grouped matmul paths compute on rows sorted by expert: each token's row once per choice,
`x[order // K]`, and back, each token's K results summed. Both moves are gathers, forward and
backward: each one's transpose is the other (the sort is a permutation), where autodiff of a
gather would scatter-add, a [N*K, D] accumulation in the rows' dtype whose order a GPU's
atomics leave to chance, and the way back, written as a scatter, would fill [N*K, D] zeros
first.
"""

from __future__ import annotations

import functools
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rows_in_expert_order(x: jax.Array, sorted_: SortedAssignments, top_k: int) -> jax.Array:
  """[N*K, ...] each sorted assignment's row of `x` [N, ...]: `x[order // K]`.

  Its gradient is `summed_choices` of the rows' gradient (a gather and a float32 sum over
  each token's K rows), rounded to x's dtype once.
  """
  return x[sorted_.order // top_k]


def _rows_in_expert_order_fwd(x, sorted_, top_k):
  return rows_in_expert_order(x, sorted_, top_k), sorted_


def _rows_in_expert_order_bwd(top_k, sorted_, d_rows):
  return summed_choices(d_rows, sorted_, top_k).astype(d_rows.dtype), None


rows_in_expert_order.defvjp(_rows_in_expert_order_fwd, _rows_in_expert_order_bwd)


def summed_choices(rows: jax.Array, sorted_: SortedAssignments, top_k: int) -> jax.Array:
  """[N, ...] float32: each token's K rows of `rows` [N*K, ...] (sorted order) gathered and
  summed in choice order, `sum_k rows[position[n*K + k]]`. Its gradient is
  `rows_in_expert_order` of the sums' gradient, in the rows' dtype.

  >>> sorted_ = sort_by_expert(jnp.array([[1, 0], [1, 7]]), local_experts=2)
  >>> summed_choices(jnp.array([10.0, 1.0, 2.0, 0.0]), sorted_, top_k=2).tolist()
  [11.0, 2.0]
  """
  return _summed_choices(rows, sorted_, top_k, rows.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _summed_choices(rows, sorted_, top_k, dtype):
  del dtype
  picked = rows[sorted_.position].reshape(-1, top_k, *rows.shape[1:])  # [N, K, ...]
  return jnp.sum(picked.astype(jnp.float32), axis=1)


def _summed_choices_fwd(rows, sorted_, top_k, dtype):
  return _summed_choices(rows, sorted_, top_k, dtype), sorted_


def _summed_choices_bwd(top_k, dtype, sorted_, d_sums):
  return rows_in_expert_order(d_sums, sorted_, top_k).astype(dtype), None


_summed_choices.defvjp(_summed_choices_fwd, _summed_choices_bwd)
