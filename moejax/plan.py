"""The expert plan: which path runs a call's experts, on which backend, and how. Decided once.

`plan_experts` is the only function that chooses; `forward` builds one `ExpertPlan` per call
(from the config, the default device and the call's static sizes) and every module that
would otherwise decide (`experts`, the `shard_map` options) reads it. The rule was measured
on an H200 (docs/performance.md, "GPU"):

- "tile_loop" (`experts.grouped_mlp`): one dense MLP per tile of an expert's rows. On a CPU
  it runs near the dense-matmul rate, where `jax.lax.ragged_dot` is an order of magnitude
  slower; it is also the only path with expert biases and GPT-OSS's activation.
- "ragged_dot" (`experts.sorted_mlp` on XLA): XLA's GPU lowering expands it densely over the
  groups, so it wins only with few local experts (El <= 8 on the H200: 2.2x the tile loop's
  forward at El=8, 0.26x its forward+backward at El=32), and never on a decode-size call.
- "pallas" (`experts.sorted_mlp` on a kernel): the fused `kernels_pallas.moe_mlp`; the
  registry picks the kernel (`kernels_pallas.backends.select_kernel`).

`expert_backend="xla"` takes the better XLA path; "pallas" the device's kernel (interpreted on
a CPU, for testing); "auto" a kernel only where `kernels_pallas.api.KERNEL_FASTER_FROM_ROWS` has a
measurement showing it faster, else the XLA path. LoRA adapters change no choice: every path
adds their products (the sorted paths in unfused grouped matmuls, `experts.adapted_mlp`).
"""

from __future__ import annotations

import dataclasses
import warnings

from kernels_pallas import platform
from kernels_pallas.api import measured_faster
from kernels_pallas.backends import (
  REFERENCE,
  Case,
  no_kernel_reason,
  select_kernel,
  unsupported_reason,
)
from moejax.config import MoEConfig

# Most local experts for which XLA's ragged_dot beats the tile loop on a GPU (H200, bf16).
RAGGED_DOT_MAX_LOCAL_EXPERTS = 8


@dataclasses.dataclass(frozen=True)
class ExpertPlan:
  """How one call computes its local experts (static, hashable).

  Attributes:
    path: "tile_loop", "ragged_dot" or "pallas".
    backend: the `kernels_pallas` backend `experts.sorted_mlp` runs ("xla" for ragged_dot, a
      kernel for pallas), None for the tile loop.
    interpret: whether that kernel runs in its interpreter (a CPU): slow, for testing.
  """

  path: str
  backend: str | None = None
  interpret: bool = False

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


def decode_sized(num_rows: int, local_experts: int) -> bool:
  """Whether a call has no more (row, choice) assignments than local experts.

  Then some experts surely have no rows, and the weights a call must read are those of the
  experts it uses (at most `num_rows` of El). The tile loop and the kernels read only those;
  XLA's ragged_dot on a GPU is rewritten into a dense dot that reads every expert
  (openxla/xla#46002), up to El / num_rows times the bytes. docs/performance.md, "Decode".
  """
  return num_rows <= local_experts


def plan_experts(config: MoEConfig, num_rows: int, local_experts: int) -> ExpertPlan:
  """The plan of a call whose experts get `num_rows` (row, choice) assignments (static).

  A config no kernel can run takes the tile loop, with a warning if it asked for kernels.

  >>> config = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128)
  >>> plan_experts(config, num_rows=512, local_experts=8)  # on a CPU
  ExpertPlan(path='tile_loop', backend=None, interpret=False)
  """
  plan, warning = choose_plan(config, num_rows, local_experts)
  if warning is not None:
    warnings.warn(warning, stacklevel=2)
  return plan


def choose_plan(
  config: MoEConfig, num_rows: int, local_experts: int
) -> tuple[ExpertPlan, str | None]:
  """`plan_experts`' choice, and the warning it deserves (None): for callers that only ask
  which path a call would take (`moejax.chunk_budget`)."""
  case = expert_case(config)
  kernel = select_kernel(case)
  if config.expert_backend == "pallas":
    if kernel is None:
      warning = (
        "expert_backend='pallas' falls back to the XLA tile loop: no kernel runs it "
        f"({no_kernel_reason(case)})"
      )
      return ExpertPlan("tile_loop"), warning
    warning = None
    if platform.on_cpu():
      warning = (
        "expert_backend='pallas' on a CPU runs the Pallas kernels in the interpreter: slow, "
        "for testing only"
      )
    return ExpertPlan("pallas", kernel, interpret=platform.on_cpu()), warning
  if config.expert_backend == "auto" and kernel is not None and measured_faster(kernel, num_rows):
    return ExpertPlan("pallas", kernel), None
  if (
    unsupported_reason(REFERENCE, case) is None
    and not platform.on_cpu()
    and local_experts <= RAGGED_DOT_MAX_LOCAL_EXPERTS
    and not decode_sized(num_rows, local_experts)
  ):
    return ExpertPlan("ragged_dot", REFERENCE), None
  return ExpertPlan("tile_loop"), None
