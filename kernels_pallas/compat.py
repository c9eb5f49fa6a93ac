"""What differs between the JAX versions we support (0.10 through 0.12), in one place."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from types import ModuleType

import jax


def jax_version() -> tuple[int, int]:
  """The installed JAX's (major, minor)."""
  major, minor = jax.__version__.split(".")[:2]
  return int(major), int(minor)


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


def varying_axes(x: jax.Array) -> frozenset[str]:
  """The `shard_map` axes over which x's type says it varies (none outside `shard_map`)."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):
    return frozenset(aval.manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", ()))


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """x, typed as varying over every `shard_map` axis `like` varies over.

  A Mosaic GPU kernel's output does not carry the varying axes of its `out_type` (JAX 0.11):
  the weights' cotangents of the transposed kernel came back typed as invariant, and the
  gradient failed to trace on a GPU (a custom VJP's cotangent must have its primal's type:
  "... so the manual axis types do not match"). The values are per device already.
  """
  missing = tuple(sorted(varying_axes(like) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


@jax.custom_jvp
def erf(x: jax.Array) -> jax.Array:
  """`jax.lax.erf`, differentiable inside `shard_map` on every supported JAX.

  JAX 0.12 computes erf with `lax.polynomial`, whose derivative mixes per-device values with
  unmarked constants and fails shard_map's varying-axes check ("Primitive polynomial requires
  varying manual axes to match"). The derivative here, 2/sqrt(pi) exp(-x^2), is erf's own,
  written without differentiating that polynomial.
  """
  return jax.lax.erf(x)


@erf.defjvp
def _erf_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  return erf(x), 1.1283791670955126 * jax.numpy.exp(-x * x) * dx


def pallas_triton() -> ModuleType | None:
  """`jax.experimental.pallas.triton`, or None where the installed JAX no longer ships it.

  JAX 0.11 deprecated the Pallas Triton backend ("will be removed in a future JAX version");
  the registry reports its absence through `triton_missing_reason` rather than failing at
  import.
  """
  try:
    return importlib.import_module("jax.experimental.pallas.triton")
  except ImportError:
    return None


def triton_missing_reason() -> str | None:
  """Why the Triton backend cannot run here (its Pallas backend is gone), or None."""
  if pallas_triton() is not None:
    return None
  major, minor = jax_version()
  return f"Pallas Triton was removed from JAX {major}.{minor}"


# Since JAX 0.11 lowering a Pallas Triton kernel for a GPU warns that the backend is deprecated.
TRITON_LOWERING_WARNS = jax_version() >= (0, 11)
TRITON_DEPRECATION_MESSAGE = "Pallas Triton backend is deprecated"


@contextlib.contextmanager
def cuda_target(device_kind: str = "NVIDIA H100", num_sms: int = 132) -> Iterator[None]:
  """Lowers for a named CUDA GPU (`jax.export(..., platforms=["cuda"])`) on a host without one.

  JAX 0.12's Triton lowering reads the target GPU's generation from the device, and on a
  host without a GPU from the abstract mesh's `AbstractDevice` ("No supported GPU devices
  found"); earlier releases assumed one. The abstract device also gives `num_sms`
  to the Mosaic kernels (`gmm_mosaic`), which launch one program per SM.
  """
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_sms, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("_cuda_target",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def target_num_sms() -> int | None:
  """The SM count of the GPU a `cuda_target` block lowers for, or None outside one."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return None if device is None else device.num_cores


def mosaic_interpret_params():
  """What `plgpu.kernel(interpret=...)` takes to run a Mosaic GPU kernel on a CPU.

  A plain `interpret=True` selects the generic Pallas interpreter, which has no rules for
  Mosaic GPU's TMA copies and barriers ("No state discharge rule implemented for primitive:
  copy_gmem_to_smem"); the Mosaic GPU interpreter is chosen by passing its parameters. JAX
  0.10 through 0.12 keep that class private, so the import is confined here.
  """
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return InterpretGPUParams()


def mosaic_operands_transposed_in_smem(interpret: bool) -> bool:
  """Whether a Mosaic GPU kernel may hand wgmma a transposed shared-memory tile.

  On the GPU it can (`ref.transpose`: the hardware reads the tile transposed, no data
  moves). The Mosaic GPU interpreter of JAX 0.10 and 0.11 cannot ("'TransposeTransform'
  object has no attribute 'indices'" in its wgmma), so interpreted kernels get the operand
  transposed by XLA beforehand; the in-kernel transposed read is exercised on the GPU and by
  the CUDA lowering test.
  """
  return not interpret


def mosaic_registers(ref, index: tuple, layout, interpret: bool):
  """`ref[index]` loaded from shared memory into registers of the given layout.

  On a GPU: `plgpu.load`, whose explicit layout Mosaic's layout inference may need. JAX 0.10
  requires the index as its argument (a ref already indexed with `.at` fails there), 0.11
  deprecates that for `.at`, 0.12 takes only `.at`. The Mosaic GPU interpreter cannot run
  `plgpu.load` (it binds it to arrays) and has no layouts to place: there a plain read.
  """
  if interpret:
    return ref[index]
  from jax.experimental.pallas import mosaic_gpu as plgpu

  index_argument = inspect.signature(plgpu.load).parameters.get("idx")
  if index_argument is not None and index_argument.default is inspect.Parameter.empty:
    return plgpu.load(ref, index, layout=layout)  # JAX 0.10
  return plgpu.load(ref.at[index], layout=layout)


def mosaic_iota(shape: tuple[int, ...], dimension: int, layout, interpret: bool) -> jax.Array:
  """int32 indices along `dimension`, in registers of `layout` (plain in the interpreter)."""
  if interpret:
    return jax.lax.broadcasted_iota(jax.numpy.int32, shape, dimension)
  from jax.experimental.pallas import mosaic_gpu as plgpu

  return plgpu.broadcasted_iota(jax.numpy.int32, shape, dimension, layout=layout)
