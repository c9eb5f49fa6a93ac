"""What a layer call costs before it computes: the checks and planning of an eager call, and
tracing.

  python benchmarks/call_overhead.py [--against REV] [--rounds 5] [--out results]

Rows (microseconds, the best of `--rounds` rounds):
  eager 1 device  one `moe_apply` on 16 tokens (E=8, K=2, D=64) with a compiled program
                  already cached: its trace-time checks run on every call, its compute is tiny.
  eager 2x4 mesh  the same on a 2x4 (data, expert) mesh of simulated CPU devices.
  trace 1 device  `jax.jit(moe_apply).trace(...)` after `jax.clear_caches()`: the checks, the
                  call plan and the chunk loop's jaxpr, no compile.

With `--against REV` the same rows are measured for the commit REV (a `git worktree` of it in a
temporary folder, run as its own process) and this checkout, in alternating rounds, and the
table gives both and the ratio (this checkout / REV): one run, so a busy machine slows both
alike. Rows go to `OUT/call_overhead.json`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import math
import time

import jax
from commits import compare_main

from moejax import MoEConfig, moe_apply
from moejax.testing import random_params

CONFIG = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128)
TOKENS = 16
EAGER_CALLS = 200
TRACES = 5


def measure() -> dict[str, float]:
  """Each row's time in microseconds (the best of its repeats within this process)."""
  params = random_params(CONFIG, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (TOKENS, CONFIG.hidden_size))
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rows = {
    "eager 1 device": _eager(lambda: moe_apply(params, x, config=CONFIG)),
    "eager 2x4 mesh": _eager(lambda: moe_apply(params, x, config=CONFIG, mesh=mesh)),
  }

  def trace():
    jax.clear_caches()
    start = time.perf_counter()
    jax.jit(lambda p, x: moe_apply(p, x, config=CONFIG)).trace(params, x)
    return time.perf_counter() - start

  rows["trace 1 device"] = min(trace() for _ in range(TRACES)) * 1e6
  return rows


def _eager(call) -> float:
  """The best per-call time over batches of `EAGER_CALLS` calls, in microseconds."""
  jax.block_until_ready(call())
  best = math.inf
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(EAGER_CALLS):
      out = call()
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / EAGER_CALLS)
  return best * 1e6


def main() -> None:
  compare_main("call_overhead.py", measure, __doc__.split("\n")[0], ".0f", rounds=5)


if __name__ == "__main__":
  main()
