"""`python -m moejax fit`: `moejax.fit.fit` from flags, its report as a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from moejax.apps import fit_search
from moejax.apps.fit import FitReport, fit

GIB = 2**30


def run(args: argparse.Namespace) -> FitReport | fit_search.Search:
  """Runs the planner for the flags and prints its report; bad flags exit naming what is
  wrong, and a plan that does not fit exits with status 1 after its report. With --find, the
  search (`moejax.apps.fit_search`) instead."""
  if args.find:
    return _find(args)
  try:
    report = fit(
      args.model or args.config,
      args.gpu,
      nodes=args.nodes,
      gpus_per_node=args.gpus_per_node,
      expert_parallel=args.expert_parallel,
      expert_fsdp=args.expert_fsdp,
      shared_fsdp=args.shared_fsdp,
      dispatch=args.dispatch,
      receive_capacity_factor=args.receive_capacity_factor,
      remat=args.remat,
      context_tokens=args.context_tokens,
      progress=not args.json,
      **_job(args),
    )
  except (ValueError, RuntimeError, FileNotFoundError, NotImplementedError) as error:
    raise SystemExit(f"moejax fit: {error}") from None
  print(json.dumps(report.to_json(), indent=2) if args.json else text(report))
  for warning in report.warnings:
    print(f"moejax fit: warning: {warning}", file=sys.stderr)
  if not report.fits:
    raise SystemExit(1)
  return report


# The parts of the compiler's figures that `FitReport.per_device_bytes` names: the weights,
# adapters and optimizer state are arguments, the gradients temporaries.
_WITHIN = {
  "arguments": ("expert_weights", "other_moe_weights", "adapters", "rest_of_model",
                "optimizer_state"),
  "temp": ("gradients",),
}  # fmt: skip


def _memory_lines(per_device: dict[str, int]) -> list[str]:
  """The bytes per device as lines, each part indented under the figure it is part of, so
  that the unindented lines add up to the total (the last line)."""
  line = lambda name, indent: f"{' ' * indent}{name:{22 - indent}s} {per_device[name] / GIB:8.2f}"
  lines = []
  for name in ("arguments", "temp", "outputs_not_aliased", "kv_cache", "total"):
    lines.append(line(name, 2))
    lines += [line(part, 4) for part in _WITHIN.get(name, ()) if part in per_device]
  return lines


def text(report: FitReport) -> str:
  """The report for a reader: the verdict, the bytes per device, the estimate."""
  bytes_ = report.per_device_bytes
  mesh = " x ".join(f"{name} {size}" for name, size in report.mesh.items())
  lines = [
    f"{report.model}, job {report.job}, experts {report.expert_quant or 'bf16'}"
    f"{_fp8_words(report)}, on "
    f"{report.nodes} x {report.gpus_per_node} {report.gpu} (mesh {mesh}, chunk "
    f"{report.chunk_size}, experts by {report.expert_path}, {report.tokens_per_device} "
    "tokens per device, "
    f"{report.moe_layers} MoE layers)",
    f"{'fits' if report.fits else 'does NOT fit'}: {bytes_['total'] / GIB:.2f} GiB of "
    f"{report.gpu_memory_bytes / GIB:.2f} GiB per device (headroom "
    f"{report.headroom_bytes / GIB:+.2f} GiB)",
    "per device (GiB; the indented parts are within the line above them):",
    *_memory_lines(bytes_),
    f"estimated step time (an estimate): {report.estimate.layer_s * 1e3:.2f} ms per MoE layer, "
    f"{report.estimate.stack_s:.3f} s for the stack (the expert path's rate: "
    f"{report.estimate.rate_source}); {report.estimate.tokens_per_s_per_gpu:,.0f} tokens/s "
    "per GPU through the MoE stack",
    *(f"  assumes: {line}" for line in report.estimate.assumptions),
    *(f"note: {line}" for line in report.notes),
  ]
  return "\n".join(lines)


def _fp8_words(report: FitReport) -> str:
  """How the report's job computes and sends in fp8, as words after the experts' format."""
  words = [f"computed in {report.compute_quant}"] if report.compute_quant else []
  words += [f"dispatched in {report.dispatch_quant}"] if report.dispatch_quant else []
  return "".join(f", {w}" for w in words)


def _job(args: argparse.Namespace) -> dict:
  """`fit`'s arguments that describe the job, the same whether planned or searched."""
  return dict(
    job=args.job,
    expert_quant=None if args.expert_quant == "none" else args.expert_quant,
    lora_rank=args.lora_rank,
    compute_quant=args.compute_quant,
    dispatch_quant=args.dispatch_quant,
    expert_backend=args.backend,
    tokens_per_device=args.tokens_per_device,
    chunk_size=args.chunk_size,
  )


def _find(args: argparse.Namespace) -> fit_search.Search:
  """`fit --find`: each plan as it is tried, then the one found and its command."""
  fixed = _job(args)
  if not args.json:
    print("nodes  expert  fsdp  shared fsdp  dispatch    remat  total GiB  fits  compile s")
  yes = lambda flag: "yes" if flag else "no"
  show = lambda t: print(
    f"{t.nodes:5d}  {t.expert_parallel:6d}  {yes(t.expert_fsdp):>4}  {yes(t.shared_fsdp):>11}  "
    f"{t.dispatch:10s}  {t.remat:5s}  {t.total_bytes / GIB:9.2f}  {yes(t.fits):>4}"
    f"  {t.compile_s:9.1f}"
  )
  try:
    search = fit_search.find(
      args.model or args.config,
      args.gpu,
      max_nodes=args.max_nodes,
      gpus_per_node=args.gpus_per_node,
      report=(lambda tried: None) if args.json else show,
      **fixed,
    )
  except (ValueError, RuntimeError, FileNotFoundError, NotImplementedError) as error:
    raise SystemExit(f"moejax fit: {error}") from None
  if args.json:
    print(json.dumps(search.to_json(), indent=2))
  elif search.found is None:
    print(f"no plan tried fits on up to {args.max_nodes} nodes")
  else:
    print(f"fits on {search.found.nodes} node(s): {search.command}")
  if search.found is None:
    raise SystemExit(1)
  return search
