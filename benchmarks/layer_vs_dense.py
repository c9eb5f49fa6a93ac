"""Layer forward time vs a dense matmul of the same active FLOPs and vs sort + ragged_dot.

One process, one device, float32. Prints a table of times, achieved GFLOP/s and the fraction
of the dense-matmul rate (the ceiling), and writes the rows as JSON.

  python benchmarks/layer_vs_dense.py [--tokens 4096] [--experts 32] [--top-k 2] ...
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from kernels_pallas import autotune
from moejax import MoEConfig, files, moe_apply, param_shapes
from moejax.params import MoEParams


def best_time(fn, *args, repeats: int) -> float:
  """Minimum wall time of `repeats` calls after one warm-up (compile) call."""
  return autotune.time_call(lambda: fn(*args), repeats)


def dense_same_flops(x_rows, w_gate_up, w_down):
  """[T*K, D] @ [D, 2F] -> act * up -> @ [F, D]: the active FLOPs as two plain matmuls."""
  gate, up = jnp.split(x_rows @ w_gate_up, 2, axis=-1)
  return (jax.nn.silu(gate) * up) @ w_down


def sort_ragged_dot(x, expert_ids, weights, w_gate_up, w_down):
  """Sort the T*K assignments by expert and run jax.lax.ragged_dot twice."""
  tokens, top_k = expert_ids.shape
  flat = expert_ids.reshape(-1)
  order = jnp.argsort(flat)
  sizes = jnp.zeros(w_gate_up.shape[0], jnp.int32).at[flat].add(1)
  rows = x[order // top_k]
  gate, up = jnp.split(jax.lax.ragged_dot(rows, w_gate_up, sizes), 2, axis=-1)
  out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)
  per_choice = jnp.zeros_like(out).at[order].set(out).reshape(tokens, top_k, -1)
  return jnp.einsum("tk,tkd->td", weights, per_choice)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--experts", type=int, default=32)
  parser.add_argument("--top-k", type=int, default=2)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--intermediate", type=int, default=512)
  parser.add_argument("--chunk-sizes", default="256,1024,4096")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--skip-ragged", action="store_true", help="ragged_dot is slow on CPU")
  parser.add_argument("--out", default="results/layer_vs_dense.json")
  parser.add_argument("--overwrite", action="store_true", help="replace earlier results in --out")
  args = parser.parse_args()
  if not args.overwrite:
    files.refuse_existing([args.out], how="pass --overwrite")

  t, e, k, d, f = args.tokens, args.experts, args.top_k, args.hidden, args.intermediate
  flops = 2 * t * k * (d * 2 * f + f * d)
  keys = iter(jax.random.split(jax.random.key(0), 8))
  base = MoEConfig(num_experts=e, top_k=k, hidden_size=d, intermediate_size=f)
  params = MoEParams(
    **{n: jax.random.normal(next(keys), s) * s[-2] ** -0.5 for n, s in param_shapes(base).items()}
  )
  x = jax.random.normal(next(keys), (t, d))
  rows = []

  def record(name: str, seconds: float) -> None:
    rows.append({"name": name, "ms": seconds * 1e3, "gflops": flops / seconds / 1e9})

  dense = jax.jit(dense_same_flops)
  record(
    "dense matmul, same FLOPs (ceiling)",
    best_time(
      dense, jnp.repeat(x, k, 0), params.w_gate_up[0], params.w_down[0], repeats=args.repeats
    ),
  )
  for chunk in (int(c) for c in args.chunk_sizes.split(",")):
    config = MoEConfig(num_experts=e, top_k=k, hidden_size=d, intermediate_size=f, chunk_size=chunk)
    layer = jax.jit(lambda p, x, config=config: moe_apply(p, x, config=config)[0])
    record(f"moejax layer, chunk_size={chunk}", best_time(layer, params, x, repeats=args.repeats))
  if not args.skip_ragged:
    logits = x @ params.router_kernel
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits), k)
    ragged = jax.jit(sort_ragged_dot)
    record(
      "sort + jax.lax.ragged_dot",
      best_time(
        ragged, x, ids, weights, params.w_gate_up, params.w_down, repeats=min(args.repeats, 2)
      ),
    )

  ceiling = rows[0]["gflops"]
  print(
    f"T={t} E={e} K={k} D={d} F={f} float32, device: {jax.devices()[0].device_kind}, "
    f"active GFLOP per call: {flops / 1e9:.2f}"
  )
  print(f"{'':40} {'ms':>9} {'GFLOP/s':>9} {'x ceiling':>9}")
  for row in rows:
    row["fraction_of_ceiling"] = row["gflops"] / ceiling
    print(
      f"{row['name']:40} {row['ms']:9.1f} {row['gflops']:9.1f} {row['fraction_of_ceiling']:9.2f}"
    )
  results = json.dumps({"shape": vars(args), "rows": rows}, indent=2)
  files.write_atomically(args.out, results, overwrite=True)


if __name__ == "__main__":
  main()
