"""`python -m moejax fit --find`: the fewest nodes on which a job's MoE stack fits, found by
compiling the settings that trade memory (`moejax.fit.fit` for each), with what it tried."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moejax import hf
from moejax.apps.fit import FitReport, fit, model_json
from moejax.call_record import call_record
from moejax.config import MoEConfig
from moejax.inputs import unsplit_shared


@dataclasses.dataclass(frozen=True)
class Tried:
  """One candidate plan and what its compiled program needs per device."""

  nodes: int
  expert_parallel: int
  expert_fsdp: bool
  shared_fsdp: bool
  dispatch: str
  remat: str
  total_bytes: int
  fits: bool
  compile_s: float


@dataclasses.dataclass(frozen=True)
class Search:
  """What `find` found: the first plan that fits on the fewest nodes (None if none did up to
  the limit), the command that reproduces its report, and every plan tried, in order."""

  found: FitReport | None
  command: str | None
  tried: tuple[Tried, ...]

  def to_json(self) -> dict[str, Any]:
    return dict(
      found=None if self.found is None else self.found.to_json(),
      command=self.command,
      tried=[dataclasses.asdict(t) for t in self.tried],
    )


def node_counts(max_nodes: int) -> list[int]:
  """The node counts tried, fewest first: powers of two below `max_nodes`, then it.

  >>> node_counts(32), node_counts(6)
  ([1, 2, 4, 8, 16, 32], [1, 2, 4, 6])
  """
  counts = [1 << i for i in range(max_nodes.bit_length()) if 1 << i < max_nodes]
  return [*counts, max_nodes]


def settings(devices: int, config: MoEConfig, job: str) -> list[dict[str, Any]]:
  """The plans tried on `devices` GPUs for a layer of `config`, in order: every device on the
  expert axis (the fewest expert weights per device), then half and a quarter of them with
  the expert weights split over the data axis too (`expert_fsdp`; smaller exchange buffers,
  which grow with the expert-axis size); always the router and shared experts split over
  every device (`shared_fsdp`) where their shapes divide, and the dropless all_to_all (its
  buffers grow with that size less than all_gather's), each layer rematerialized when the
  job has a backward pass."""
  remat = "none" if job == "infer" else "full"
  experts = config.num_experts
  shared_fsdp = unsplit_shared(call_record(config), devices) is None
  widest = max(s for s in range(1, devices + 1) if devices % s == 0 and experts % s == 0)
  tried = []
  for expert_parallel in (widest, widest // 2, widest // 4):
    if expert_parallel < 1 or devices % expert_parallel or experts % expert_parallel:
      continue
    tried.append(
      dict(
        expert_parallel=expert_parallel,
        expert_fsdp=expert_parallel < devices,
        shared_fsdp=shared_fsdp,
        dispatch="all_to_all",
        remat=remat,
      )
    )
  return tried


def find(
  model: str | Path | dict[str, Any],
  gpu: str,
  *,
  max_nodes: int,
  gpus_per_node: int = 8,
  report: Callable[[Tried], None] = lambda tried: None,
  **fixed: Any,
) -> Search:
  """Tries `settings` on each of `node_counts(max_nodes)` in turn, and stops at the first
  plan that fits.

  Args:
    model, gpu, gpus_per_node: as `fit`'s.
    max_nodes: the most nodes to try.
    report: called with each plan as it is tried (the command line prints them).
    fixed: `fit`'s other arguments (job, expert_quant, lora_rank, compute_quant,
      dispatch_quant, expert_backend, tokens_per_device, chunk_size), the same for every
      plan.

  Returns:
    The `Search`.
  """
  config = hf.config_from_hf(model_json(model)[1])
  tried = []
  for nodes in node_counts(max_nodes):
    for plan in settings(nodes * gpus_per_node, config, fixed.get("job", "infer")):
      began = time.perf_counter()
      result = fit(model, gpu, nodes=nodes, gpus_per_node=gpus_per_node, **plan, **fixed)
      tried.append(
        Tried(
          nodes=nodes,
          **plan,
          total_bytes=result.per_device_bytes["total"],
          fits=result.fits,
          compile_s=time.perf_counter() - began,
        )
      )
      report(tried[-1])
      if result.fits:
        return Search(result, command(model, gpu, nodes, gpus_per_node, plan, fixed), tuple(tried))
  return Search(None, None, tuple(tried))


def command(model, gpu: str, nodes: int, gpus_per_node: int, plan: dict, fixed: dict) -> str:
  """The `python -m moejax fit` command whose report is the found plan's."""
  if isinstance(model, dict):
    source = "--config CONFIG_JSON"  # the dict, written to a file
  elif isinstance(model, str) and not Path(model).exists():
    source = f"--model {model}"
  else:
    source = f"--config {model}"
  flags = [
    f"python -m moejax fit {source} --gpu {gpu} --nodes {nodes} --gpus-per-node {gpus_per_node}",
    f"--expert-parallel {plan['expert_parallel']}",
    *(["--expert-fsdp"] if plan["expert_fsdp"] else []),
    *(["--shared-fsdp"] if plan["shared_fsdp"] else []),
    f"--dispatch {plan['dispatch']} --remat {plan['remat']}",
  ]
  names = dict(job="--job", lora_rank="--lora-rank", tokens_per_device="--tokens-per-device")
  if fixed.get("job") != "lora":  # the rank means nothing to another job
    names.pop("lora_rank")
  flags += [f"{names[key]} {value}" for key, value in fixed.items() if key in names]
  if "expert_quant" in fixed:
    flags.append(f"--expert-quant {fixed['expert_quant'] or 'none'}")
  flags += [
    f"--{key.replace('_', '-')} {fixed[key]}"
    for key in ("compute_quant", "dispatch_quant")
    if fixed.get(key) is not None
  ]
  if fixed.get("expert_backend", "auto") != "auto":
    flags.append(f"--backend {fixed['expert_backend']}")
  if fixed.get("chunk_size", "auto") != "auto":
    flags.append(f"--chunk-size {fixed['chunk_size']}")
  return " ".join(flags)
