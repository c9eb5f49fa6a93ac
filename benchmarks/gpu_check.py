"""One-shot GPU check: the backend test base, the layer on the kernels, and the benchmarks.

Parts, each in its own process with a time limit (a GPU fault or a hang in one part cannot
stop the others), each writing `DIR/<part>.json` as it goes:

  whole_layer benchmarks/whole_layer.py: the whole layer (route to combine, bf16, one GPU) on
             every expert path (the fused one included) and the peers that import (JAX's
             ragged_dot_mgpu, Levanter grug), forward and forward+backward, against a dense
             matmul of the same FLOPs, with the routing / glue / matmul stages, at
             DeepSeek-V3's and Mixtral-8x7B's expert shards, 4096 and 16384 tokens
  test_base  tests/kernels/test_backends.py, un-interpreted on the GPU (pytest; in parallel
             processes when pytest-xdist is installed, since compiling dominates)
  layer      `moe_apply` with expert_backend "xla", "pallas" and "auto" (f32 and bf16, silu
             and gelu, NaN-poisoned padding) against `reference_moe`, forward and gradients
             (the CPU smoke run: every backend once, the kernels in bf16 on the 1x1 mesh;
             the suite's layer tests cover the other cases)
  bench      benchmarks/gpu_kernels.py: gmm, moe_mlp, tgmm, forward and forward+backward, vs
             jax.lax.ragged_dot, jax's ragged_dot_mgpu and a dense matmul of the same FLOPs
  xla_paths  the layer's two XLA expert paths (sort + ragged_dot, the tile loop) by number of
             local experts: the measurement behind `moejax.plan.plan_experts`
  decode     every expert path (ragged_dot, tile loop, the device's kernel) at T = 1, 8, 64,
             256 rows, El = 32, against the bytes floor: what `moejax.plan`'s XLA rule for
             small calls follows
  quant      gmm and moe_mlp on each quantized format a kernel takes against bf16, at 128,
             512 and 4096 tokens on DeepSeek-V3's expert shard (`gpu_kernels.run_quant`)
  chunks     the layer's forward on DeepSeek-V3's expert shard (one device, bf16) with
             chunk_size="auto" (the default, by the GPU's memory) against 256, at 2048 and
             16384 tokens: the GPU default, measured
  fp8_train  `python -m moejax train`'s small model (one device, D = F = 128, 200 steps) without
             and with compute_quant="fp8_deepseek" on each expert path that runs it (the tile
             loop's emulation, the Hopper fp8 kernels, the fused path), the same seed and
             data: each run's mean loss over its last 20 steps, and fp8's relative difference
             from the unquantized run's
  tune       (its own run: `--parts tune`) `moejax.tune` on a layer of DeepSeek-V3's shape
             class: every expert path checked and timed, DIR/tuning/tuning-<device>.json
             written (the shipped table's format; about 12 s a candidate on an H200, 5 min)

A run's default is `DEFAULT_PARTS` (whole_layer, test_base, layer, bench: 480 s); xla_paths,
decode, quant and chunks, measured in the runs docs/performance.md records, and fp8_train
run when named.

Each part's JSON header records what moejax plans with on the device
(`kernels_pallas.platform.Target`) beside what the device reports and the known GPUs' table
(`kernels_pallas.gpus`, the facts `moejax.targets`' compile-only GPUs answer with), so a run
shows where they differ. CI compiles every GPU path without a GPU (tests/test_gpu_compile.py);
this run is what checks their numbers and speed: the Pallas gradient under `shard_map`, fixed
from a compile-only H200 alone (`layer`), has not run on a GPU yet.

The run ends with `DIR/gpu_check.json` (status per part) and `DIR/gpu_check.md` (tables), and
exits non-zero if any part failed, crashed or timed out, saying which.

  PYTHONPATH=. python benchmarks/gpu_check.py --out DIR                # on a GPU, < 8 minutes
  PYTHONPATH=. python benchmarks/gpu_check.py --out DIR2 --parts tune  # then, < 6 minutes
  PYTHONPATH=. python benchmarks/gpu_check.py --out DIR --smoke        # every part, on a CPU
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # moejax, kernels_pallas and tests, from this checkout
from moejax import files  # noqa: E402  (imports JAX, but starts no backend)

# Part -> time limit on a GPU, in seconds. The default parts take 480 in all and `tune` 360: a
# GPU session runs the default, then `--parts tune`, inside one lease of 15 minutes with the
# machine's start. Parts that time out keep the rows they finished.
LIMITS = {
  "whole_layer": 200,
  "test_base": 100,
  "layer": 110,
  "bench": 70,
  "xla_paths": 40,
  "decode": 35,
  "quant": 60,
  "chunks": 35,
  "fp8_train": 240,
  "tune": 360,
}


class Recorder:
  """Collects a part's result rows and rewrites `path` after each, so that a part that times
  out or crashes still reports what it finished."""

  def __init__(self, path: Path, device: str, jax_version: str):
    self.path, self.rows = path, []
    self.header = dict(device=device, jax=jax_version, date=time.strftime("%Y-%m-%d"))

  def __call__(self, row: dict) -> None:
    self.rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
    rows = json.dumps(dict(self.header, rows=self.rows), indent=1)
    files.write_atomically(self.path, rows, overwrite=True)

  def case(self, name: str, check: Callable[[], dict]) -> None:
    """Runs one check, recording its result or its error; never raises."""
    start = time.perf_counter()
    try:
      row = dict(case=name, status="ok", **check())
    except Exception as error:  # a failing case is a result, recorded with its reason
      row = dict(
        case=name,
        status="FAILED",
        error=f"{type(error).__name__}: {str(error)[:500]}",
        trace=traceback.format_exc()[-1500:],
      )
    row["seconds"] = round(time.perf_counter() - start, 2)
    self(row)


def part_test_base(out: Path, smoke: bool, record: Recorder) -> None:
  """The backend test base under pytest; one row per test from its JUnit XML."""
  report = out / "test_base.xml"
  command = [
    sys.executable,
    "-m",
    "pytest",
    "tests/kernels/test_backends.py",
    "--all",  # the slow tier's sweeps too
    "-q",
    "-p",
    "no:cacheprovider",
    f"--junitxml={report}",
    "-p",
    "no:benchmark",  # pytest-benchmark, where installed, fails under xdist with warnings as errors
  ]
  if smoke:  # the plumbing only: CI runs the whole base on the CPU already
    command += ["-k", "TestXla and test_rows_past_the_groups_sum_give_zero"]
  elif importlib.util.find_spec("xdist"):
    command += ["-n", "8"]
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if not smoke:
    env["JAX_PLATFORMS"] = "cuda"  # tests/conftest.py defaults to the simulated CPU devices
  subprocess.run(command, cwd=ROOT, env=env, check=False)
  for test in ElementTree.parse(report).getroot().iter("testcase"):
    failure = test.find("failure") if test.find("failure") is not None else test.find("error")
    row = dict(
      case=f"{test.get('classname', '').split('.')[-1]}::{test.get('name')}",
      seconds=float(test.get("time", 0)),
    )
    if failure is not None:
      row.update(status="FAILED", error=(failure.get("message") or "")[:500])
    else:
      row["status"] = "skipped" if test.find("skipped") is not None else "ok"
    record(row)


def part_layer(out: Path, smoke: bool, record: Recorder) -> None:
  """The layer on one device with every expert backend, against `reference_moe`; the Pallas
  path also on a 1x1 mesh, under `shard_map` (its gradient's types are checked there: the
  case a CPU never compiles for real)."""

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import moejax
  from moejax.testing import RELATIVE_BOUNDS, poison, random_params, relative_error

  warnings.simplefilter("ignore")  # the CPU smoke run interprets the kernels, and says so
  tokens, dim = (64, 64) if smoke else (2048, 512)
  cases = itertools.product(
    ("xla", "pallas", "auto"), (jnp.float32, jnp.bfloat16), ("silu", "gelu")
  )
  if smoke:  # every backend once (the kernels on the 1x1 mesh, below); the suite's layer
    # tests run the other cases
    cases = [("xla", jnp.float32, "silu"), ("auto", jnp.float32, "gelu")]
  one_device = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
  # The case no GPU has run yet (the kernels' gradient under shard_map) first, then the
  # kernels, auto and XLA: the first XLA float32 case took 94 s on an H200 (2026-12-04).
  order = {"pallas": 0, "auto": 1, "xla": 2}
  by_backend = sorted(((*case, None) for case in cases), key=lambda case: order[case[0]])
  cases = [("pallas", jnp.bfloat16, "silu", one_device), *by_backend]
  for backend, dtype, activation, mesh in cases:
    config = moejax.MoEConfig(
      num_experts=8,
      top_k=2,
      hidden_size=dim,
      intermediate_size=2 * dim,
      chunk_size=256,
      dtype=dtype,
      activation=activation,
      expert_backend=backend,
      num_shared_experts=1,
      shared_intermediate_size=dim,
    )
    bound = RELATIVE_BOUNDS[jnp.dtype(dtype)]  # TF32 products (a GPU's float32 default), bf16

    def check(config=config, bound=bound, mesh=mesh):
      params = random_params(config, jax.random.key(1))
      x = jax.random.normal(jax.random.key(2), (tokens, dim))
      mask = jnp.arange(tokens) % 7 != 3
      layer = lambda p: moejax.moe_apply(
        p, poison(x, mask), config=config, mesh=mesh, token_mask=mask
      )
      reference = lambda p: moejax.reference_moe(p, x, config, token_mask=mask)
      error = relative_error(layer(params)[0], reference(params))
      loss = lambda f: lambda p: jnp.sum(jnp.sin(f(p)))
      got, want = (
        jax.grad(loss(lambda p: layer(p)[0]))(params),
        jax.grad(loss(reference))(params),
      )
      grad_error = max(
        relative_error(a, b) for a, b in zip(got, want, strict=True) if a is not None
      )
      if error > bound or grad_error > 2 * bound:
        raise AssertionError(f"relative error {error:.3g}, gradients {grad_error:.3g}")
      call = moejax.plan_call(config, x, mesh=mesh)  # the path the layer took, and why
      return dict(
        out_rel=error, grad_rel=grad_error, path=call.expert.path, backend=call.expert.backend
      )

    name = f"layer {backend} {jnp.dtype(dtype).name} {activation}" + (" 1x1 mesh" if mesh else "")
    record.case(name, check)


def part_whole_layer(out: Path, smoke: bool, record: Recorder) -> None:
  """benchmarks/whole_layer.py's rows: every path and peer on the whole layer."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import whole_layer

  whole_layer.run(smoke, _with_status(record))


def part_bench(out: Path, smoke: bool, record: Recorder) -> None:
  """benchmarks/gpu_kernels.py's cases, one row per timed call."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import gpu_kernels

  gpu_kernels.run(smoke, _with_status(record), quant=False)


def part_quant(out: Path, smoke: bool, record: Recorder) -> None:
  """benchmarks/gpu_kernels.py's quantized-weight cases, one row per timed call."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import gpu_kernels

  gpu_kernels.run_quant(smoke, _with_status(record))


def _with_status(record: Recorder) -> Callable[[dict], None]:
  """Records a benchmark row with status "FAILED" where it holds an error, else "ok"."""
  return lambda row: record(dict(row, status="FAILED" if "error" in row else "ok"))


def part_xla_paths(out: Path, smoke: bool, record: Recorder) -> None:
  """Sort + ragged_dot vs the tile loop, forward and forward+backward, by local experts."""
  for experts in (4,) if smoke else (8, 16, 32, 128):
    _time_xla_paths(experts, smoke, record)


def _expert_paths(with_kernel: bool) -> dict[str, Callable]:
  """The layer's expert paths as (x, ids, weights, w_gate_up, w_down) -> [T, D] functions."""
  from kernels_pallas.backends import Case, select_kernel
  from kernels_pallas.platform import on_cpu
  from moejax.activations import GatedActivation
  from moejax.experts import default_tile_rows, grouped_matmul_mlp, tile_loop_mlp
  from moejax.params import ExpertWeights

  def tile_loop(x, ids, weights, w_gate_up, w_down):
    rows = default_tile_rows(ids.size, w_gate_up.shape[0])
    experts = ExpertWeights(w_gate_up, w_down)
    return tile_loop_mlp(
      x, ids, weights, experts, activation=GatedActivation("silu"), tile_rows=rows
    )

  def on_backend(backend: str) -> Callable:
    def sorted_path(x, ids, weights, w_gate_up, w_down):
      experts = ExpertWeights(w_gate_up, w_down)
      return grouped_matmul_mlp(
        x,
        ids,
        weights,
        experts,
        activation=GatedActivation("silu"),
        backend=backend,
        interpret=on_cpu(),
      )

    return sorted_path

  paths = {"ragged_dot": on_backend("xla"), "tile_loop": tile_loop}
  kernel = select_kernel(Case("bfloat16", "silu"))
  if with_kernel and kernel is not None:
    paths[kernel] = on_backend(kernel)
  return paths


def _expert_operands(experts: int, tokens: int, d: int, f: int, top_k: int = 2):
  """bf16 x [T, D], weights [El, D, 2F] and [El, F, D], random ids [T, K], weights 0.5."""
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(jax.random.key(experts * 7919 + tokens), 4)
  x = jax.random.normal(keys[0], (tokens, d), jnp.bfloat16)
  w_gate_up = (jax.random.normal(keys[1], (experts, d, 2 * f)) / 64).astype(jnp.bfloat16)
  w_down = (jax.random.normal(keys[2], (experts, f, d)) / 64).astype(jnp.bfloat16)
  ids = jax.random.randint(keys[3], (tokens, top_k), 0, experts)
  return x, w_gate_up, w_down, ids, jnp.full((tokens, top_k), 0.5, jnp.float32)


def part_decode(out: Path, smoke: bool, record: Recorder) -> None:
  """Every expert path at decode sizes (T = 1, 8, 64, 256 rows on one device, El = 32):
  time against the bytes floor, the used experts' weights read once. The measurement
  `moejax.plan`'s XLA rule for small calls (`RAGGED_DOT_MAX_ROWS`) follows."""
  experts, d, f = (8, 64, 32) if smoke else (32, 2048, 1024)
  for tokens in (1, 8) if smoke else (1, 8, 64, 256):
    operands = _expert_operands(experts, tokens, d, f)
    for path, mlp in _expert_paths(with_kernel=True).items():
      timed = functools.partial(_time_decode, mlp, operands, path, repeats=1 if smoke else 20)
      record.case(f"decode {path} T={tokens}", timed)


def _time_decode(mlp: Callable, operands: tuple, path: str, repeats: int) -> dict:
  import jax
  import numpy as np

  sys.path.insert(0, str(ROOT / "benchmarks"))
  from gpu_kernels import median_seconds

  x, w_gate_up, w_down, ids, weights = operands
  used = len(np.unique(np.asarray(ids)))
  floor_bytes = used * 3 * w_down.shape[1] * w_down.shape[2] * w_down.dtype.itemsize
  fn = jax.jit(lambda x, wgu, wd: mlp(x, ids, weights, wgu, wd))
  seconds = median_seconds(fn, x, w_gate_up, w_down, repeats=repeats)
  return dict(
    tokens=x.shape[0], path=path, used_experts=used, ms=seconds * 1e3,
    floor_gb_per_s=floor_bytes / seconds / 1e9,
  )  # fmt: skip


def _time_xla_paths(experts: int, smoke: bool, record: Recorder) -> None:
  import jax
  import jax.numpy as jnp

  sys.path.insert(0, str(ROOT / "benchmarks"))
  from gpu_kernels import forward_backward, median_seconds

  tokens, d, f, top_k = (64, 64, 32, 2) if smoke else (8192, 2048, 1024, 2)
  x, w_gate_up, w_down, ids, weights = _expert_operands(experts, tokens, d, f, top_k)
  keys = jax.random.split(jax.random.key(experts), 4)
  flops = 2 * tokens * top_k * d * 3 * f
  paths = _expert_paths(with_kernel=False)
  cotangent = jax.random.normal(keys[3], (tokens, d), jnp.float32)
  for path, mlp in paths.items():
    forward = lambda x, wgu, wd, mlp=mlp: mlp(x, ids, weights, wgu, wd)
    for mode, fn, operands, multiple in (
      ("fwd", forward, (x, w_gate_up, w_down), 1),
      ("fwd_bwd", forward_backward(forward), (x, w_gate_up, w_down, cotangent), 3),
    ):

      def measure(fn=fn, operands=operands, multiple=multiple, path=path, mode=mode):
        seconds = median_seconds(jax.jit(fn), *operands, repeats=1 if smoke else 5)
        tflops = multiple * flops / seconds / 1e12
        return dict(local_experts=experts, path=path, mode=mode, ms=seconds * 1e3, tflops=tflops)

      record.case(f"{path} {mode} El={experts}", measure)


def part_chunks(out: Path, smoke: bool, record: Recorder) -> None:
  """`moe_apply`'s forward, chunk_size="auto" against 256, on DeepSeek-V3's expert shard."""
  import jax
  import jax.numpy as jnp

  from moejax import MoEConfig, MoEParams, moe_apply, param_shapes, plan_call

  sys.path.insert(0, str(ROOT / "benchmarks"))
  from gpu_kernels import median_seconds

  sizes = (8, 2, 64, 32) if smoke else (32, 8, 7168, 2048)
  names = ("num_experts", "top_k", "hidden_size", "intermediate_size")
  shape = dict(zip(names, sizes, strict=True))
  for tokens, chunk in itertools.product((64,) if smoke else (2048, 16384), ("auto", 256)):
    config = MoEConfig(**shape, chunk_size=chunk, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)

    def measure(config=config, tokens=tokens):
      shapes = param_shapes(config).items()
      keys = jax.random.split(jax.random.key(0), len(shapes) + 1)
      params = MoEParams(
        **{
          n: jax.random.normal(k, s, jnp.bfloat16) * s[-2] ** -0.5
          for k, (n, s) in zip(keys[:-1], shapes, strict=True)
        }
      )
      x = jax.random.normal(keys[-1], (tokens, config.hidden_size), jnp.bfloat16)
      fn = jax.jit(lambda p, x: moe_apply(p, x, config=config)[0])
      seconds = median_seconds(fn, params, x, repeats=1 if smoke else 10)
      call = plan_call(config, x)
      return dict(
        tokens=tokens,
        chunk_size=str(config.chunk_size),
        C=call.layout.chunk,
        path=call.expert.path,
        ms=seconds * 1e3,
      )

    record.case(f"chunk_size={chunk} T={tokens}", measure)


# `python -m moejax train`'s flags shared by fp8_train's runs: the small model at fp8_deepseek's
# group width, on the first device.
FP8_TRAIN_FLAGS = ("--hidden", "128", "--intermediate", "128", "--batch-size", "8", "--mesh", "1x1")
FP8_TRAIN_TAIL = 20  # steps whose losses each run's mean takes


def part_fp8_train(out: Path, smoke: bool, record: Recorder) -> None:
  """Training with compute_quant="fp8_deepseek" against the same run unquantized: one row per
  run, with its mean loss and task loss over its last `FP8_TRAIN_TAIL` steps and, for the fp8
  runs, their relative difference from the unquantized run's; the warnings a run gave (a
  backend it could not run says so there). The smoke run trains 3 steps on the tile loop only."""
  import tempfile

  from moejax.apps import train
  from moejax.apps.cli import parser

  steps = 3 if smoke else 200
  fp8 = ("--compute-quant", "fp8_deepseek")
  runs = {"unquantized": ("--backend", "auto"), "fp8_deepseek xla": ("--backend", "xla", *fp8)}
  if not smoke:
    runs |= {f"fp8_deepseek {b}": ("--backend", b, *fp8) for b in ("pallas", "fused")}
  baseline = {}

  for name, flags in runs.items():

    def measure(name=name, flags=flags):
      with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        checkpoint = f"{folder}/checkpoint"
        args = parser().parse_args(
          ["train", *FP8_TRAIN_FLAGS, "--steps", str(steps), "--checkpoint", checkpoint, *flags]
        )
        tail = train.run(args, mesh_shape=(1, 1))[-FP8_TRAIN_TAIL:]
      row = {key: sum(r[key] for r in tail) / len(tail) for key in ("loss", "task_loss")}
      if name == "unquantized":
        baseline.update(row)
      elif baseline:  # (none where the unquantized run failed)
        row |= {f"{key}_vs_unquantized": row[key] / baseline[key] - 1 for key in baseline}
      notices = sorted({str(w.message)[:200] for w in said})
      return dict(steps=steps, **row, **({"warnings": notices} if notices else {}))

    record.case(name, measure)


def part_tune(out: Path, smoke: bool, record: Recorder) -> None:
  """`moejax.tune` on a layer of DeepSeek-V3's shape class (one device, bf16): every path
  checked and timed, the tuning file written to DIR/tuning/ (the format of the shipped table,
  `moejax/tuned/`, and of a user's `python -m moejax tune`)."""
  import dataclasses

  import jax.numpy as jnp

  import moejax

  os.environ["MOEJAX_CACHE_DIR"] = str(out / "tuning")
  # tokens per device last (the smoke run's 1 makes one call size: the decode-size one)
  sizes = (8, 2, 64, 128, 1) if smoke else (32, 8, 2048, 1024, 4096)
  names = ("num_experts", "top_k", "hidden_size", "intermediate_size")
  config = moejax.MoEConfig(
    **dict(zip(names, sizes[:4], strict=True)), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
  )

  def measure():
    table = moejax.tune(
      config, tokens_per_device=sizes[4], repeats=1 if smoke else 5, overwrite=True
    )
    return dict(
      file=str(moejax.tuning.user_file(table.device_kind)),
      entries=[
        dict(
          rows=entry.rows,
          winner=entry.winner,
          candidates=[dataclasses.asdict(c) for c in entry.candidates],
        )
        for entry in table.entries
      ],
    )

  record.case(f"tune E={sizes[0]} K={sizes[1]} D={sizes[2]} F={sizes[3]}", measure)


PARTS = {
  "whole_layer": part_whole_layer,
  "test_base": part_test_base,
  "layer": part_layer,
  "bench": part_bench,
  "xla_paths": part_xla_paths,
  "decode": part_decode,
  "quant": part_quant,
  "chunks": part_chunks,
  "fp8_train": part_fp8_train,
  "tune": part_tune,
}
DEFAULT_PARTS = ("whole_layer", "test_base", "layer", "bench")


def _markdown(part: str, status: str, rows: list[dict]) -> str:
  failed = sum(r.get("status") == "FAILED" for r in rows)
  lines = [f"### {part}: {status} ({len(rows) - failed}/{len(rows)} rows ok)", ""]
  keys = list(dict.fromkeys(k for r in rows for k in r if k != "trace"))
  if keys:
    lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
  for r in rows:
    cells = [r.get(k, "") for k in keys]
    cells = [f"{c:.4g}" if isinstance(c, float) else str(c).replace("|", "/") for c in cells]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def run_parts(parts: list[str], out: Path, smoke: bool) -> dict[str, dict]:
  """Runs each part in a child process; returns its status and time per part. The parent
  never starts a JAX backend: on a GPU it would hold the memory the parts need."""
  header: dict = {}
  summary, report = {}, []
  for part in parts:
    limit = LIMITS[part] * (4 if smoke else 1)
    command = [sys.executable, __file__, "--out", str(out), "--part", part]
    command += ["--smoke"] if smoke else []
    start = time.perf_counter()
    print(f"== {part} (limit {limit} s)", flush=True)
    try:
      done = subprocess.run(command, timeout=limit, cwd=ROOT, check=False)
      status = "passed" if done.returncode == 0 else f"crashed (exit {done.returncode})"
    except subprocess.TimeoutExpired:
      status = f"timed out after {limit} s"
    result = (
      json.loads((out / f"{part}.json").read_text()) if (out / f"{part}.json").exists() else {}
    )
    rows = result.get("rows", [])
    header = {k: result[k] for k in ("device", "jax", "date") if k in result} or header
    if status == "passed" and any(r.get("status") == "FAILED" for r in rows):
      status = "failed"
    summary[part] = dict(status=status, seconds=round(time.perf_counter() - start, 1))
    report.append(_markdown(part, status, rows))
  results = json.dumps(dict(header, parts=summary), indent=1)
  files.write_atomically(out / "gpu_check.json", results, overwrite=True)
  title = f"# GPU check: {header.get('device')}, JAX {header.get('jax')}, {header.get('date')}"
  files.write_atomically(out / "gpu_check.md", "\n".join([title, "", *report]), overwrite=True)
  return summary


def device_facts(device) -> dict:
  """What moejax plans with on this device (`kernels_pallas.platform.Target`: the same facts
  `moejax.targets`' compile-only GPUs answer with), beside what the device itself reports
  and the known GPUs' table (`kernels_pallas.gpus`), so that a run shows where they differ."""
  from kernels_pallas import gpus, platform

  target = platform.Target.of(device)
  known = gpus.BY_DEVICE_KIND.get(device.device_kind)
  stats = device.memory_stats() or {}
  return dict(
    target=dict(
      compute_capability=target.compute_capability,
      sm_count=target.sm_count,
      memory_bytes=target.memory_bytes,
    ),
    reported=dict(
      core_count=getattr(device, "core_count", None),
      bytes_limit=stats.get("bytes_limit"),
    ),
    known_gpu=None
    if known is None
    else dict(name=known.name, sm_count=known.sm_count, memory_bytes=known.memory_bytes),
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="folder for the JSON and markdown results")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreters (CPU)")
  parser.add_argument(
    "--parts",
    default=",".join(DEFAULT_PARTS),
    help=f"comma-separated parts to run, of {list(PARTS)} (default: {','.join(DEFAULT_PARTS)})",
  )
  parser.add_argument("--part", help=argparse.SUPPRESS)  # one part, in this process
  parser.add_argument("--overwrite", action="store_true", help="replace earlier results in --out")
  args = parser.parse_args()
  out = Path(args.out).resolve()
  if not (args.part or args.overwrite):  # the parts write into the folder the run checked
    files.refuse_existing([out / "gpu_check.json", out / "gpu_check.md"], how="pass --overwrite")
  out.mkdir(parents=True, exist_ok=True)
  if args.part:
    import jax

    device = jax.devices()[0]
    print(f"{device.device_kind}, JAX {jax.__version__}", flush=True)
    record = Recorder(out / f"{args.part}.json", device.device_kind, jax.__version__)
    record.header |= device_facts(device)
    PARTS[args.part](out, args.smoke, record)
    return
  unknown = set(args.parts.split(",")) - set(PARTS)
  if unknown:
    parser.error(f"--parts: unknown {sorted(unknown)}; choose from {list(PARTS)}")
  summary = run_parts(args.parts.split(","), out, args.smoke)
  print(json.dumps(summary, indent=1))
  failed = [part for part, s in summary.items() if s["status"] != "passed"]
  if failed:
    raise SystemExit(f"parts that did not pass: {failed} (see {out / 'gpu_check.md'})")


if __name__ == "__main__":
  main()
