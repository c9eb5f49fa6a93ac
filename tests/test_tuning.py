"""Tuning on the device (`moejax.tune`, `moejax.tuning`): every candidate the CPU runs is
checked and timed, `expert_backend="auto"` follows the file and the call plan cites it, a
wrong candidate is never chosen, and bad files are errors, never a silent change of path."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import kernels_pallas
import moejax
from kernels_pallas.fused_moe import FP8_BLOCKS
from kernels_pallas.gmm_triton import TritonBlocks
from moejax import experts, tokamax_experts, tuning
from moejax.apps.cli import main
from moejax.plan import ExpertPlan
from moejax.testing import poison, rank_mask
from tests.helpers import assert_close, assert_trees_close, seed_of

CONFIG = moejax.MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32)
TOKENS = 32  # per device: one chunk of 32 rows, 64 (row, choice) assignments


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(tmp_path))
  return tmp_path


def tuned(**kwargs) -> tuning.TuningFile:
  return moejax.tune(CONFIG, tokens_per_device=TOKENS, repeats=1, **kwargs)


def test_tune_checks_and_times_every_cpu_path_and_auto_follows_the_file(cache, request):
  table = tuned()
  path = tuning.user_file("cpu")
  assert path.parent == cache and tuning.TuningFile.from_json(path.read_text(), "") == table
  assert sorted(entry.rows for entry in table.entries) == [2, 2 * TOKENS]  # decode, chunk
  for entry in table.entries:
    assert [c.name for c in entry.candidates] == ["tile_loop", "ragged_dot"]
    for candidate in entry.candidates:
      assert candidate.status == "passed", candidate
      assert candidate.error < 1e-4 and candidate.grad_error < 1e-4
      assert candidate.forward_ms > 0 and candidate.train_ms > 0
    fastest = min(entry.candidates, key=lambda c: c.train_ms)
    assert entry.winner == fastest.name and entry.versions == tuning.versions_now()

  # Plant ragged_dot as the chunk's winner: the plan takes it (on a CPU the XLA rule says the
  # tile loop), cites the file, and the layer still computes the reference's output.
  record = json.loads(path.read_text())
  for entry in record["entries"]:
    entry["winner"] = "ragged_dot"
  path.write_text(json.dumps(record))
  x = jax.random.normal(jax.random.key(seed_of(request.node.name)), (TOKENS, 16))
  call = moejax.plan_call(CONFIG, x)
  assert call.expert.path == "ragged_dot", call
  assert str(path) in call.expert_reason and "ragged_dot fastest" in call.expert_reason
  params = moejax.MoELayer(CONFIG, rngs=nnx.Rngs(0)).moe_params()
  mask = rank_mask([TOKENS - 5], TOKENS)
  y, _ = moejax.moe_apply(params, x, config=CONFIG, token_mask=mask)
  assert_close(y, moejax.reference_moe(params, x, CONFIG, token_mask=mask), what="y")


def test_a_wrong_candidate_is_rejected_and_never_chosen(cache, monkeypatch):
  """ragged_dot made wrong on purpose (its output 1% off): the check fails it."""
  right = experts.grouped_matmul_mlp
  monkeypatch.setattr(experts, "grouped_matmul_mlp", lambda *a, **k: 1.01 * right(*a, **k))
  table = tuned(write=False)
  for entry in table.entries:
    status = {c.name: c.status for c in entry.candidates}
    assert status == {"tile_loop": "passed", "ragged_dot": "failed"}, entry
    assert entry.winner == "tile_loop"
  assert not tuning.user_file("cpu").exists()  # write=False


def write_entry(path, **changes) -> None:
  """A tuning file whose entry names ragged_dot for CONFIG's chunk, changed as asked."""
  candidate = tuning.Candidate(path="ragged_dot", backend="xla", status="passed", train_ms=1.0)
  entry = tuning.Entry(
    case=tuning.case_of(CONFIG, 8),
    rows=2 * TOKENS,
    objective="train",
    candidates=(candidate,),
    winner="ragged_dot",
    versions=tuning.versions_now(),
  )
  entry = dataclasses.replace(entry, **changes)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(tuning.TuningFile(device_kind="cpu", entries=(entry,)).to_json())


def test_entries_of_other_versions_are_ignored_with_a_notice(cache):
  path = tuning.user_file("cpu")
  write_entry(path)
  assert moejax.plan_call(CONFIG, (TOKENS, 16)).expert.path == "ragged_dot"
  write_entry(path, versions={**tuning.versions_now(), "jax": "0.0.1"})
  with pytest.warns(UserWarning, match="1 of 1 entries .* other versions"):
    call = moejax.plan_call(CONFIG, (TOKENS, 16))
  assert call.expert.path == "tile_loop" and "no tuning entry" in call.expert_reason


def test_an_entry_holds_for_calls_within_a_factor_of_two_only(cache):
  write_entry(tuning.user_file("cpu"))
  paths = {t: moejax.plan_call(CONFIG, (t, 16)).expert.path for t in (16, 32, 64, 128)}
  assert paths == {16: "ragged_dot", 32: "ragged_dot", 64: "ragged_dot", 128: "tile_loop"}


@pytest.mark.parametrize(
  "text, problem",
  [("{not json", "cannot be read"), ('{"format": 99}', "format 99"), ("[]", "cannot be read")],
)
def test_a_corrupt_tuning_file_is_an_error_naming_it(cache, text, problem):
  path = tuning.user_file("cpu")
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  with pytest.raises(tuning.TuningFileError, match=problem) as raised:
    moejax.plan_call(CONFIG, (TOKENS, 16))
  assert str(path) in str(raised.value)
  write_entry(path, winner="pallas:nowhere")
  with pytest.raises(tuning.TuningFileError, match="none of the entry's candidates"):
    moejax.plan_call(CONFIG, (TOKENS, 16))


def test_an_unwritable_tuning_folder_fails_before_measuring(tmp_path, monkeypatch):
  blocker = tmp_path / "a file"
  blocker.write_text("")
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(blocker / "tuning"))
  with pytest.raises(OSError, match="set MOEJAX_CACHE_DIR to another folder"):
    tuned()
  monkeypatch.delenv("MOEJAX_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
  with pytest.raises(OSError, match="set MOEJAX_CACHE_DIR to a writable folder"):
    tuned()
  with pytest.raises(ValueError, match="device_kind='' names no device"):
    tuning.file_name("")


def test_other_configs_and_expert_backends_ignore_the_entry(cache):
  write_entry(tuning.user_file("cpu"))
  other = dataclasses.replace(CONFIG, intermediate_size=64)
  assert moejax.plan_call(other, (TOKENS, 16)).expert.path == "tile_loop"
  xla = dataclasses.replace(CONFIG, expert_backend="xla")
  assert moejax.plan_call(xla, (TOKENS, 16)).expert.path == "tile_loop"


@pytest.mark.slow  # tunes once more, through the command line
def test_the_tune_command_writes_the_file_and_never_replaces_entries_unasked(cache, capsys):
  flags = ["tune", "--experts", "8", "--hidden", "64", "--intermediate", "128", "--mesh", "1x1"]
  flags += ["--tokens-per-device", "16", "--repeats", "1", "--dtype", "float32"]
  main(flags)
  printed = capsys.readouterr().out
  assert "tile_loop" in printed and "ragged_dot" in printed and "fastest" in printed
  written = tuning.user_file("cpu").read_text()
  table = tuning.TuningFile.from_json(written, "")
  assert {entry.rows for entry in table.entries} == {2, 32}
  for c in table.entries[-1].candidates:  # the errors printed are the ones stored
    if c.error is not None:
      assert f"{c.error:.1e} {c.grad_error:>10.1e}" in printed, c.name
  with pytest.raises(SystemExit, match=r"already holds 2 entr.*--overwrite"):
    main(flags)  # refused before measuring: the file unchanged
  assert tuning.user_file("cpu").read_text() == written
  tuning.user_file("cpu").write_text("{not json")  # what the corrupt file's error advises:
  main([*flags, "--overwrite"])
  assert "{not json" not in tuning.user_file("cpu").read_text()
  unreadable = tuning.user_file("cpu").with_name("tuning-cpu.json.unreadable")
  assert unreadable.read_text() == "{not json"  # kept, out of the way
  with pytest.raises(SystemExit):
    main(["tune", "--model", "nope"])
  assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_layer_flags_beside_a_preset_are_refused(cache):
  with pytest.raises(
    SystemExit, match=r"moejax tune: --experts, --hidden would be ignored: --model or --config"
  ):
    main(["tune", "--model", "qwen3-30b-a3b", "--experts", "8", "--hidden", "64"])


def test_a_kernel_entry_with_block_sizes_runs_that_kernel_with_them(cache, monkeypatch, request):
  """A winner `pallas:triton[32x32x16x4x2]`: the layer calls the Triton kernels with those
  blocks (recorded here, computed by XLA: a CPU runs no GPU kernel) and the reference's
  output."""
  blocks = dict(block_m=32, block_n=32, block_k=16, num_warps=4, num_stages=2)
  candidate = tuning.Candidate(path="pallas", backend="triton", blocks=blocks, status="passed")
  write_entry(tuning.user_file("cpu"), candidates=(candidate,), winner=candidate.name)
  asked = []

  def moe_mlp(*args, implementation, config, interpret, **kwargs):
    asked.append((implementation, config, interpret))
    return right(*args, implementation="xla", **kwargs)

  right = kernels_pallas.moe_mlp
  monkeypatch.setattr(kernels_pallas, "moe_mlp", moe_mlp)
  call = moejax.plan_call(CONFIG, (TOKENS, 16))
  assert call.expert.blocks == TritonBlocks(**blocks) and candidate.name in call.expert_reason
  x = jax.random.normal(jax.random.key(seed_of(request.node.name)), (TOKENS, 16))
  params = moejax.MoELayer(CONFIG, rngs=nnx.Rngs(0)).moe_params()
  y, _ = moejax.moe_apply(params, x, config=CONFIG)
  assert set(asked) == {("triton", TritonBlocks(**blocks), True)}  # each trace of the chunk
  assert_close(y, moejax.reference_moe(params, x, CONFIG), what="y")


def test_a_fused_entry_plans_the_fused_path_where_it_runs(cache):
  """`auto` follows a tuning entry whose winner is the fused path; for a config the fused
  kernels cannot run (an intermediate width off their blocks), the entry is an error naming
  why."""
  candidate = tuning.Candidate(path="fused", backend="triton", status="passed", train_ms=1.0)
  write_entry(tuning.user_file("cpu"), candidates=(candidate,), winner="fused")
  call = moejax.plan_call(CONFIG, (TOKENS, 16))
  assert call.expert == ExpertPlan(path="fused", backend="triton", interpret=True)
  assert "measured fused fastest" in call.expert_reason
  odd = dataclasses.replace(CONFIG, intermediate_size=24)
  write_entry(
    tuning.user_file("cpu"), case=tuning.case_of(odd, 8), candidates=(candidate,),
    winner="fused",
  )  # fmt: skip
  cannot = r"names fused for a case it cannot run \(the fused kernels need intermediate_size=24"
  with pytest.raises(tuning.TuningFileError, match=cannot):
    moejax.plan_call(odd, (TOKENS, 16))


@pytest.mark.filterwarnings("ignore:expert_backend='fused' on a CPU")
def test_fp8_compute_follows_the_entries_measured_for_its_recipe(cache):
  """With compute_quant, `auto` reads the entries whose case names the recipe: none, the
  tile loop (the recipe emulated; a bf16 entry of the same widths does not apply); a fused
  winner, the fused path at its fp8 blocks; a winner that has no fp8 kernel, an error. On a
  CPU `tune` measures the tile loop alone, against the recipe's emulation."""
  fp8 = dataclasses.replace(
    CONFIG, hidden_size=128, intermediate_size=128, compute_quant="fp8_deepseek"
  )
  # Tuning it on a CPU: the tile loop alone, checked against the recipe's emulation (itself).
  table = moejax.tune(fp8, tokens_per_device=TOKENS, repeats=1, write=False)
  assert sorted(entry.rows for entry in table.entries) == [2, 2 * TOKENS]
  for entry in table.entries:
    assert entry.case == tuning.case_of(fp8, 8) and entry.winner == "tile_loop"
    (candidate,) = entry.candidates
    assert candidate.status == "passed" and max(candidate.error, candidate.grad_error) < 1e-6
  bf16_case = tuning.case_of(dataclasses.replace(fp8, compute_quant=None), 8)
  fused = tuning.Candidate(
    path="fused", backend="triton", blocks=dataclasses.asdict(FP8_BLOCKS), status="passed"
  )
  write_entry(tuning.user_file("cpu"), case=bf16_case, candidates=(fused,), winner="fused")
  assert moejax.plan_call(fp8, (TOKENS, 128)).expert == ExpertPlan(path="tile_loop")
  write_entry(
    tuning.user_file("cpu"), case=tuning.case_of(fp8, 8), candidates=(fused,), winner="fused"
  )
  call = moejax.plan_call(fp8, (TOKENS, 128))
  assert call.expert == ExpertPlan(
    path="fused", backend="triton", interpret=True, blocks=FP8_BLOCKS
  )
  assert "measured fused fastest" in call.expert_reason
  triton = tuning.Candidate(path="pallas", backend="triton", status="passed")
  write_entry(
    tuning.user_file("cpu"), case=tuning.case_of(fp8, 8), candidates=(triton,),
    winner="pallas:triton",
  )  # fmt: skip
  with pytest.raises(tuning.TuningFileError, match=r"pallas:triton .* \(no fp8 kernel\)"):
    moejax.plan_call(fp8, (TOKENS, 128))


def test_a_tokamax_entry_runs_tokamaxs_ragged_dot(cache, request):
  """`ragged_dot:tokamax` (the optional extra; its XLA kernel on a CPU): the layer's output
  and gradients are the reference's. Without the extra such an entry is an error naming it."""
  candidate = tuning.Candidate(path="ragged_dot", backend="tokamax", status="passed")
  write_entry(tuning.user_file("cpu"), candidates=(candidate,), winner="ragged_dot:tokamax")
  if not tokamax_experts.installed():
    with pytest.raises(tuning.TuningFileError, match="tokamax is not installed"):
      moejax.plan_call(CONFIG, (TOKENS, 16))
    return
  assert moejax.plan_call(CONFIG, (TOKENS, 16)).expert.backend == "tokamax"
  x = jax.random.normal(jax.random.key(seed_of(request.node.name)), (TOKENS, 16))
  mask = rank_mask([TOKENS - 7], TOKENS)
  params = moejax.MoELayer(CONFIG, rngs=nnx.Rngs(0)).moe_params()
  layer = lambda p, x: moejax.moe_apply(p, poison(x, mask), config=CONFIG, token_mask=mask)[0]
  reference = lambda p, x: moejax.reference_moe(p, x, CONFIG, token_mask=mask)
  assert_close(layer(params, x), reference(params, x), what="y")
  loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
  got = jax.grad(loss(layer), argnums=(0, 1))(params, x)
  want = jax.grad(loss(reference), argnums=(0, 1))(params, x)
  assert_trees_close(got, want, what="gradients")


def test_the_shipped_table_is_read_after_the_users_file(cache, tmp_path, monkeypatch):
  shipped = tmp_path / "shipped"
  monkeypatch.setattr(tuning, "SHIPPED_DIR", shipped)
  write_entry(shipped / tuning.file_name("cpu"))
  call = moejax.plan_call(CONFIG, (TOKENS, 16))
  assert call.expert.path == "ragged_dot" and str(shipped) in call.expert_reason
  tile_loop = tuning.Candidate(path="tile_loop", status="passed")
  write_entry(tuning.user_file("cpu"), candidates=(tile_loop,), winner="tile_loop")
  call = moejax.plan_call(CONFIG, (TOKENS, 16))
  assert call.expert.path == "tile_loop" and str(tuning.user_file("cpu")) in call.expert_reason


@pytest.mark.parametrize(
  "path", sorted(tuning.SHIPPED_DIR.glob("tuning-*.json")), ids=lambda p: p.name
)
def test_a_shipped_table_names_its_fastest_checked_candidates(path):
  """Each shipped table (recorded GPU runs only) reads, is named for its device kind, and each
  entry's winner is the fastest of the candidates that passed the check, within its bounds."""
  table = tuning.TuningFile.from_json(path.read_text(), str(path))
  assert path.name == tuning.file_name(table.device_kind) and table.entries
  for entry in table.entries:
    bound = moejax.testing.RELATIVE_BOUNDS[jnp.dtype(entry.case["dtype"])]
    passed = [c for c in entry.candidates if c.status == "passed"]
    assert all(c.error <= bound and c.grad_error <= 2 * bound for c in passed), entry
    time_of = (lambda c: c.train_ms) if entry.objective == "train" else (lambda c: c.forward_ms)
    assert entry.winner == min(passed, key=time_of).name, entry
    assert entry.versions["moejax"] == moejax.__version__, entry.versions
