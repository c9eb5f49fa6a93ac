"""Collectives inside `shard_map`, each the identity when the layer runs without a mesh.

Every helper takes a mesh axis name or a tuple of names (an axis group, acting as one axis:
`moejax.axis_groups`), or None without a mesh, so the same layer code runs on one device.
`ragged_all_to_all` is `jax.lax.ragged_all_to_all` where the platform has it and an exact
drop-in built from a static `all_to_all` where it does not (XLA:CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kernels_pallas import platform
from moejax.axis_groups import AxisGroup

# Platforms whose XLA backend implements the `ragged-all-to-all` collective.
_RAGGED_PLATFORMS = ("gpu", "tpu")


def platform_has_ragged_all_to_all() -> bool:
  """Whether the default device runs `jax.lax.ragged_all_to_all` (GPUs, TPUs; not XLA:CPU)."""
  return platform.platform() in _RAGGED_PLATFORMS


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


def varying_like(value: jax.Array, like: jax.Array) -> jax.Array:
  """`value` (int or bool), per-device wherever `like` is (inside `shard_map`; elsewhere as it
  is): what a value must share with the others of a `lax.cond` branch's output. Combined
  with `filled_like`'s zeros (XLA folds them away) rather than cast by axis names, which
  the JAX versions moejax supports expose differently."""
  zero = filled_like(like, value.shape, 0, value.dtype)
  return value | zero if value.dtype == jnp.bool_ else value + zero


def axis_rank(axis: AxisGroup | None) -> jax.Array:
  """This device's index along `axis` (0 without a mesh)."""
  return jnp.int32(0) if axis is None else jax.lax.axis_index(axis)


def gather_along(x: jax.Array, axes: Sequence[str], dim: int) -> jax.Array:
  """The shards of `x` along `dim` from every device of `axes`, concatenated in rank order
  (identity for no axes). Its transpose, in a gradient, is a reduce-scatter over `axes`."""
  return jax.lax.all_gather(x, tuple(axes), axis=dim, tiled=True) if axes else x


def gather_rows(x: jax.Array, axis: AxisGroup | None) -> jax.Array:
  """[C, ...] per device -> [S*C, ...]: the rows of all S devices along `axis`, in rank order."""
  return x if axis is None else jax.lax.all_gather(x, axis, tiled=True)


def scatter_sum_rows(y: jax.Array, axis: AxisGroup | None) -> jax.Array:
  """[S*C, ...] per device -> [C, ...]: sum over the S devices, each keeping its own C rows."""
  return y if axis is None else jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)


def swap_slices(x: jax.Array, axis: AxisGroup | None) -> jax.Array:
  """[S, ...] per device -> [S, ...]: slice j goes to device j; slice i of the result came
  from device i (a tiled `all_to_all`)."""
  return x if axis is None else jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def filled_like(like: jax.Array, shape: tuple[int, ...], value, dtype=None) -> jax.Array:
  """An array of `shape` filled with `value`, per-device wherever `like` is.

  Built from `like`, not with `jnp.full`: inside `shard_map` it keeps like's varying-axes
  type, which both branches of a `lax.cond` must share and which `ragged_all_to_all`'s
  `output` must have.
  """
  seed = jnp.full_like(jnp.reshape(like, -1)[:1], value, dtype)  # [1]
  return jnp.broadcast_to(seed.reshape(()), shape)


def ragged_all_to_all(
  operand: jax.Array,
  output: jax.Array,
  input_offsets: jax.Array,
  send_sizes: jax.Array,
  output_offsets: jax.Array,
  recv_sizes: jax.Array,
  *,
  axis: AxisGroup | None,
  max_slice_rows: int,
  ragged: bool,
) -> jax.Array:
  """`jax.lax.ragged_all_to_all`'s operands and result, on every platform.

  Slice i of `operand` (rows `input_offsets[i]` to `+ send_sizes[i]`) goes to device
  i // (slices / S), which writes it at `output_offsets[i]` of its `output`; slices received
  from device j are `recv_sizes` long (slices = len(input_offsets), a multiple of S, the axis
  size).

  Args:
    operand: [rows_in, ...] rows to send.
    output: [rows_out, ...] what the result holds where nothing is received. Inside `shard_map` it
      must vary over the axes `operand` does (the op's result takes its type): build it with
      `filled_like(operand, ...)`, not with `jnp.zeros`.
    input_offsets, send_sizes, output_offsets, recv_sizes: [slices] int32, as the JAX op.
    axis: the mesh axis, or None (one device: a local copy with the same semantics).
    max_slice_rows: a static bound on every send size (the drop-in's buffer rows per slice).
    ragged: run `jax.lax.ragged_all_to_all`, which sends only the filled rows (platforms where
      `platform_has_ragged_all_to_all()`); else the drop-in: a static `all_to_all` of
      [slices, max_slice_rows, ...] buffers plus gathers.

  Returns:
    [rows_out, ...]: `output` with the received slices written in.
  """
  if ragged and axis is not None:
    return jax.lax.ragged_all_to_all(
      operand,
      output,
      input_offsets,
      send_sizes,
      output_offsets,
      recv_sizes,
      axis_name=axis,
    )
  rows = jnp.arange(max_slice_rows, dtype=jnp.int32)
  take = input_offsets[:, None] + rows[None, :]  # [slices, max_slice_rows]
  take = jnp.where(rows[None, :] < send_sizes[:, None], take, 0)
  sent = swap_slices(operand[take], axis)  # slice i now from device i // (slices / S)
  offsets = swap_slices(output_offsets, axis)  # [slices] where each received slice goes here
  put = offsets[:, None] + rows[None, :]
  put = jnp.where(rows[None, :] < recv_sizes[:, None], put, output.shape[0]).reshape(-1)
  # Placed by a gather, not a scatter of rows (slow on XLA:CPU): first the received row that
  # lands on each output row, by a scatter of row numbers only.
  received = put.shape[0]
  source = jnp.full(output.shape[0], received, jnp.int32)
  source = source.at[put].set(jnp.arange(received, dtype=jnp.int32), mode="drop")
  sent = sent.reshape(received, *output.shape[1:])[jnp.minimum(source, received - 1)]
  lands = (source < received).reshape(-1, *[1] * (output.ndim - 1))
  return jnp.where(lands, sent, output)
