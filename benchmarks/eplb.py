"""Expert-parallel load balancing on the layer: how even the experts' devices are loaded.

  python benchmarks/eplb.py [--tokens 65536] [--draws 3] [--out results] [--smoke]

Router model: logits = Gaussian noise + strength · log(popularity), popularity a Zipf(1.0)
law over the experts in a shuffled order (a few experts take many times the mean load, as in
trained routers); strength 0.5 and 1.0. For each mesh (1x8, 2x4), shape (E=16, K=2 and E=64,
K=8) and strength: one batch through the layer without replicas, then R = 8, 16, 32 redundant
experts placed by `eplb.rebalance` from that batch's load, each measured on a fresh batch of
the same distribution; `--draws` independent draws of the router and batches. Reported per
case, all from the layer's own `MoEAux`:

  balanced      mean over max per-device (token, choice) pairs (`eplb.balancedness` of
                `physical_counts`; 1.0 is perfect): the mean over draws, and the worst draw
  busiest/chunk the busiest device's pairs per chunk run: the expert work that gates each
                lockstep chunk (its mean over the call's chunks and the draws)
  ms            CPU time of the call (first draw, best of 3). The 8 simulated devices share
                this machine's cores, so time follows the total work, not the busiest device:
                on real devices the busiest device's rows are what a chunk waits for.

Prints a table; writes `OUT/eplb.json` and the plot `OUT/eplb_balancedness.png`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from moejax import MoEConfig, eplb, files, moe_apply
from moejax.expert_placement import logical_load
from moejax.testing import random_params

MESHES = ((1, 8), (2, 4))
SHAPES = ((16, 2), (64, 8))  # (E, K)
STRENGTHS = (0.5, 1.0)
REDUNDANT = (8, 16, 32)


def skewed_logits(rng: np.random.Generator, tokens: int, experts: int, strength: float, order):
  """[T, E] logits: N(0, 1) + strength · log(popularity), Zipf(1.0) over shuffled experts."""
  popularity = 1.0 / (1.0 + np.argsort(order))  # expert order[0] is the most popular
  return rng.standard_normal((tokens, experts)) + strength * np.log(popularity)[None, :]


def measure(params, x, logits, config, mesh, placement, timed: bool) -> dict:
  """One call's balancedness, busiest device's pairs per chunk and, if `timed`, its time
  (best of 3; else NaN)."""
  run = lambda: moe_apply(
    params, x, config=config, mesh=mesh, router_logits=logits, placement=placement
  )
  _, aux = jax.block_until_ready(run())
  times = []
  for _ in range(3 if timed else 0):
    began = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - began)
  devices = mesh.shape[config.expert_axis]
  counts = np.asarray(aux.physical_counts)
  per_device = counts.reshape(devices, -1).sum(-1)
  chunks = max(int(np.max(aux.chunks_run)), 1)
  return dict(
    balancedness=eplb.balancedness(counts, devices),
    busiest_per_chunk=float(per_device.max() / chunks),
    mean_per_chunk=float(per_device.mean() / chunks),
    ms=1e3 * min(times) if times else float("nan"),
    counts=counts,
  )


def run_case(mesh_shape, experts, top_k, strength, tokens, redundant, seed, dims):
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "expert"))
  devices = mesh_shape[1]
  rng = np.random.default_rng(seed)
  order = rng.permutation(experts)
  base = MoEConfig(
    num_experts=experts,
    top_k=top_k,
    hidden_size=dims,
    intermediate_size=dims,
    chunk_size=256,
    dispatch="all_gather",
  )
  params = random_params(dataclasses.replace(base, num_redundant_experts=0), jax.random.key(seed))
  batch = lambda: (
    jax.numpy.asarray(rng.standard_normal((tokens, dims)), jax.numpy.float32),
    jax.numpy.asarray(skewed_logits(rng, tokens, experts, strength, order), jax.numpy.float32),
  )
  earlier, fresh = batch(), batch()
  timed = seed == 0
  plain = measure(params, *fresh, base, mesh, None, timed)
  history = measure(params, *earlier, base, mesh, None, False)["counts"]  # rebalanced on
  rows = [dict(redundant=0, **plain)]
  for spare in redundant:
    config = dataclasses.replace(base, num_redundant_experts=spare)
    placement = eplb.rebalance(
      logical_load(history, eplb.initial_placement(experts, 0)),
      num_physical=config.num_physical_experts,
      num_devices=devices,
    )
    physical = eplb.place(params, placement, config)
    measured = measure(physical, *fresh, config, mesh, placement, timed)
    rows.append(dict(redundant=spare, **measured))
  for row in rows:
    row.pop("counts")
    row.update(
      mesh=f"{mesh_shape[0]}x{mesh_shape[1]}", E=experts, K=top_k, strength=strength, draw=seed
    )
  return rows


def summarize(rows) -> list[dict]:
  """One row per (mesh, E, K, strength, R): balancedness mean and worst over draws."""
  keys = ("mesh", "E", "K", "strength", "redundant")
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    groups.setdefault(tuple(row[k] for k in keys), []).append(row)
  return [
    dict(
      zip(keys, key, strict=True),
      balancedness=float(np.mean([r["balancedness"] for r in draws])),
      worst=float(np.min([r["balancedness"] for r in draws])),
      busiest_per_chunk=float(np.mean([r["busiest_per_chunk"] for r in draws])),
      mean_per_chunk=float(np.mean([r["mean_per_chunk"] for r in draws])),
      ms=draws[0]["ms"],
    )
    for key, draws in groups.items()
  ]


def plot(rows, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cases = sorted({(r["mesh"], r["E"], r["K"]) for r in rows})
  fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.4), sharey=True)
  for ax, (mesh, experts, top_k) in zip(np.atleast_1d(axes), cases, strict=True):
    for strength in STRENGTHS:
      mine = [
        r
        for r in rows
        if (r["mesh"], r["E"], r["K"], r["strength"]) == (mesh, experts, top_k, strength)
      ]
      ax.plot([r["redundant"] for r in mine], [r["balancedness"] for r in mine], "-o",
              label=f"strength {strength}")  # fmt: skip
    ax.axhline(0.9, color="gray", lw=0.8, ls=":")
    ax.set(title=f"{mesh} mesh, E={experts}, K={top_k}", xlabel="redundant experts R")
    ax.grid(alpha=0.3)
  np.atleast_1d(axes)[0].set_ylabel("balancedness (mean / max device load)")
  np.atleast_1d(axes)[0].legend()
  fig.tight_layout()
  with files.atomic_path(path, overwrite=True) as temporary:
    fig.savefig(temporary, dpi=110)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=65536, help="tokens per batch (all devices)")
  parser.add_argument("--draws", type=int, default=3, help="independent routers and batches")
  parser.add_argument("--dims", type=int, default=64, help="D = F of the layer")
  parser.add_argument("--out", type=Path, default=Path("results"))
  parser.add_argument("--overwrite", action="store_true", help="replace earlier results in --out")
  parser.add_argument("--smoke", action="store_true", help="one mesh, one shape, R=8")
  args = parser.parse_args()
  meshes, shapes, strengths, redundant = MESHES, SHAPES, STRENGTHS, REDUNDANT
  if args.smoke:
    meshes, shapes, strengths, redundant = MESHES[:1], SHAPES[:1], (0.5,), (8,)
    args.tokens, args.draws = 512, 1
  draws = []
  for mesh_shape in meshes:
    for experts, top_k in shapes:
      for strength in strengths:
        for seed in range(args.draws):
          draws += run_case(
            mesh_shape, experts, top_k, strength, args.tokens, redundant, seed, args.dims
          )
  rows = summarize(draws)
  print(f"{'mesh':>5} {'E':>3} {'K':>2} {'str':>4} {'R':>3} {'balanced':>9} {'worst':>6} "
        f"{'busiest/chunk':>14} {'mean/chunk':>11} {'ms':>8}")  # fmt: skip
  for r in rows:
    print(
      f"{r['mesh']:>5} {r['E']:>3} {r['K']:>2} {r['strength']:>4} {r['redundant']:>3} "
      f"{r['balancedness']:>9.3f} {r['worst']:>6.3f} {r['busiest_per_chunk']:>14.1f} "
      f"{r['mean_per_chunk']:>11.1f} {r['ms']:>8.1f}"
    )
  meta = dict(jax=jax.__version__, tokens=args.tokens, dims=args.dims, draws=args.draws)
  results = json.dumps(dict(meta=meta, rows=rows, draws=draws), indent=1)
  files.write_atomically(args.out / "eplb.json", results, overwrite=True)
  plot(rows, args.out / "eplb_balancedness.png")


if __name__ == "__main__":
  main()
