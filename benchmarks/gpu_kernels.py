"""GPU benchmark of the grouped-matmul kernels: TFLOP/s per backend against XLA and a ceiling.

On named MoE shapes, bf16, for each backend ("xla" is `jax.lax.ragged_dot`): the first expert
matmul (`gmm`, [T*K, D] x [E, D, 2F]) forward and forward+backward, the whole fused expert MLP
(`moe_mlp`) forward and forward+backward, and the weight-gradient product `tgmm`; plus jax's
own Hopper `ragged_dot_mgpu` (a peer baseline) and a dense matmul of the same FLOPs (the
measured ceiling, forward and forward+backward). Group sizes are balanced or skewed (half
the rows to one expert). Then gmm and moe_mlp on quantized (`BlockScaled`) weights against
bf16 at 128, 512 and 4096 tokens, per backend and on the fused path (`run_quant`). Times are
medians of device-synchronised calls after a compile call.

  python benchmarks/gpu_kernels.py            # on a GPU: the table, JSON under results/
  python benchmarks/gpu_kernels.py --tune     # also autotune Mosaic block sizes (cached JSON)
  python benchmarks/gpu_kernels.py --smoke    # tiny shapes, kernels interpreted (CPU check)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import MosaicBlocks, TritonBlocks, autotune, gmm, moe_mlp
from kernels_pallas.backends import BACKENDS
from kernels_pallas.compat import triton_missing_reason
from kernels_pallas.formats import FORMATS
from kernels_pallas.fused_moe import fused_moe_mlp
from kernels_pallas.ops import KernelSettings, transposed_grouped_matmul
from moejax import files
from moejax.activations import GatedActivation


@dataclasses.dataclass(frozen=True)
class Shape:
  """A named MoE expert shape: hidden D, expert width F, E experts on this device, top-K."""

  name: str
  d: int
  f: int
  experts: int
  top_k: int


MIXTRAL = Shape("mixtral_8x7b", d=4096, f=14336, experts=8, top_k=2)
DEEPSEEK = Shape("deepseek_v3_shard", d=7168, f=2048, experts=32, top_k=8)
# (shape, tokens, skewed): training-size calls first, then the layer's chunk-size calls.
CASES = (
  (MIXTRAL, 4096, False),
  (MIXTRAL, 4096, True),
  (DEEPSEEK, 4096, False),
  (MIXTRAL, 256, False),
  (DEEPSEEK, 512, False),
)
SMOKE = Shape("smoke", d=64, f=32, experts=4, top_k=2)
SMOKE_CASES = ((SMOKE, 64, False),)
# Quantized weights: DeepSeek-V3's expert shard at decode to training token counts (weight
# streaming bounds the small ones: fp8 reads half the bytes of bf16, mxfp4 about a quarter).
QUANT_TOKENS = (128, 512, 4096)
# Ops without a dense twin of their own compare with the dense rate of the same FLOPs.
CEILING_OF = {"moe_mlp_fwd_bwd": "gmm_fwd_bwd", "tgmm": "gmm"}


def group_sizes(rows: int, experts: int, skewed: bool) -> jax.Array:
  """Balanced sizes, or half of the rows on expert 0 and the rest balanced."""
  if skewed:
    rest = np.full(experts - 1, (rows // 2) // (experts - 1))
    sizes = np.concatenate([[rows - rest.sum()], rest])
  else:
    sizes = np.full(experts, rows // experts)
    sizes[: rows - sizes.sum()] += 1
  return jnp.asarray(sizes, jnp.int32)


def median_seconds(fn: Callable, *args, repeats: int) -> float:
  """Median wall time of `fn(*args)` (device-synchronised) over `repeats` calls, after one."""
  return float(np.median(autotune.call_times(lambda: fn(*args), repeats)))


def backend_kwargs(smoke: bool) -> dict[str, dict]:
  """Keyword arguments of gmm / moe_mlp per backend (small blocks when interpreted)."""
  if not smoke:
    return {name: dict(implementation=name) for name in BACKENDS}
  return {
    "xla": dict(implementation="xla"),
    "triton": dict(implementation="triton", interpret=True, config=TritonBlocks(16, 16, 16)),
    "mosaic": dict(implementation="mosaic", interpret=True, config=MosaicBlocks(64, 16, 16, 2)),
  }


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


def forward_backward(fn: Callable) -> Callable:
  """fn's forward and backward passes, pulled back from a random cotangent (the last
  argument), returning the output with the gradients. The gradient of a plain sum would not
  do: its all-ones cotangent lets XLA simplify a dense matmul's backward into row sums; nor
  the gradients alone: XLA drops a forward whose output nothing uses (GPU run 2's dense
  ceiling, 1126 TF/s on an H200 of 989)."""

  def run(*args):
    *inputs, cotangent = args
    out, pullback = jax.vjp(fn, *inputs)
    return out, pullback(cotangent.astype(out.dtype))

  return run


def case_calls(shape: Shape, sizes, kwargs_by_backend, smoke: bool) -> list[tuple]:
  """(op, backend, FLOP multiple of one gmm, function, operand names) to time."""
  f = shape.f
  dense_mlp = lambda x, wgu, wd: (jax.nn.silu(x @ wgu[:, :f]) * (x @ wgu[:, f:])) @ wd
  calls = [
    ("gmm", "dense (ceiling)", 1.0, lambda x, w: x @ w, ("x", "w_gate_up_0")),
    (
      "gmm_fwd_bwd",
      "dense (ceiling)",
      3.0,
      forward_backward(lambda x, w: x @ w),
      ("x", "w_gate_up_0", "dout"),
    ),
    ("moe_mlp", "dense (ceiling)", 1.5, dense_mlp, ("x", "w_gate_up_0", "w_down_0")),
  ]
  for name, kw in kwargs_by_backend.items():
    run_gmm = lambda x, w, kw=kw: gmm(x, w, sizes, **kw)
    run_mlp = lambda x, wgu, wd, kw=kw: moe_mlp(x, wgu, wd, sizes, **kw)
    backend = BACKENDS[name]
    settings = KernelSettings(
      name,
      None,
      kw.get("config") or backend.tgmm_blocks(int(jnp.sum(sizes)), shape.d, 2 * f),
      interpret=kw.get("interpret", False),
    )
    calls += [
      ("gmm", name, 1.0, run_gmm, ("x", "w_gate_up")),
      ("gmm_fwd_bwd", name, 3.0, forward_backward(run_gmm), ("x", "w_gate_up", "dout")),
      ("moe_mlp", name, 1.5, run_mlp, ("x", "w_gate_up", "w_down")),
      (
        "moe_mlp_fwd_bwd",
        name,
        4.5,
        forward_backward(run_mlp),
        ("x", "w_gate_up", "w_down", "d_x"),
      ),
      (
        "tgmm",
        name,
        1.0,
        lambda x, dy, s=settings: transposed_grouped_matmul(x, dy, sizes, s),
        ("x", "dout"),
      ),
    ]
  if not smoke:
    calls.append(
      (
        "gmm",
        "jax ragged_dot_mgpu",
        1.0,
        lambda x, w: upstream_ragged_dot(x, w, sizes),
        ("x", "w_gate_up"),
      )
    )
  return calls


def run_case(
  shape: Shape,
  tokens: int,
  skewed: bool,
  kwargs_by_backend,
  smoke: bool,
  record: Callable[[dict], None],
) -> None:
  """Times every call of one (shape, tokens, skew) case; a failing call is recorded, not
  raised. Each row's `of_ceiling` divides by the dense rate of the same op and direction."""
  rows = tokens * shape.top_k
  keys = jax.random.split(jax.random.key(tokens), 5)
  scale = lambda fan_in: 1.0 / np.sqrt(fan_in)
  operands = dict(
    x=jax.random.normal(keys[0], (rows, shape.d), jnp.bfloat16),
    w_gate_up=(
      jax.random.normal(keys[1], (shape.experts, shape.d, 2 * shape.f)) * scale(shape.d)
    ).astype(jnp.bfloat16),
    w_down=(jax.random.normal(keys[2], (shape.experts, shape.f, shape.d)) * scale(shape.f)).astype(
      jnp.bfloat16
    ),
    dout=jax.random.normal(keys[3], (rows, 2 * shape.f), jnp.bfloat16),
  )
  operands["d_x"] = jax.random.normal(keys[4], (rows, shape.d), jnp.bfloat16)  # moe_mlp's dout
  operands["w_gate_up_0"], operands["w_down_0"] = operands["w_gate_up"][0], operands["w_down"][0]
  sizes = group_sizes(rows, shape.experts, skewed)
  gmm_flops = 2 * rows * shape.d * 2 * shape.f
  ceilings: dict[str, float] = {}
  for op, name, multiple, fn, names in case_calls(shape, sizes, kwargs_by_backend, smoke):
    row = dict(shape=shape.name, tokens=tokens, skewed=skewed, op=op, backend=name)
    try:
      seconds = median_seconds(
        jax.jit(fn), *[operands[n] for n in names], repeats=1 if smoke else 5
      )
      row.update(ms=seconds * 1e3, tflops=multiple * gmm_flops / seconds / 1e12)
      if name.startswith("dense"):
        ceilings[op] = row["tflops"]
      ceiling = ceilings.get(op) or ceilings.get(CEILING_OF.get(op, op))
      row["of_ceiling"] = row["tflops"] / ceiling if ceiling else None
    except Exception as error:  # a backend that fails a case is a result to report
      row.update(error=f"{type(error).__name__}: {str(error)[:300]}")
    record(row)


def run_quant(smoke: bool, record: Callable[[dict], None]) -> None:
  """gmm and moe_mlp forward on `BlockScaled` weights against bf16 ones, per backend and
  format the backend takes (`Backend.quant_formats`), balanced groups; then the fused path
  (`kernels_pallas.fused_moe`, backend "fused": the whole MLP on token rows read by index,
  uniform random ids) on every format. Each row's `of_bf16_time` is its time over the same
  backend's bf16 time (below 1: faster)."""
  from moejax.quant import quantize

  shape, token_counts = (SMOKE, (64,)) if smoke else (DEEPSEEK, QUANT_TOKENS)
  # Each format's own block (fp8_block's 128x128 cut to 32x32 for the smoke run's sizes).
  block = lambda fmt: (32, 32) if smoke and fmt == "fp8_block" else FORMATS[fmt].block_for(shape.f)
  keys = jax.random.split(jax.random.key(7), 5)
  floats = dict(
    w_gate_up=jax.random.normal(keys[0], (shape.experts, shape.d, 2 * shape.f)) / shape.d**0.5,
    w_down=jax.random.normal(keys[1], (shape.experts, shape.f, shape.d)) / shape.f**0.5,
  )

  def weights_in(formats) -> dict:
    weights = {None: {k: w.astype(jnp.bfloat16) for k, w in floats.items()}}
    return weights | {
      fmt: {k: quantize(w, fmt, block(fmt)) for k, w in floats.items()} for fmt in formats
    }

  for name, kw in backend_kwargs(smoke).items():
    formats = BACKENDS[name].quant_formats
    weights = weights_in(formats)
    for tokens in token_counts if formats else ():
      rows = tokens * shape.top_k
      x = jax.random.normal(keys[2], (rows, shape.d), jnp.bfloat16)
      sizes = group_sizes(rows, shape.experts, skewed=False)
      ops = dict(
        gmm=lambda w, kw=kw, x=x, sizes=sizes: gmm(x, w["w_gate_up"], sizes, **kw),
        moe_mlp=lambda w, kw=kw, x=x, sizes=sizes: moe_mlp(
          x, w["w_gate_up"], w["w_down"], sizes, **kw
        ),
      )
      for op, fn in ops.items():
        row = dict(section="quant", shape=shape.name, tokens=tokens, op=op, backend=name)
        _rows_by_format(record, row, fn, weights, smoke)
  if triton_missing_reason() is not None:
    return
  weights = weights_in(tuple(FORMATS))
  fused_kwargs = dict(
    activation=GatedActivation("silu").in_kernel,
    blocks=TritonBlocks(16, 16, 16) if smoke else None,
    interpret=smoke,
  )
  for tokens in token_counts:
    x = jax.random.normal(keys[2], (tokens, shape.d), jnp.bfloat16)
    ids = jax.random.randint(keys[3], (tokens, shape.top_k), 0, shape.experts)
    combine = jax.random.uniform(keys[4], (tokens, shape.top_k))
    fn = lambda w, x=x, ids=ids, combine=combine: fused_moe_mlp(
      x, ids, combine, w["w_gate_up"], w["w_down"], **fused_kwargs
    )
    row = dict(section="quant", shape=shape.name, tokens=tokens, op="moe_mlp", backend="fused")
    _rows_by_format(record, row, fn, weights, smoke)


def _rows_by_format(record, row: dict, fn: Callable, weights: dict, smoke: bool) -> None:
  """Records `row` once per weights format of `weights` (None: bf16, first) with the time
  of `fn(weights[format])` and its ratio to the bf16 time, or the error it raised."""
  bf16_seconds = None
  for fmt, w in weights.items():
    measured = dict(row, weights=fmt or "bf16")
    try:
      seconds = median_seconds(jax.jit(fn), w, repeats=1 if smoke else 10)
      bf16_seconds = bf16_seconds or seconds
      measured.update(ms=seconds * 1e3, of_bf16_time=seconds / bf16_seconds)
    except Exception as error:  # a failing case is a result to report
      measured.update(error=f"{type(error).__name__}: {str(error)[:300]}")
    record(measured)


def tune(cases) -> None:
  """Autotunes the Mosaic forward kernel's blocks for each case's gmm shape."""
  for shape, tokens, _ in cases:
    rows = tokens * shape.top_k
    x = jnp.ones((rows, shape.d), jnp.bfloat16)
    w = jnp.ones((shape.experts, shape.d, 2 * shape.f), jnp.bfloat16)
    sizes = group_sizes(rows, shape.experts, skewed=False)
    key = autotune.cache_key("gmm", "mosaic", (rows, shape.d, 2 * shape.f, shape.experts), x.dtype)
    make_call = lambda blocks, x=x, w=w, sizes=sizes: functools.partial(
      jax.jit(functools.partial(gmm, implementation="mosaic", config=blocks)), x, w, sizes
    )
    candidates = BACKENDS["mosaic"].candidate_blocks
    print(f"tuned {key}: {autotune.autotune(key, candidates, make_call)}")


def format_quant_table(rows: list[dict]) -> str:
  """A markdown table of `run_quant`'s rows."""
  lines = [
    "| shape | tokens | op | backend | weights | ms | x bf16 time |",
    "|---|---:|---|---|---|---:|---:|",
  ]
  for r in rows:
    measured = f"failed: {r['error'][:80]} | " if "error" in r else (
      f"{r['ms']:.3f} | {r['of_bf16_time']:.2f}"
    )  # fmt: skip
    lines.append(
      f"| {r['shape']} | {r['tokens']} | {r['op']} | {r['backend']} | {r['weights']} | {measured} |"
    )
  return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
  """A markdown table of the rows (`run_quant`'s in a table of their own)."""
  quant = [r for r in rows if r.get("section") == "quant"]
  rows = [r for r in rows if r.get("section") != "quant"]
  lines = [
    "| shape | tokens | skewed | op | backend | ms | TFLOP/s | x ceiling |",
    "|---|---:|---|---|---|---:|---:|---:|",
  ]
  for r in rows:
    case = f"| {r['shape']} | {r['tokens']} | {'yes' if r['skewed'] else 'no'} | {r['op']} | "
    if "error" in r:
      lines.append(f"{case}{r['backend']} | failed: {r['error'][:80]} | | |")
      continue
    ratio = "" if r["of_ceiling"] is None else f"{r['of_ceiling']:.2f}"
    lines.append(f"{case}{r['backend']} | {r['ms']:.3f} | {r['tflops']:.1f} | {ratio} |")
  return "\n".join(lines) + ("\n\n" + format_quant_table(quant) if quant else "")


def run(
  smoke: bool, record: Callable[[dict], None], tune_first: bool = False, quant: bool = True
) -> None:
  """Runs every case (with `quant`, `run_quant`'s too), handing each measured row to
  `record` as soon as it exists."""
  cases = SMOKE_CASES if smoke else CASES
  if tune_first:
    tune(cases)
  kwargs_by_backend = backend_kwargs(smoke)
  for shape, tokens, skewed in cases:
    run_case(shape, tokens, skewed, kwargs_by_backend, smoke, record)
  if quant:
    run_quant(smoke, record)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreters (CPU)")
  parser.add_argument("--tune", action="store_true", help="autotune Mosaic blocks first")
  parser.add_argument("--out", default="results/gpu_kernels.json")
  parser.add_argument("--overwrite", action="store_true", help="replace earlier results in --out")
  args = parser.parse_args()
  if not args.overwrite:
    files.refuse_existing([args.out], how="pass --overwrite")
  device = jax.devices()[0]
  if device.platform != "gpu" and not args.smoke:
    raise SystemExit(f"needs a GPU (found {device.device_kind}); use --smoke for a CPU check")
  rows: list[dict] = []
  start = time.perf_counter()
  run(args.smoke, rows.append, tune_first=args.tune)
  print(f"{device.device_kind}, JAX {jax.__version__}, bf16, {time.perf_counter() - start:.0f} s")
  print(format_table(rows))
  results = dict(device=device.device_kind, jax=jax.__version__, rows=rows)
  files.write_atomically(args.out, json.dumps(results, indent=1), overwrite=True)
  if any("error" in r for r in rows):
    raise SystemExit("some cases failed: see the table")


if __name__ == "__main__":
  main()
