"""What the layer writes to GPU memory outside its kernels: the bytes of the arrays that XLA's
own ops (copies, gathers, scatters, adds, zeros, converts) write in the program compiled for
one H100, beside the bytes its kernels write, at DeepSeek-V3's expert shard (32 local experts,
K = 8, D = 7168, F = 2048; 4096 bf16 tokens in one chunk), forward and forward+backward, on
the grouped matmul kernels ("pallas") and the fused path ("fused").

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/glue_bytes.py [--against REV] [--out results]

Needs JAX's CUDA plugin (a venv with `jax[cuda13]`), not a GPU: the devices are compile-only
(`moejax.targets`). Nothing runs, so the figures are exact for the program this JAX's GPU
compiler emits, on any machine, and say nothing of time: a written array is read at least
once more, so they bound the glue's traffic from below. A kernel is a custom call (Pallas,
cuBLAS) or a custom fusion (XLA's own matmul emitters); an op in a conditional's false branch
(a skipped chunk's) is not counted, nor one writing no new array (bitcasts, tuples). With
`--against REV` the same rows come from the commit REV (a `git worktree` of it) beside this
checkout, with the ratio (this checkout / REV). Rows go to `OUT/glue_bytes.json`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import jax
import jax.numpy as jnp
from commits import compare_main
from jax.sharding import NamedSharding, PartitionSpec

from kernels_pallas import platform
from moejax import MoEConfig, moe_apply, targets
from moejax.testing import abstract_params

CONFIG = MoEConfig(
  num_experts=32, top_k=8, hidden_size=7168, intermediate_size=2048, chunk_size=4096,
  dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
)  # fmt: skip
TOKENS = 4096
PATHS = ("pallas", "fused")
# Ops that write no array of their own (or whose contents are counted where they run).
NOT_WRITES = {
  "bitcast", "get-tuple-element", "tuple", "parameter", "constant", "while", "conditional",
  "call", "after-all", "partition-id", "replica-id",
}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (.+?) ([a-z][\w-]*)\((.*)$")


# Bytes per element of the HLO element types a layer's program holds (4-bit types packed).
ITEM_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "s4": 0.5, "u4": 0.5,
  "f4e2m1fn": 0.5, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
  "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip


def array_bytes(shape: str) -> float:
  """Bytes of the arrays an HLO shape names ("bf16[4,8]{1,0}", or a tuple of them).

  >>> array_bytes("(bf16[4,8]{1,0}, s32[3]{0})")
  76
  """
  arrays = re.findall(r"\b([a-z]\w*)\[([\d,]*)\]", shape)
  return sum(ITEM_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in arrays)


def written_bytes(hlo: str) -> dict[str, float]:
  """{"kernels": bytes, "glue": bytes} the top-level ops of `hlo` (compiled HLO text) write."""
  skipped = set(re.findall(r"false_computation=(%[\w.-]+)", hlo))
  totals = {"kernels": 0.0, "glue": 0.0}
  counted = False
  for line in hlo.splitlines():
    if line and not line[0].isspace():  # a computation's header
      name = line.split(" ", 1)[0].removeprefix("ENTRY ")
      counted = not (name.startswith(("%fused", "%wrapped")) or name in skipped)
      counted = counted and "_computation" not in name
      continue
    match = _INSTRUCTION.match(line) if counted else None
    if match is None or match.group(2) in NOT_WRITES:
      continue
    shape, op, rest = match.groups()
    kernel = op == "custom-call" or (op == "fusion" and "kind=kCustom" in rest)
    totals["kernels" if kernel else "glue"] += array_bytes(shape)
  return totals


def compiled_hlo(config: MoEConfig, gradient: bool, tokens: int = TOKENS) -> str:
  """The layer's forward on `tokens` tokens (or the gradient of its sum, with respect to the
  parameters and x) compiled for one compile-only H100, as HLO text."""
  mesh = targets.target_mesh("h100", (1, 1), gpus_per_node=1)
  params = abstract_params(config, mesh)
  x = jax.ShapeDtypeStruct(
    (tokens, config.hidden_size), config.dtype, sharding=NamedSharding(mesh, PartitionSpec())
  )
  forward = lambda p, x: moe_apply(p, x, config=config, mesh=mesh)[0]
  loss = lambda p, x: jnp.sum(forward(p, x).astype(jnp.float32))
  program = jax.grad(loss, argnums=(0, 1)) if gradient else forward
  with platform.running_on(mesh.devices.flat[0]), jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Pallas Triton's deprecation, on JAX 0.11
    return jax.jit(program).lower(params, x).compile().as_text()


def measure() -> dict[str, float]:
  """Each path's GB written by its kernels and outside them, forward and forward+backward."""
  rows = {}
  for path in PATHS:
    config = dataclasses.replace(CONFIG, expert_backend=path)
    for run, gradient in (("forward", False), ("train", True)):
      for kind, count in written_bytes(compiled_hlo(config, gradient)).items():
        rows[f"{path} {run} {kind} GB"] = count / 1e9
  return rows


def main() -> None:
  compare_main("glue_bytes.py", measure, __doc__.split("\n")[0], ".3f")


if __name__ == "__main__":
  main()
