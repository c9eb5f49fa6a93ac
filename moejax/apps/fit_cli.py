"""`python -m moejax fit`: `moejax.fit.fit` from flags, its report as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from moejax.apps.fit import FitReport, fit

GIB = 2**30


def run(args: argparse.Namespace) -> FitReport:
  """Runs the planner for the flags and prints its report; bad flags exit naming what is
  wrong, and a plan that does not fit exits with status 1 after its report."""
  try:
    report = fit(
      args.model or args.config,
      args.gpu,
      nodes=args.nodes,
      gpus_per_node=args.gpus_per_node,
      job=args.job,
      expert_quant=None if args.expert_quant == "none" else args.expert_quant,
      lora_rank=args.lora_rank,
      tokens_per_device=args.tokens_per_device,
      expert_parallel=args.expert_parallel,
      expert_fsdp=args.expert_fsdp,
      dispatch=args.dispatch,
      chunk_size=args.chunk_size,
      remat=args.remat,
      progress=not args.json,
    )
  except (ValueError, RuntimeError, FileNotFoundError, NotImplementedError) as error:
    raise SystemExit(f"moejax fit: {error}") from None
  print(json.dumps(report.to_json(), indent=2) if args.json else text(report))
  for warning in report.warnings:
    print(f"moejax fit: warning: {warning}", file=sys.stderr)
  if not report.fits:
    raise SystemExit(1)
  return report


def text(report: FitReport) -> str:
  """The report for a reader: the verdict, the bytes per device, the estimate."""
  bytes_ = report.per_device_bytes
  mesh = " x ".join(f"{name} {size}" for name, size in report.mesh.items())
  lines = [
    f"{report.model}, job {report.job}, experts {report.expert_quant or 'bf16'}, on "
    f"{report.nodes} x {report.gpus_per_node} {report.gpu} (mesh {mesh}, chunk "
    f"{report.chunk_size}, experts by {report.expert_path}, {report.tokens_per_device} "
    "tokens per device, "
    f"{report.moe_layers} MoE layers)",
    f"{'fits' if report.fits else 'does NOT fit'}: {bytes_['total'] / GIB:.2f} GiB of "
    f"{report.gpu_memory_bytes / GIB:.2f} GiB per device (headroom "
    f"{report.headroom_bytes / GIB:+.2f} GiB)",
    "per device (GiB):",
    *(f"  {name:20s} {value / GIB:8.2f}" for name, value in bytes_.items()),
    f"estimated step time (an estimate): {report.estimate.layer_s * 1e3:.2f} ms per MoE layer, "
    f"{report.estimate.stack_s:.3f} s for the stack (the expert path's rate: "
    f"{report.estimate.rate_source}); {report.estimate.tokens_per_s_per_gpu:,.0f} tokens/s "
    "per GPU through the MoE stack",
    *(f"  assumes: {line}" for line in report.estimate.assumptions),
    *(f"note: {line}" for line in report.notes),
  ]
  return "\n".join(lines)
