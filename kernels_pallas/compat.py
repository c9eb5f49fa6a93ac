"""Output types that work inside `jax.shard_map` across the JAX versions we support."""

from __future__ import annotations

import jax


def out_struct(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """A kernel output type that varies over the same `shard_map` axes as `like`.

  Inside `shard_map` (with its default type checks) a Pallas call must say over which mesh
  axes its output varies; outside, this is a plain ShapeDtypeStruct. JAX 0.10 calls the field
  `manual_axis_type`, earlier releases `vma`.
  """
  aval = jax.typeof(like)
  if hasattr(aval, "manual_axis_type"):
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
  return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)
