"""Block-size autotuning: time candidates on the device, cache the winner as JSON.

The cache lives in `kernels_pallas/configs/<device kind>.json` (e.g. `nvidia_h200.json`),
keyed by op, backend, shape and dtype. `api.gmm` / `api.moe_mlp` read it when no `config` is
passed, and fall back to the per-shape-class heuristic otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from kernels_pallas import platform
from kernels_pallas.backends import BACKENDS
from kernels_pallas.gmm_mosaic import MosaicBlocks
from kernels_pallas.gmm_triton import TritonBlocks

CONFIG_DIR = Path(__file__).parent / "configs"
_BLOCK_TYPES = {b.blocks_type.__name__: b.blocks_type for b in BACKENDS.values() if b.blocks_type}


def cache_key(op: str, implementation: str, shape: Sequence[int], dtype) -> str:
  """'gmm/triton/M=4096,K=4096,N=14336,G=8/bfloat16': one tuned entry per such key."""
  dims = ",".join(f"{name}={size}" for name, size in zip("MKNG", shape, strict=False))
  return f"{op}/{implementation}/{dims}/{jax.numpy.dtype(dtype).name}"


def cache_file(device_kind: str | None = None, directory: Path = CONFIG_DIR) -> Path:
  """The JSON file for a device kind (default: that of the device the call is made for,
  `kernels_pallas.platform.target`)."""
  kind = device_kind or platform.target().device_kind
  return directory / f"{re.sub(r'[^a-z0-9]+', '_', kind.lower()).strip('_')}.json"


def lookup(key: str, path: Path | None = None):
  """The cached blocks for `key`, or None."""
  path = path or cache_file()
  if not path.exists():
    return None
  entry = json.loads(path.read_text()).get(key)
  if entry is None:
    return None
  return _BLOCK_TYPES[entry["type"]](**entry["blocks"])


def call_times(fn: Callable[[], jax.Array], repeats: int) -> list[float]:
  """Wall times in seconds of `repeats` device-synchronised calls of `fn()`, after one warm-up
  (compile) call."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return times


def time_call(fn: Callable[[], jax.Array], repeats: int = 5) -> float:
  """Best wall time of `fn()` in seconds, after one warm-up (compile) call."""
  return min(call_times(fn, repeats))


def autotune(
  key: str,
  candidates: Sequence[TritonBlocks | MosaicBlocks],
  make_call: Callable[[TritonBlocks | MosaicBlocks], Callable[[], jax.Array]],
  *,
  path: Path | None = None,
  timer: Callable[[Callable[[], jax.Array]], float] = time_call,
):
  """Times every candidate, stores the fastest under `key`, and returns it.

  A candidate that fails to compile or run (e.g. too much shared memory) is skipped.

  Args:
    key: from `cache_key`.
    candidates: block configurations to try.
    make_call: maps blocks to a zero-argument function running the kernel with them.
    path: the JSON cache (default: `cache_file()` of the device the call is made for).
    timer: measures a call in seconds.

  Returns:
    The fastest candidate.
  """
  path = path or cache_file()
  timings = []
  for blocks in candidates:
    try:
      timings.append((timer(make_call(blocks)), blocks))
    except Exception as error:  # any failure (too much shared memory, ...) rules it out
      print(f"autotune {key}: skipping {blocks}: {type(error).__name__}: {str(error)[:200]}")
  if not timings:
    raise RuntimeError(f"autotune {key}: every candidate failed")
  seconds, best = min(timings, key=lambda pair: pair[0])
  cache = json.loads(path.read_text()) if path.exists() else {}
  cache[key] = {
    "type": type(best).__name__,
    "blocks": dataclasses.asdict(best),
    "ms": seconds * 1e3,
  }
  path.parent.mkdir(parents=True, exist_ok=True)
  # Whole or not at all: a run stopped mid-write must not leave a cache that fails to parse.
  temporary = path.with_name(f".{path.name}.{os.getpid()}")
  temporary.write_text(json.dumps(cache, indent=2, sort_keys=True) + "\n")
  os.replace(temporary, path)
  return best
