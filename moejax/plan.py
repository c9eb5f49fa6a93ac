"""The expert plan: which path runs a call's experts, on which backend, and how. Decided once.

`plan_experts` is the only function that chooses; `forward` builds one `ExpertPlan` per call
(from the config, the default device and the call's static sizes) and every module that
would otherwise decide (`experts`, the `shard_map` options) reads it. The rule was measured
on an H200 (docs/performance.md, "GPU"):

- "tile_loop" (`experts.tile_loop_mlp`): one dense MLP per tile of an expert's rows. On a CPU
  it runs near the dense-matmul rate, where `jax.lax.ragged_dot` is an order of magnitude
  slower; it is also, with the fused path, the only one with expert biases (GPT-OSS's
  experts).
- "ragged_dot" (`experts.grouped_matmul_mlp` on XLA): XLA's GPU lowering expands it densely over the
  groups (it reads every local expert), so it wins only on small calls: on the H200 (bf16,
  2026-12-04) 3.7-6.5x the tile loop's speed at 2-512 (row, choice) assignments over 32
  local experts, 0.22-0.35x its forward+backward at 16,384 over 16 and 8, 0.09x at 32,768
  over 32. It takes calls of at most `RAGGED_DOT_MAX_ROWS` assignments over at most
  `RAGGED_DOT_MAX_LOCAL_EXPERTS` local experts; the crossover between 512 and 16,384 rows,
  and more local experts, are unmeasured.
- "pallas" (`experts.grouped_matmul_mlp` on a kernel): the fused `kernels_pallas.moe_mlp`; the
  registry picks the kernel (`kernels_pallas.backends.select_kernel`).
- "fused" (`experts.fused_mlp`): `kernels_pallas.fused_moe`, the whole MLP on rows read by
  index (Pallas Triton), for float or quantized experts (`expert_quant`: each tile decoded in
  the kernels), with or without biases, LoRA adapters (their rank-r products in the same
  kernels) and output norms (in XLA, between the down kernel and the sum over choices); with
  `batch_invariant`, its blocks fixed whatever the call's size; with
  `compute_quant="fp8_deepseek"`, its products on e4m3 operands (`fused_moe.FP8_BLOCKS`);
  only when asked (`expert_backend="fused"`) or where a tuning file measured it fastest.

`expert_backend="xla"` takes the better XLA path; "pallas" the device's kernel (interpreted on
a CPU, for testing); "fused" the fused path where it runs the case (else the tile loop, with a
warning); "auto" the path a tuning file measured fastest for the call on its device
kind (`moejax.tuning`: the user's, then the shipped table; `python -m moejax tune` writes
one), else the XLA path. With `batch_invariant=True` every backend but "pallas" and "fused"
(at fixed blocks) takes the tile loop, whatever the call's size. With `compute_quant` the
tile loop emulates every recipe; "pallas" takes the Hopper fp8 kernels
(`kernels_pallas.gmm_fp8`) for "fp8_deepseek" where they run the config (`fp8_kernel_reason`),
"fused" the fused kernels on e4m3 operands where they run it (`fused_unsupported_reason`;
at fixed blocks, so batch-invariant too), "auto" the path a tuning file measured fastest for
the recipe (its entries name it), else the tile loop.
LoRA adapters change no choice: every path adds their products (the sorted paths in unfused
grouped matmuls, `experts.adapted_mlp`; the fused path in its own kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Literal, NamedTuple

from kernels_pallas import fused_moe, platform
from kernels_pallas.backends import (
  BACKENDS,
  REFERENCE,
  BackendName,
  Case,
  no_kernel_reason,
  select_kernel,
  unsupported_reason,
)
from kernels_pallas.dequant import kernel_block
from moejax import tokamax_experts, tuning
from moejax.config import ExpertPath, MoEConfig

# The calls on which XLA's ragged_dot beat the tile loop on a GPU (H200, bf16, 2026-12-04):
# at most this many (row, choice) assignments, over at most this many local experts.
RAGGED_DOT_MAX_ROWS = 512
RAGGED_DOT_MAX_LOCAL_EXPERTS = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertPlan:
  """How one call computes its local experts (static, hashable).

  Attributes:
    path: "tile_loop", "ragged_dot", "pallas" or "fused".
    backend: what `experts.grouped_matmul_mlp` runs: for ragged_dot "xla" (`jax.lax`) or
      "tokamax" (`moejax.tokamax_experts`), for pallas a `kernels_pallas` kernel, for fused
      "triton"; None for the tile loop.
    interpret: whether that kernel runs in its interpreter (a CPU): slow, for testing.
    blocks: the kernel's forward block sizes (the backend's `blocks_type`) a tuning file
      measured, or None for `kernels_pallas`' own choice.
  """

  path: ExpertPath
  backend: BackendName | Literal["tokamax"] | None = None
  interpret: bool = False
  blocks: object = None

  @property
  def check_vma(self) -> bool:
    """`shard_map`'s varying-axes check: off for interpreted kernels, which JAX 0.10's Pallas
    interpreter fails ("dynamic_slice requires varying manual axes to match"; JAX's suggested
    workaround is to turn it off)."""
    return not self.interpret


def expert_case(config: MoEConfig) -> Case:
  """What the config's experts ask of a `kernels_pallas` backend."""
  return Case(
    config.dtype, config.activation, rhs_format=config.expert_quant, biases=config.expert_bias
  )


def plan_experts(config: MoEConfig, num_rows: int, local_experts: int) -> ExpertPlan:
  """The plan of a call whose experts get `num_rows` (row, choice) assignments (static).

  A config no kernel can run takes the tile loop, with a warning if it asked for kernels.

  >>> config = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128)
  >>> plan_experts(config, num_rows=512, local_experts=8)  # on a CPU
  ExpertPlan(path='tile_loop', backend=None, interpret=False, blocks=None)
  """
  choice = choose_plan(config, num_rows, local_experts)
  if choice.warning is not None:
    warnings.warn(choice.warning, stacklevel=2)
  return choice.plan


class ExpertChoice(NamedTuple):
  """`choose_plan`'s answer.

  Attributes:
    plan: the `ExpertPlan`.
    warning: what a caller that runs the plan should warn of, or None.
    reason: why this path, in words (the config field, the platform rule or the measured
      table the choice read): what `moejax.plan_call` reports.
  """

  plan: ExpertPlan
  warning: str | None
  reason: str
  measured: tuning.Measured | None = None


def choose_plan(config: MoEConfig, num_rows: int, local_experts: int) -> ExpertChoice:
  """`plan_experts`' choice, its warning and its reason: for callers that only ask which path
  a call would take, and why (`moejax.chunk_budget`, `moejax.plan_call`)."""
  case = expert_case(config)
  kernel = select_kernel(case)
  if config.compute_quant is not None:
    return _quantized_compute_choice(config, num_rows, local_experts)
  if config.expert_backend == "fused":
    return _fused_choice(config)
  if config.expert_backend == "pallas":
    if kernel is None:
      why = f"no kernel runs it ({no_kernel_reason(case)})"
      warning = f"expert_backend='pallas' falls back to the XLA tile loop: {why}"
      return ExpertChoice(
        ExpertPlan(path="tile_loop"), warning, f"expert_backend='pallas', but {why}"
      )
    reason = f"expert_backend='pallas': {kernel}, the device's kernel for the case"
    if not platform.on_cpu():
      return ExpertChoice(ExpertPlan(path="pallas", backend=kernel), None, reason)
    warning = (
      "expert_backend='pallas' on a CPU runs the Pallas kernels in the interpreter: slow, "
      "for testing only"
    )
    return ExpertChoice(ExpertPlan(path="pallas", backend=kernel, interpret=True), warning, reason)
  if config.batch_invariant:
    reason = (
      "batch_invariant=True: the tile loop at fixed tile rows, whatever the call's size "
      "(ragged_dot's lowering and the measured choice both depend on it)"
    )
    return ExpertChoice(ExpertPlan(path="tile_loop"), None, reason)
  xla = _xla_choice(config, case, num_rows, local_experts)
  if config.expert_backend != "auto":
    return xla
  found = tuning.measured(config, num_rows, local_experts)
  if found is not None:
    return ExpertChoice(_tuned_plan(found, config), None, found.reason(num_rows), found)
  if platform.on_cpu():
    return xla._replace(reason=f"expert_backend='auto', no tuning entry: {xla.reason}")
  target = platform.target()
  _say_once_how_to_tune(target.name, xla.plan.path)
  where = f"{tuning.user_file(target.device_kind)}, the shipped table" if target.device_kind else ""
  return xla._replace(
    reason=f"expert_backend='auto', no tuning entry for this case on {target.name}"
    f"{f' ({where})' if where else ''}: {xla.reason}"
  )


def fused_unsupported_reason(config: MoEConfig) -> str | None:
  """Why the fused path cannot run the config's experts, or None."""
  width, hidden = config.expert_width, config.intermediate_size
  forms = ()
  if config.expert_quant is not None:
    block = kernel_block(config.expert_quant, config.quant_block)
    forms = (fused_moe.WeightForm(config.expert_quant, block),)
  if config.compute_quant is not None:
    blocks = fused_moe.FP8_BLOCKS
  else:
    blocks = fused_moe.default_blocks(0, width, hidden)
  return fused_moe.unsupported_reason(width, hidden, blocks, forms, config.compute_quant)


def fp8_kernel_reason(config: MoEConfig) -> str | None:
  """Why the Hopper fp8 kernels (`kernels_pallas.gmm_fp8`, on the pallas path) cannot run the
  config's quantized compute, or None."""
  if config.compute_quant != "fp8_deepseek":
    return f"they run 'fp8_deepseek', not compute_quant={config.compute_quant!r}"
  for field, value, what in (
    ("lora_rank", config.lora_rank, "experts without adapters"),
    ("expert_bias", config.expert_bias, "experts without biases"),
    ("batch_invariant", config.batch_invariant, "calls without batch invariance"),
  ):
    if value:
      return f"they take {what}, not {field}={value!r}"
  capability = platform.gpu_compute_capability()
  if capability is not None and not BACKENDS["mosaic"].made_for(capability):
    return f"they are made for Hopper (wgmma), not GPU capability {capability}"
  return None


def _quantized_compute_choice(config: MoEConfig, num_rows: int, local_experts: int) -> ExpertChoice:
  """For `compute_quant`: the Hopper fp8 kernels where `expert_backend="pallas"` asks and
  they run the config, the fused kernels where "fused" asks and they run it (interpreted on a
  CPU), with "auto" the path a tuning file measured fastest for the recipe, else the tile
  loop, the path that emulates every recipe; a warning where kernels were asked for and not
  taken."""
  if config.expert_backend == "auto":
    found = tuning.measured(config, num_rows, local_experts)
    if found is not None:
      return ExpertChoice(_tuned_plan(found, config), None, found.reason(num_rows), found)
  why = f"compute_quant={config.compute_quant!r} runs on the tile loop"
  if config.expert_backend == "fused":
    reason = fused_unsupported_reason(config)
    if reason is None:
      return _fused_choice(config)
    why += f" (the fused kernels: {reason})"
  if config.expert_backend == "pallas":
    reason = fp8_kernel_reason(config)
    if reason is None:
      plan = ExpertPlan(path="pallas", backend="mosaic", interpret=platform.on_cpu())
      warning = (
        "expert_backend='pallas' on a CPU runs the fp8 kernels in the Mosaic GPU interpreter: "
        "slow, for testing only"
      )
      says = "expert_backend='pallas' with compute_quant='fp8_deepseek': the Hopper fp8 kernels"
      return ExpertChoice(plan, warning if plan.interpret else None, says)
    why += f" (the fp8 kernels: {reason})"
  warning = None
  if config.expert_backend in ("pallas", "fused"):
    warning = f"expert_backend={config.expert_backend!r} falls back to the XLA tile loop: {why}"
  return ExpertChoice(ExpertPlan(path="tile_loop"), warning, f"the tile loop: {why}")


def _fused_choice(config: MoEConfig) -> ExpertChoice:
  why = fused_unsupported_reason(config)
  if why is not None:
    warning = f"expert_backend='fused' falls back to the XLA tile loop: {why}"
    return ExpertChoice(ExpertPlan(path="tile_loop"), warning, f"expert_backend='fused', but {why}")
  reason = "expert_backend='fused': the whole expert MLP on rows read by index (Pallas Triton)"
  blocks = None  # the kernels' choice, by the call's size
  if config.compute_quant is not None:  # fixed blocks: batch-invariant too
    blocks = fused_moe.FP8_BLOCKS
    reason += f", its products in fp8 (compute_quant={config.compute_quant!r})"
  elif config.batch_invariant:
    blocks = fused_moe.batch_invariant_blocks(config.expert_width, config.intermediate_size)
    reason += ", its blocks fixed whatever the call's size (batch_invariant)"
  plan = ExpertPlan(path="fused", backend="triton", interpret=platform.on_cpu(), blocks=blocks)
  if not plan.interpret:
    return ExpertChoice(plan, None, reason)
  warning = (
    "expert_backend='fused' on a CPU runs the Pallas kernels in the interpreter: slow, for "
    "testing only"
  )
  return ExpertChoice(plan, warning, reason)


def _tuned_plan(found: tuning.Measured, config: MoEConfig) -> ExpertPlan:
  """The plan of a tuning file's winner; one that cannot run the case is an error."""
  chosen, case = found.candidate, expert_case(config)
  if chosen.path == "tile_loop":
    return ExpertPlan(path="tile_loop")
  if chosen.path == "fused":
    why = fused_unsupported_reason(config)
  elif config.compute_quant is not None:  # the Hopper fp8 kernels
    why = fp8_kernel_reason(config) if chosen.backend == "mosaic" else "no fp8 kernel"
  elif chosen.backend == tokamax_experts.TOKAMAX:
    why = tokamax_experts.unsupported_reason(case)
  else:
    why = unsupported_reason(chosen.backend, case) if chosen.backend in BACKENDS else "unknown"
  if why is not None:
    raise tuning.TuningFileError(
      f"tuning file {found.source} names {chosen.name} for a case it cannot run ({why})"
    )
  blocks = chosen.blocks and BACKENDS[chosen.backend].blocks_type(**chosen.blocks)
  if config.compute_quant is not None:  # the fp8 kernels' own blocks
    blocks = fused_moe.FP8_BLOCKS if chosen.path == "fused" else None
  return ExpertPlan(
    path=chosen.path, backend=chosen.backend, interpret=platform.on_cpu(), blocks=blocks
  )


@functools.cache
def _say_once_how_to_tune(device_kind: str, path: str) -> None:
  logging.getLogger("moejax").warning(
    "moejax: expert_backend='auto' on %s runs the XLA %s: no tuning entry measured the "
    "kernels here. `python -m moejax tune` measures every path for your layer (see "
    "docs/tuning.md).",
    device_kind,
    path,
  )


def _xla_choice(config: MoEConfig, case: Case, num_rows: int, local_experts: int) -> ExpertChoice:
  """The better XLA path, and why."""
  unsupported = unsupported_reason(REFERENCE, case)
  if unsupported is not None:
    reason = f"the tile loop; ragged_dot cannot run this case: {unsupported}"
  elif platform.on_cpu():
    reason = "the tile loop: on a CPU ragged_dot is an order of magnitude slower"
  elif local_experts > RAGGED_DOT_MAX_LOCAL_EXPERTS:
    reason = (
      f"the tile loop: {local_experts} local experts, more than the "
      f"{RAGGED_DOT_MAX_LOCAL_EXPERTS} up to which ragged_dot measured faster on a GPU"
    )
  elif num_rows > RAGGED_DOT_MAX_ROWS:
    reason = (
      f"the tile loop: {num_rows} rows, more than the {RAGGED_DOT_MAX_ROWS} up to which "
      "ragged_dot measured faster on a GPU"
    )
  else:
    reason = (
      f"ragged_dot: {num_rows} rows over {local_experts} local experts on a GPU, at most "
      f"{RAGGED_DOT_MAX_ROWS} over {RAGGED_DOT_MAX_LOCAL_EXPERTS} (measured faster than the "
      "tile loop on an H200)"
    )
    return ExpertChoice(ExpertPlan(path="ragged_dot", backend=REFERENCE), None, reason)
  return ExpertChoice(ExpertPlan(path="tile_loop"), None, reason)
