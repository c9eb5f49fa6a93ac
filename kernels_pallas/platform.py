"""What device a program is made for, asked in one place: every choice that depends on it reads
this.

The answer is a `Target`: the one set by `targeting` around the code that decides, else JAX's
default device's. moejax sets its call's device (its mesh's) around each layer call's trace,
so a program compiled for a mesh of GPUs plans for those GPUs, whatever the process's default
device (a compile-only GPU, `moejax.targets`, answers as the GPU it describes). A test or a
user may set a target explicitly (a GPU's planning on a CPU, say); an explicit target wins.

>>> platform() in ("cpu", "gpu", "tpu")
True
>>> with targeting(Target(platform="gpu", compute_capability="9.0")):
...   gpu_compute_capability()
'9.0'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import jax

from kernels_pallas import gpus


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """The device a program is made for (hashable).

  Attributes:
    platform: "cpu", "gpu" (CUDA or ROCm) or "tpu".
    compute_capability: a GPU's ("9.0" on Hopper), else None.
    sm_count: a GPU's streaming multiprocessors, else None.
    memory_bytes: a GPU's memory where known (JAX's `memory_stats()`, else the known kinds of
      `kernels_pallas.gpus`), else None.
    device_kind: `jax.Device.device_kind`.
  """

  platform: str
  compute_capability: str | None = None
  sm_count: int | None = None
  memory_bytes: int | None = None
  device_kind: str = ""

  @property
  def name(self) -> str:
    """The device kind, or the platform for a target without one (e.g. "gpu")."""
    return self.device_kind or self.platform

  @staticmethod
  def of(device: jax.Device | jax.sharding.AbstractDevice) -> Target:
    """The target a device is: real, or compile-only (no memory stats: its kind's memory), or
    the abstract device of a mesh seen inside a trace (a GPU's facts from its kind's)."""
    if isinstance(device, jax.sharding.AbstractDevice):
      return _target_of_abstract(device)
    return _target_of(device)


@functools.cache
def _target_of(device: jax.Device) -> Target:
  if device.platform != "gpu":
    return Target(platform=device.platform, device_kind=device.device_kind)
  known = gpus.BY_DEVICE_KIND.get(device.device_kind)
  memory = _reported_memory_bytes(device)
  return Target(
    platform="gpu",
    compute_capability=str(getattr(device, "compute_capability", "0")),
    sm_count=device.core_count,
    memory_bytes=memory if memory is not None or known is None else known.memory_bytes,
    device_kind=device.device_kind,
  )


@functools.cache
def _target_of_abstract(device: jax.sharding.AbstractDevice) -> Target:
  if device.platform not in ("gpu", "cuda", "rocm"):
    return Target(platform=device.platform, device_kind=device.device_kind)
  known = gpus.BY_DEVICE_KIND.get(device.device_kind)
  return Target(
    platform="gpu",
    compute_capability=None if known is None else "{}.{}".format(*known.compute_capability),
    sm_count=device.num_cores or (None if known is None else known.sm_count),
    memory_bytes=None if known is None else known.memory_bytes,
    device_kind=device.device_kind,
  )


_EXPLICIT: contextvars.ContextVar[Target | None] = contextvars.ContextVar("target", default=None)
_CALL: contextvars.ContextVar[Target | None] = contextvars.ContextVar("call", default=None)


@contextlib.contextmanager
def targeting(target: Target | jax.Device) -> Iterator[None]:
  """Makes the decisions inside for `target` (a `Target` or a device), whatever devices the
  calls inside run on. It acts on what is traced inside: a program jit has already traced
  and cached for the same arguments is not traced again (jit's cache does not key on it)."""
  token = _EXPLICIT.set(target if isinstance(target, Target) else Target.of(target))
  try:
    yield
  finally:
    _EXPLICIT.reset(token)


@contextlib.contextmanager
def running_on(device: jax.Device | jax.sharding.AbstractDevice | None) -> Iterator[None]:
  """Makes the decisions inside for the device a call runs on (None: the default device; an
  abstract device: a mesh's as a trace sees it), unless `targeting` set a target."""
  token = _CALL.set(None if device is None else Target.of(device))
  try:
    yield
  finally:
    _CALL.reset(token)


def target() -> Target:
  """The target of the decisions made here: `targeting`'s, else `running_on`'s, else the
  default device's."""
  return _EXPLICIT.get() or _CALL.get() or Target.of(jax.devices()[0])


def platform() -> str:
  """The target's platform: "cpu", "gpu" (CUDA or ROCm) or "tpu"."""
  return target().platform


def on_cpu() -> bool:
  """Whether the target is a CPU (where Pallas kernels can only be interpreted)."""
  return platform() == "cpu"


def gpu_compute_capability() -> str | None:
  """The target GPU's compute capability ("9.0" on Hopper), or None off a GPU."""
  return target().compute_capability


def gpu_memory_bytes() -> int | None:
  """The target GPU's memory where known, or None (off a GPU, or an unknown kind that
  reports none)."""
  return target().memory_bytes


def gpu_sm_count() -> int | None:
  """The target GPU's streaming multiprocessor count, or None off a GPU."""
  return target().sm_count


def _reported_memory_bytes(device: jax.Device) -> int | None:
  """`memory_stats()["bytes_limit"]`, or None where the device reports none (compile-only
  devices raise)."""
  try:
    stats = device.memory_stats()
  except Exception:  # compile-only devices: "not implemented" as various error types
    return None
  return (stats or {}).get("bytes_limit")
