"""The table of docs/fit.md: `python -m moejax fit` for every preset on N 8xH200 nodes, for
inference in the released format, LoRA r=16 over the released experts and full bf16
training (each layer rematerialized: `--remat full`), 4096 tokens per device. Prints one
markdown row per run, with its command.

  python benchmarks/fit_table.py --nodes 1
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs; nothing runs

import jax

from moejax import fit

JOBS = (("infer", "released"), ("lora", "released"), ("train", "none"))
GIB = 2**30


def row(model: str, job: str, quant: str, nodes: int) -> str:
  remat = "none" if job == "infer" else "full"
  report = fit.fit(
    model,
    "h200",
    nodes=nodes,
    job=job,
    expert_quant=None if quant == "none" else quant,
    remat=remat,
  )
  jax.clear_caches()
  bytes_ = report.per_device_bytes
  command = (
    f"python -m moejax fit --model {model} --nodes {nodes} --job {job} --expert-quant {quant}"
  )
  if remat != "none":
    command += f" --remat {remat}"
  return (
    f"| {model} | {job} | {report.expert_quant or 'bf16'} | {'yes' if report.fits else 'no'} | "
    f"{bytes_['total'] / GIB:.1f} | {bytes_['expert_weights'] / GIB:.1f} | "
    f"{bytes_['temp'] / GIB:.1f} | {report.estimate.stack_s:.2f} | `{command}` |"
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--nodes", type=int, default=1)
  parser.add_argument("--models", nargs="+", default=list(fit.PRESETS), help="presets to run")
  args = parser.parse_args()
  print(
    "| model | job | experts | fits | GiB per device | of it expert weights | of it temp | "
    "est. s per step (stack) | command |"
  )
  print("|---|---|---|---|---:|---:|---:|---:|---|")
  for model in args.models:
    for job, quant in JOBS:
      print(row(model, job, quant, args.nodes), flush=True)


if __name__ == "__main__":
  main()
