"""GPU benchmark of the grouped-matmul kernels: correctness first, then TFLOP/s per backend.

On named MoE shapes, bf16: the first expert matmul (`gmm`, [T*K, D] x [E, D, 2F]) and the whole
fused expert MLP (`moe_mlp`), for each backend, against `jax.lax.ragged_dot` (XLA), jax's own
Hopper `ragged_dot_mgpu` (baseline, where it applies) and a dense matmul of the same FLOPs (the
measured ceiling). Group sizes are balanced or skewed (half the rows to one expert).

  python benchmarks/gpu_kernels.py            # on a GPU: the table, JSON under results/
  python benchmarks/gpu_kernels.py --tune     # also autotune block sizes, cache them as JSON
  python benchmarks/gpu_kernels.py --smoke    # tiny shapes in the interpreters (CPU check)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import MosaicBlocks, TritonBlocks, autotune, gmm, moe_mlp
from kernels_pallas.api import moe_mlp_reference
from kernels_pallas.gmm_mosaic import interpret_params


@dataclasses.dataclass(frozen=True)
class Shape:
  """A named MoE expert shape: hidden D, expert width F, E experts on this device, top-K."""

  name: str
  d: int
  f: int
  experts: int
  top_k: int
  tokens: tuple[int, ...]


SHAPES = (
  Shape("mixtral_8x7b", d=4096, f=14336, experts=8, top_k=2, tokens=(128, 1024, 4096, 16384)),
  Shape("deepseek_v3_shard", d=7168, f=2048, experts=32, top_k=8, tokens=(128, 1024, 4096)),
)
SMOKE_SHAPES = (Shape("smoke", d=64, f=32, experts=4, top_k=2, tokens=(64,)),)


def group_sizes(rows: int, experts: int, skewed: bool) -> jax.Array:
  """Balanced sizes, or half of the rows on expert 0 and the rest balanced."""
  if skewed:
    rest = np.full(experts - 1, (rows // 2) // (experts - 1))
    sizes = np.concatenate([[rows - rest.sum()], rest])
  else:
    sizes = np.full(experts, rows // experts)
    sizes[: rows - sizes.sum()] += 1
  return jnp.asarray(sizes, jnp.int32)


def best_seconds(fn, *args, repeats: int = 10) -> float:
  """Minimum time of `repeats` calls after a warm-up call."""
  return autotune.time_call(lambda: fn(*args), repeats=repeats)


def backends(smoke: bool) -> dict[str, dict]:
  """Keyword arguments per backend for gmm / moe_mlp."""
  if smoke:
    return {
      "xla": dict(implementation="xla"),
      "triton": dict(implementation="triton", interpret=True, config=TritonBlocks(16, 16, 16)),
      "mosaic": dict(
        implementation="mosaic", interpret=interpret_params(), config=MosaicBlocks(64, 16, 16, 2)
      ),
    }
  return {
    "xla": dict(implementation="xla"),
    "triton": dict(implementation="triton"),
    "mosaic": dict(implementation="mosaic"),
  }


def check_correctness(kwargs_by_backend: dict[str, dict], smoke: bool) -> None:
  """Each backend against XLA on a small ragged case with an empty group; raises if off."""
  m, d, f, experts = (64, 64, 32, 4) if smoke else (1000, 512, 256, 8)
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (m, d), jnp.bfloat16)
  w_gate_up = (jax.random.normal(keys[1], (experts, d, 2 * f)) / np.sqrt(d)).astype(jnp.bfloat16)
  w_down = (jax.random.normal(keys[2], (experts, f, d)) / np.sqrt(f)).astype(jnp.bfloat16)
  weights = jax.random.uniform(keys[3], (m,)).astype(jnp.bfloat16)
  sizes = jnp.asarray([m // 3, 0, m // 2, m // 10], jnp.int32)[:experts]
  sizes = jnp.pad(sizes, (0, experts - sizes.shape[0]))
  want_gmm = jax.lax.ragged_dot(x, w_gate_up, sizes, preferred_element_type=jnp.float32)
  want_mlp = moe_mlp_reference(x, w_gate_up, w_down, sizes, weights, "silu").astype(jnp.float32)
  for name, kwargs in kwargs_by_backend.items():
    got_gmm = gmm(x, w_gate_up, sizes, preferred_element_type=jnp.float32, **kwargs)
    got_mlp = moe_mlp(x, w_gate_up, w_down, sizes, row_weights=weights, **kwargs)
    for what, got, want in (("gmm", got_gmm, want_gmm), ("moe_mlp", got_mlp, want_mlp)):
      error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
      scale = float(jnp.max(jnp.abs(want)))
      status = "ok" if error <= 2e-2 * scale + 1e-2 else "WRONG"
      print(f"check {name:8} {what:8} max abs err {error:.3g} (max |ref| {scale:.3g}) {status}")
      if status != "ok":
        raise SystemExit(f"{name} {what} disagrees with XLA")


def upstream_ragged_dot(lhs, rhs, sizes):
  """jax's own Hopper ragged_dot_mgpu with its documented good block sizes."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

  return ragged_dot_mgpu.ragged_dot(
    lhs,
    rhs,
    group_sizes=sizes,
    block_m=128,
    block_n=128,
    block_k=64,
    max_concurrent_steps=4,
    grid_block_n=1,
  )


def run_case(shape: Shape, tokens: int, skewed: bool, kwargs_by_backend, smoke: bool) -> list[dict]:
  """Times every backend (and the ceilings) on one shape, token count and skew."""
  repeats = 1 if smoke else 10
  timed = functools.partial(best_seconds, repeats=repeats)
  rows = tokens * shape.top_k
  keys = jax.random.split(jax.random.key(tokens), 3)
  x = jax.random.normal(keys[0], (rows, shape.d), jnp.bfloat16)
  w_gate_up = jax.random.normal(keys[1], (shape.experts, shape.d, 2 * shape.f), jnp.bfloat16)
  w_down = jax.random.normal(keys[2], (shape.experts, shape.f, shape.d), jnp.bfloat16)
  sizes = group_sizes(rows, shape.experts, skewed)
  gmm_flops = 2 * rows * shape.d * 2 * shape.f
  mlp_flops = gmm_flops + 2 * rows * shape.f * shape.d
  results = []

  def record(op, name, seconds, flops, ceiling=None):
    row = dict(
      shape=shape.name,
      tokens=tokens,
      skewed=skewed,
      op=op,
      backend=name,
      ms=seconds * 1e3,
      tflops=flops / seconds / 1e12,
    )
    row["of_ceiling"] = row["tflops"] / ceiling if ceiling else 1.0
    results.append(row)
    return row["tflops"]

  dense = jax.jit(lambda a, b: a @ b)
  ceiling = record("gmm", "dense (ceiling)", timed(dense, x, w_gate_up[0]), gmm_flops)
  dense_mlp = jax.jit(
    lambda a, b, c: (jax.nn.silu(a @ b[:, : shape.f]) * (a @ b[:, shape.f :])) @ c
  )
  mlp_ceiling = record(
    "moe_mlp", "dense (ceiling)", timed(dense_mlp, x, w_gate_up[0], w_down[0]), mlp_flops
  )
  for name, kwargs in kwargs_by_backend.items():
    run_gmm = jax.jit(functools.partial(gmm, **kwargs))
    record("gmm", name, timed(run_gmm, x, w_gate_up, sizes), gmm_flops, ceiling)
    run_mlp = jax.jit(lambda a, b, c, s, kw=kwargs: moe_mlp(a, b, c, s, **kw))
    record("moe_mlp", name, timed(run_mlp, x, w_gate_up, w_down, sizes), mlp_flops, mlp_ceiling)
  if not smoke:
    upstream = jax.jit(upstream_ragged_dot)
    record("gmm", "jax ragged_dot_mgpu", timed(upstream, x, w_gate_up, sizes), gmm_flops, ceiling)
  return results


def tune(shapes: tuple[Shape, ...]) -> None:
  """Autotunes the Mosaic forward kernel's blocks for each shape's largest token count."""
  candidates = [
    MosaicBlocks(bm, bn, 64, steps) for bm in (64, 128) for bn in (128, 256) for steps in (3, 4, 5)
  ]
  for shape in shapes:
    rows = max(shape.tokens) * shape.top_k
    x = jnp.ones((rows, shape.d), jnp.bfloat16)
    w = jnp.ones((shape.experts, shape.d, 2 * shape.f), jnp.bfloat16)
    sizes = group_sizes(rows, shape.experts, skewed=False)
    key = autotune.cache_key("gmm", "mosaic", (rows, shape.d, 2 * shape.f, shape.experts), x.dtype)
    make_call = lambda blocks, x=x, w=w, sizes=sizes: functools.partial(
      jax.jit(functools.partial(gmm, implementation="mosaic", config=blocks)), x, w, sizes
    )
    print(f"tuned {key}: {autotune.autotune(key, candidates, make_call)}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreters (CPU)")
  parser.add_argument("--tune", action="store_true", help="autotune Mosaic blocks first")
  parser.add_argument("--out", default="results/gpu_kernels.json")
  args = parser.parse_args()
  device = jax.devices()[0]
  if device.platform != "gpu" and not args.smoke:
    raise SystemExit(f"needs a GPU (found {device.device_kind}); use --smoke for a CPU check")
  shapes = SMOKE_SHAPES if args.smoke else SHAPES
  kwargs_by_backend = backends(args.smoke)
  start = time.perf_counter()
  check_correctness(kwargs_by_backend, args.smoke)
  if args.tune:
    tune(shapes)
  rows = []
  for shape in shapes:
    for tokens in shape.tokens:
      for skewed in (False, True) if tokens >= 1024 or args.smoke else (False,):
        rows += run_case(shape, tokens, skewed, kwargs_by_backend, args.smoke)
  print(f"\n{device.device_kind}, JAX {jax.__version__}, bf16, {time.perf_counter() - start:.0f} s")
  print(
    f"{'shape':18} {'tokens':>6} {'skew':>4} {'op':8} {'backend':20} {'ms':>9} {'TFLOP/s':>8} "
    f"{'x ceiling':>9}"
  )
  for r in rows:
    print(
      f"{r['shape']:18} {r['tokens']:6} {'yes' if r['skewed'] else 'no':>4} {r['op']:8} "
      f"{r['backend']:20} {r['ms']:9.3f} {r['tflops']:8.1f} {r['of_ceiling']:9.2f}"
    )
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(
    json.dumps(dict(device=device.device_kind, jax=jax.__version__, rows=rows), indent=1)
  )


if __name__ == "__main__":
  main()
