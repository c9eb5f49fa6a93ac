"""The benchmark scripts stay runnable: each runs on tiny shapes and prints its table."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def run_script(*args: str, out: Path) -> str:
  """Runs a benchmark with `--out out`; checks it succeeded and wrote there."""
  result = subprocess.run(
    [sys.executable, *args, "--out", str(out)],
    capture_output=True,
    text=True,
    timeout=600,
    cwd=ROOT,
    env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert out.exists()
  return result.stdout


def test_gpu_kernel_benchmark_smoke_times_every_backend_and_op(tmp_path):
  run_script("benchmarks/gpu_kernels.py", "--smoke", out=tmp_path / "out.json")
  rows = json.loads((tmp_path / "out.json").read_text())["rows"]
  timed = {(r["op"], r["backend"]) for r in rows if "error" not in r}
  for backend in ("xla", "triton", "mosaic"):
    for op in ("gmm", "gmm_fwd_bwd", "moe_mlp", "moe_mlp_fwd_bwd", "tgmm"):
      assert (op, backend) in timed
  assert ("gmm", "dense (ceiling)") in timed


def test_gpu_check_smoke_runs_every_part(tmp_path):
  run_script("benchmarks/gpu_check.py", "--smoke", out=tmp_path)
  summary = json.loads((tmp_path / "gpu_check.json").read_text())
  assert summary["device"] and summary["jax"] and summary["date"]
  assert {part: s["status"] for part, s in summary["parts"].items()} == {
    "test_base": "passed",
    "layer": "passed",
    "bench": "passed",
    "xla_paths": "passed",
  }
  layer = json.loads((tmp_path / "layer.json").read_text())["rows"]
  assert len(layer) == 12 and all(r["status"] == "ok" for r in layer)
  assert "| case |" in (tmp_path / "gpu_check.md").read_text()


def test_layer_benchmark_prints_ratios(tmp_path):
  out = run_script(
    "benchmarks/layer_vs_dense.py",
    "--tokens",
    "256",
    "--experts",
    "8",
    "--hidden",
    "32",
    "--intermediate",
    "64",
    "--chunk-sizes",
    "64,256",
    "--repeats",
    "1",
    out=tmp_path / "out.json",
  )
  assert "moejax layer, chunk_size=64" in out and "x ceiling" in out


def test_bench_suite_compile_count_and_collective_bytes(tmp_path):
  run_script(
    "-m",
    "moejax",
    "bench",
    "--sections",
    "compiles,collectives",
    out=tmp_path,
  )
  bench = json.loads((tmp_path / "bench.json").read_text())
  rows = {r.get("op", "compiles"): r for r in bench}
  assert rows["compiles"]["executables"] == 1
  assert (
    rows["total buffers per chunk (HLO)"]["bytes"] == rows["minimum buffers per chunk"]["bytes"]
  )
