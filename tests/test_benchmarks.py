"""The benchmark scripts stay runnable: each runs on tiny shapes and prints its table."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_pallas import compat
from kernels_pallas.formats import FORMATS
from tests.helpers import user_env

ROOT = Path(__file__).parent.parent

pytestmark = pytest.mark.slow  # each runs a benchmark script in a subprocess


def run_python(
  *args: str, quick_compile: bool = False, timeout: int = 600
) -> subprocess.CompletedProcess:
  """`python *args` from the repository root, as a user runs it (`user_env`), for at most
  `timeout` seconds."""
  return subprocess.run(
    [sys.executable, *args],
    capture_output=True,
    text=True,
    timeout=timeout,
    cwd=ROOT,
    env=user_env(quick_compile=quick_compile),
  )


def run_script(*args: str, out: Path, **options) -> str:
  """Runs a benchmark with `--out out` (`run_python`'s `options`); checks it succeeded and
  wrote there."""
  result = run_python(*args, "--out", str(out), **options)
  assert result.returncode == 0, result.stderr[-3000:]
  assert out.exists()
  return result.stdout


# benchmarks/gpu_kernels.py's ops and backends, each timed by the smoke run
OPS = ("gmm", "gmm_fwd_bwd", "moe_mlp", "moe_mlp_fwd_bwd", "tgmm")
BACKENDS = ("xla", "triton", "mosaic")


@pytest.mark.skipif(
  compat.jax_version() < (0, 11),
  reason="benchmarks/gpu_check.py serves the GPU machine's JAX 0.11: its smoke run (the suite's "
  "longest test) runs on JAX 0.11 and later",
)
def test_gpu_check_smoke_runs_every_part(tmp_path):
  """benchmarks/gpu_check.py on tiny shapes: every part runs, the layer's cases pass, its
  bench and quant parts (benchmarks/gpu_kernels.py's cases) time every backend and op, and
  its fp8 training run tracks the unquantized one. Its time is mostly compiling: it takes the
  suite's compile-time flags (a fifth less CPU time: 349 s against 441 alone). Beside CI's
  other suites on 2 cores it has taken 409 s, and over 600 s with more tests beside them:
  it has 30 minutes."""
  parts = (
    "whole_layer", "test_base", "layer", "bench", "xla_paths", "decode", "quant", "chunks",
    "fp8_train", "tune",
  )  # fmt: skip
  smoke = ("--smoke", "--parts", ",".join(parts))
  run_script("benchmarks/gpu_check.py", *smoke, out=tmp_path, quick_compile=True, timeout=1800)
  summary = json.loads((tmp_path / "gpu_check.json").read_text())
  assert summary["device"] and summary["jax"] and summary["date"]
  statuses = {part: s["status"] for part, s in summary["parts"].items()}
  assert statuses == dict.fromkeys(parts, "passed")
  layer = json.loads((tmp_path / "layer.json").read_text())["rows"]
  assert {r["case"].split()[1] for r in layer} == {"xla", "pallas", "auto"}
  assert all(r["status"] == "ok" for r in layer)
  whole = json.loads((tmp_path / "whole_layer.json").read_text())["rows"]
  timed = {r["path"]: r for r in whole if "layer_ms" in r}
  assert set(timed) >= {"tile_loop", "ragged_dot", "pallas:triton", "fused"}, whole
  clients = {"tunix qwen3 dense", "maxtext routedmoe ragged_dot"}  # timed whole, no stages
  for r in timed.values():  # the stages add up to the layer
    assert r["status"] == "ok" and r["dense_fraction"] > 0 and r["train_dense_fraction"] > 0
    if r["path"] not in clients:
      assert r["routing_ms"] + r["experts_ms"] == pytest.approx(r["layer_ms"])
  fp8 = {r["path"]: r for r in whole if r["path"].startswith("fp8_deepseek")}
  assert set(fp8) == {"fp8_deepseek xla", "fp8_deepseek pallas", "fp8_deepseek fused"}, fp8
  assert all(
    r["status"] == "ok" and r["speedup"] > 0 and r["train_speedup"] > 0 for r in fp8.values()
  )
  peers = {r["path"] for r in whole} - set(timed) - set(fp8)
  peers |= {r["path"] for r in whole if "skipped" in r}
  assert {"jax ragged_dot_mgpu", "levanter grug scatter"} | clients <= peers | set(timed)
  decode = json.loads((tmp_path / "decode.json").read_text())["rows"]
  assert {r["path"] for r in decode} >= {"ragged_dot", "tile_loop"}
  assert all(r["status"] == "ok" and r["floor_gb_per_s"] > 0 for r in decode)
  bench = json.loads((tmp_path / "bench.json").read_text())["rows"]
  timed = {(r["op"], r["backend"]) for r in bench if r["status"] == "ok"}
  assert set(itertools.product(OPS, BACKENDS)) | {("gmm", "dense (ceiling)")} <= timed
  quant = json.loads((tmp_path / "quant.json").read_text())["rows"]
  assert {(r["op"], r["backend"], r["weights"]) for r in quant if r["status"] == "ok"} >= set(
    itertools.product(("gmm", "moe_mlp"), ("triton", "mosaic"), ("bf16", "fp8_block", "mxfp4"))
  ) | {("moe_mlp", "fused", weights) for weights in ("bf16", *FORMATS)}
  runs = {r["case"]: r for r in json.loads((tmp_path / "fp8_train.json").read_text())["rows"]}
  assert set(runs) == {"unquantized", "fp8_deepseek xla"}, runs
  assert all(r["status"] == "ok" and r["steps"] == 3 for r in runs.values())
  assert abs(runs["fp8_deepseek xla"]["loss_vs_unquantized"]) < 1e-2  # trained alike, not equal
  assert runs["fp8_deepseek xla"]["loss"] != runs["unquantized"]["loss"]
  (tune,) = json.loads((tmp_path / "tune.json").read_text())["rows"]
  assert tune["status"] == "ok" and Path(tune["file"]).parent == tmp_path / "tuning"
  for entry in tune["entries"]:
    assert {c["status"] for c in entry["candidates"]} == {"passed"} and entry["winner"]
  assert "| case |" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_kernel_benchmark_writes_its_rows_and_fails_on_a_failed_case(
  tmp_path, monkeypatch, capsys
):
  """benchmarks/gpu_kernels.py's command line around `run` (whose cases the gpu_check smoke
  test runs): both tables printed, the rows in --out, exit status 1 on a failed case."""
  import benchmarks.gpu_kernels as gpu_kernels

  timed = dict(shape="smoke", tokens=64, skewed=False, op="gmm", backend="xla", ms=0.5)
  quant = dict(section="quant", shape="smoke", tokens=64, op="gmm", backend="triton")
  rows = [
    dict(timed, tflops=1.5, of_ceiling=0.25),
    dict(timed, backend="mosaic", error="NotImplementedError: no"),
    dict(quant, weights="mxfp4", ms=0.75, of_bf16_time=1.25),
  ]
  monkeypatch.setattr(gpu_kernels, "run", lambda smoke, record, tune_first: [*map(record, rows)])
  monkeypatch.setattr(sys, "argv", ["gpu_kernels.py", "--smoke", "--out", str(tmp_path / "o.json")])
  with pytest.raises(SystemExit, match="some cases failed"):
    gpu_kernels.main()
  assert json.loads((tmp_path / "o.json").read_text())["rows"] == rows
  printed = capsys.readouterr().out
  assert "| smoke | 64 | no | gmm | xla | 0.500 | 1.5 | 0.25 |" in printed
  assert "| smoke | 64 | no | gmm | mosaic | failed: NotImplementedError: no |" in printed
  assert "| smoke | 64 | gmm | triton | mxfp4 | 0.750 | 1.25 |" in printed


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


def test_bench_help_lists_the_suites_flags():
  result = run_python("-m", "moejax", "bench", "--help")
  assert result.returncode == 0, result.stderr[-3000:]
  assert all(flag in result.stdout for flag in ("--sections", "--full", "--repeats")), result.stdout


@pytest.mark.parametrize(
  "command, typo", [(("-m", "moejax", "bench"), "step"), (("benchmarks/dispatch.py",), "timings")]
)
def test_an_unknown_section_is_a_usage_error(command, typo):
  result = run_python(*command, "--sections", typo)
  assert result.returncode == 2, result.stderr[-3000:]
  assert f"--sections: unknown {typo}" in result.stderr, result.stderr


def test_bench_suite_compiles_once_and_keeps_earlier_results(tmp_path):
  """A second run into the same --out refuses before running (naming --overwrite), and
  leaves the first run's results as they were."""
  run_script("-m", "moejax", "bench", "--sections", "compiles", out=tmp_path)
  written = (tmp_path / "bench.json").read_text()
  bench = json.loads(written)
  assert [r["executables"] for r in bench if r["section"] == "compiles"] == [1]
  again = run_python("-m", "moejax", "bench", "--sections", "compiles", "--out", str(tmp_path))
  assert again.returncode != 0 and "bench.json exists: pass --overwrite" in again.stderr
  assert (tmp_path / "bench.json").read_text() == written


def test_bench_suite_quant_section_reports_formats(monkeypatch):
  """`bench --sections quant`'s rows at 512 tokens (the section adds 4096, whose rows are the
  same but for the time): every format's weight bytes against float32's."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import suite

  monkeypatch.setattr(suite, "QUANT_TOKENS", (512,))
  rows = suite.quant_section(repeats=1)
  weights = {r["experts"]: r["weight_mb"] for r in rows if r["T"] == 512}
  assert set(weights) == {"float32", "fp8_block", "mxfp4", "int4_group", "nvfp4"}
  # int4_group: half a byte a value and a bfloat16 per 32 (4.5 bits of float32's 32); nvfp4:
  # half a byte and an e4m3 per 16 (4.5 bits), and a float32 per column of each matrix
  assert 0.140 <= weights["int4_group"] / weights["float32"] < 0.141
  assert 0.140 <= weights["nvfp4"] / weights["float32"] < 0.15
  # fp8: a byte per value plus one f32 scale per block; mxfp4: half a byte plus 1/32 byte
  assert 0.25 <= weights["fp8_block"] / weights["float32"] < 0.26
  assert 0.125 <= weights["mxfp4"] / weights["float32"] < 0.14
  assert all(r["time_of_float32"] > 0 and r["temp_mb"] > 0 for r in rows)


def test_dispatch_benchmark_bytes_meet_the_targets_at_the_floor(tmp_path):
  """Bytes, not time: the scaling numbers are deterministic for a given routing."""
  out = run_script(
    "benchmarks/dispatch.py", "--sections", "hlo,fp8,scaling", "--tokens", "512", out=tmp_path
  )
  rows = json.loads((tmp_path / "dispatch.json").read_text())
  scaling = [r for r in rows if r["section"] == "scaling"]
  assert all(r["at_floor"] for r in scaling), "all_to_all sends more than the floor"
  ratio = {(r["model"], r["router"], r["S"]): r["ratio"] for r in scaling}
  for router in ("balanced", "skewed"):
    assert ratio["Mixtral-8x7B", router, 8] <= 0.3
    assert ratio["DeepSeek-V3", router, 64] <= 0.15
  cpu = {(r["scheme"], r["S"]): r["sent"] for r in rows if r.get("program") == "XLA:CPU"}
  for axis in (2, 4, 8):  # the drop-in sends all_gather's static bytes, plus the counts
    assert 0 <= cpu["all_to_all", axis] - cpu["all_gather", axis] < 0.001 * cpu["all_gather", axis]
  assert (tmp_path / "dispatch_scaling.png").stat().st_size > 0 and "target" in out
  fp8 = [r for r in rows if r["section"] == "fp8"]
  # fp8 rows and their scales: about half of bf16's (the ids and weights travel as before)
  assert len(fp8) == 3 and all(0.5 < r["ratio"] < 0.6 for r in fp8), fp8


def test_eplb_benchmark_reports_balancedness_from_the_layer(tmp_path):
  out = run_script("benchmarks/eplb.py", "--smoke", out=tmp_path)
  assert "balanced" in out
  rows = json.loads((tmp_path / "eplb.json").read_text())["rows"]
  assert [r["redundant"] for r in rows] == [0, 8]
  plain, replicated = rows
  assert 0 < plain["balancedness"] <= 1 and 0 < replicated["balancedness"] <= 1
  # the busiest device carries at least the mean, and balancedness is mean over max
  for r in rows:
    assert r["busiest_per_chunk"] >= r["mean_per_chunk"]
    assert abs(r["balancedness"] - r["mean_per_chunk"] / r["busiest_per_chunk"]) < 1e-6
  assert (tmp_path / "eplb_balancedness.png").exists()


def test_mesh_benchmark_deepseek_bytes_are_the_closed_form():
  """`bench --sections mesh`'s DeepSeek-V3 table, from the layer's shapes and specs, against
  the arithmetic: 3·D·F values per expert (bf16: 2 bytes; fp8: 1 byte plus a float32 scale
  per 128x128 block), E experts over EP x FSDP devices, 58 layers."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import mesh

  rows = {(r["weights"], r["expert_parallel"], r["fsdp"]): r for r in mesh.deepseek_rows()}
  d, f, experts, layers = 7168, 2048, 256, 58
  scales = 4 * ((d // 128) * (2 * f // 128) + (f // 128) * (d // 128))
  per_expert = {"bf16": 2 * 3 * d * f, "fp8": 3 * d * f + scales}
  for (weights, ep, fsdp), row in rows.items():
    expected = per_expert[weights] * experts * layers / (ep * fsdp) / 2**30
    assert row["routed_gib"] == pytest.approx(expected), (weights, ep, fsdp)
  assert len(rows) == 2 * 3 * 4


@pytest.mark.slow
def test_the_bias_update_balances_the_skewed_router_within_200_steps():
  """`bench --sections balancing` (docs/performance.md, "Balancing without an aux loss"): the
  aux-loss-free update brings max/mean load to <= 1.10 within 200 steps and keeps it near;
  without it the skew stays. In a subprocess, as a user runs it: its 400 routing steps are
  compute, which XLA's default optimizations make twice as fast as the suite's settings."""
  code = "import sys; sys.path.insert(0, 'benchmarks'); import json, rl"
  result = run_python("-c", f"{code}; print(json.dumps(rl.balancing_rows()))")
  assert result.returncode == 0, result.stderr[-3000:]
  *steps, last = json.loads(result.stdout)
  assert steps[0]["with_update"] > 3 and min(r["without_update"] for r in steps) > 3
  assert steps[-1]["with_update"] <= 1.10 and last["with_update"] <= 1.12
  assert last["first_step_at_most_1_10"] < 200


def test_call_overhead_compares_a_commit_with_this_checkout_in_one_run(tmp_path):
  """`--against HEAD`: both columns measured (a worktree of HEAD, then removed), a ratio row
  for each measurement."""
  out = run_script(
    "benchmarks/call_overhead.py", "--against", "HEAD", "--rounds", "1", out=tmp_path
  )
  best = json.loads((tmp_path / "call_overhead.json").read_text())
  assert list(best) == ["HEAD", "this checkout"]
  rows = ("eager 1 device", "eager 2x4 mesh", "trace 1 device")
  for column in best.values():
    assert tuple(column) == rows and all(micros > 0 for micros in column.values())
  assert all(row in out for row in rows) and "ratio" in out
  worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True)
  assert worktrees.stdout.count("\n") == 1  # the temporary worktree is gone


def test_saved_activations_are_one_copy_of_the_tokens(tmp_path):
  """benchmarks/saved_activations.py: every row (bf16 and fp8_deepseek, the tile loop and the
  kernels, one device and the 2x4 mesh) keeps about one copy of its tokens for the backward
  pass (the chunk loop recomputes the experts): at most 1.1 times 2 D bytes per token. A
  second run into the same --out refuses (naming --overwrite) and leaves the first's rows."""
  out = run_script("benchmarks/saved_activations.py", out=tmp_path)
  (column,) = json.loads((tmp_path / "saved_activations.json").read_text()).values()
  copies = {row: value for row, value in column.items() if row.endswith("/ tokens")}
  assert len(copies) == 5 and all(1.0 <= value <= 1.1 for value in copies.values()), copies
  assert all(row in out for row in column)
  written = (tmp_path / "saved_activations.json").read_text()
  again = run_python("benchmarks/saved_activations.py", "--out", str(tmp_path))
  assert again.returncode != 0 and "saved_activations.json exists: pass --overwrite" in again.stderr
  assert (tmp_path / "saved_activations.json").read_text() == written


@pytest.mark.extras
def test_clients_benchmark_times_each_installed_client(tmp_path):
  """benchmarks/clients.py --smoke: a row per client, each timed beside its drop-in (ratios)
  where the client is installed, else saying it is not."""
  out = run_script("benchmarks/clients.py", "--smoke", out=tmp_path)
  rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  clients = ["levanter grug scatter", "tunix qwen3 dense", "maxtext routedmoe ragged_dot"]
  assert [r["client"] for r in rows] == clients
  for row in rows:
    assert "skipped" in row or (row["forward_ratio"] > 0 and row["train_ratio"] > 0), row
