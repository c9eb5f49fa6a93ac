"""What the default device is, asked in one place: every choice that depends on it reads this.

>>> platform() in ("cpu", "gpu", "tpu")
True
"""

from __future__ import annotations

import jax


def platform() -> str:
  """The default device's platform: "cpu", "gpu" (CUDA or ROCm) or "tpu"."""
  return jax.devices()[0].platform


def on_cpu() -> bool:
  """Whether the default device is a CPU (where Pallas kernels can only be interpreted)."""
  return platform() == "cpu"


def gpu_compute_capability() -> str | None:
  """The default GPU's compute capability ("9.0" on Hopper), or None off a GPU."""
  if platform() != "gpu":
    return None
  return str(getattr(jax.devices()[0], "compute_capability", "0"))


def gpu_memory_bytes() -> int | None:
  """The default GPU's memory as JAX reports it (`memory_stats()["bytes_limit"]`), or None
  off a GPU or where it reports none."""
  if platform() != "gpu":
    return None
  return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


def gpu_sm_count() -> int | None:
  """The default GPU's streaming multiprocessor count, or None off a GPU."""
  return jax.devices()[0].core_count if platform() == "gpu" else None
