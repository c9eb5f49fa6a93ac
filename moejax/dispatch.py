"""Collectives inside `shard_map`: vLLM's all-gather / reduce-scatter expert dispatch.

Every helper takes the mesh axis name, or None when the layer runs without a mesh; then each
collective is the identity and the same code runs on one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from moejax.config import MoEConfig
from moejax.experts import routed_mlp


def gather_rows(x: jax.Array, axis: str | None) -> jax.Array:
  """[C, ...] per device -> [S*C, ...]: the rows of all S devices along `axis`, in rank order."""
  return x if axis is None else jax.lax.all_gather(x, axis, tiled=True)


def scatter_sum_rows(y: jax.Array, axis: str | None) -> jax.Array:
  """[S*C, ...] per device -> [C, ...]: sum over the S devices, each keeping its own C rows."""
  return y if axis is None else jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)


def sum_over(x: jax.Array, axes: Sequence[str]) -> jax.Array:
  """`x` summed over the named mesh axes (identity for no axes)."""
  return jax.lax.psum(x, tuple(axes)) if axes else x


def vary_over(x: jax.Array, axes: Sequence[str]) -> jax.Array:
  """Marks a value that is the same on every device of `axes` as per-device (`pcast` varying).

  Weights used inside the chunk loop's `lax.cond` must be cast before the loop: the transpose
  of this cast is a psum over `axes`, and inside the cond only the devices that run the chunk
  would join it, deadlocking the ones that skip.
  """
  return jax.lax.pcast(x, tuple(axes), to="varying") if axes else x


def any_over(flag: jax.Array, axis: str | None) -> jax.Array:
  """[] bool: whether `flag` is True on any device along `axis` (same value on all of them)."""
  return sum_over(flag.astype(jnp.int32), () if axis is None else (axis,)) > 0


def axis_rank(axis: str | None) -> jax.Array:
  """This device's index along `axis` (0 without a mesh)."""
  return jnp.int32(0) if axis is None else jax.lax.axis_index(axis)


def exchange_and_compute(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  *,
  config: MoEConfig,
  expert_axis: str | None,
) -> jax.Array:
  """One chunk's routed-expert output for this device's rows.

  All-gathers the chunk's rows, ids and weights over the expert axis, runs this device's
  experts on every gathered row routed to them, and reduce-scatters the partial sums back, so
  that each device gets the full routed output of its own rows.

  Args:
    x: [C, D] this device's rows (compute dtype; padding rows zero).
    expert_ids: [C, K] int32 global expert ids (E for padding).
    weights: [C, K] float32 combine weights.
    w_gate_up: [El, D, 2F] this device's experts, El = E / expert-axis size.
    w_down: [El, F, D].
    config: the layer's config.
    expert_axis: mesh axis the experts are split over, or None.

  Returns:
    [C, D] in the compute dtype.
  """
  rows = gather_rows(x, expert_axis)  # [S*C, D]
  ids = gather_rows(expert_ids, expert_axis)  # [S*C, K]
  row_weights = gather_rows(weights, expert_axis)  # [S*C, K]
  local_experts = w_gate_up.shape[0]
  # Experts are laid out contiguously: device s owns ids [s*El, (s+1)*El). Ids outside that
  # range (other devices' experts, and E for padding) fall outside [0, El) and are dropped.
  local_ids = ids - axis_rank(expert_axis) * local_experts
  out = routed_mlp(rows, local_ids, row_weights, w_gate_up, w_down, config=config)
  return scatter_sum_rows(out.astype(config.dtype), expert_axis)
