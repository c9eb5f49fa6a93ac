"""What differs between the JAX versions we support (0.10 and 0.11), in one place."""

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


def mosaic_interpret_params():
  """What `plgpu.kernel(interpret=...)` takes to run a Mosaic GPU kernel on a CPU.

  A plain `interpret=True` selects the generic Pallas interpreter, which has no rules for
  Mosaic GPU's TMA copies and barriers ("No state discharge rule implemented for primitive:
  copy_gmem_to_smem"); the Mosaic GPU interpreter is chosen by passing its parameters. JAX
  0.10 and 0.11 keep that class private, so the import is confined here.
  """
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return InterpretGPUParams()


def mosaic_operands_transposed_in_smem(interpret: bool) -> bool:
  """Whether a Mosaic GPU kernel may hand wgmma a transposed shared-memory tile.

  On the GPU it can (`plgpu.transpose_ref`: the hardware reads the tile transposed, no data
  moves). The Mosaic GPU interpreter of JAX 0.10 and 0.11 cannot ("'TransposeTransform' object
  has no attribute 'indices'" in its wgmma), so interpreted kernels get the operand
  transposed by XLA beforehand; the in-kernel transposed read is exercised on the GPU and by
  the CUDA lowering test.
  """
  return not interpret
