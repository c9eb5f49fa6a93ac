"""The fit planner (`moejax.fit`, `python -m moejax fit`): bad inputs refused before anything
compiles (fast tier), and reports read off programs compiled for compile-only H200s (the
GPU-compile tier: JAX's CUDA plugin, no GPU)."""

import contextlib
import dataclasses
import json
import shlex
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from kernels_pallas import platform
from kernels_pallas.gpus import GPUS
from moejax import fit as planner
from moejax import hf, plan_call, targets, tuning
from moejax.apps import fit_cli, fit_search
from moejax.apps.cli import main, parser
from moejax.plan import ExpertPlan
from tests.gpu_tier import GPU_COMPILE_TIER, no_persistent_compilation_cache  # noqa: F401
from tests.helpers import expect_triton_deprecation

# A Qwen3-MoE of small width: 4 decoder layers, the first dense (mlp_only_layers).
TINY = dict(
  model_type="qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
  num_experts=16, num_experts_per_tok=2, vocab_size=1000, mlp_only_layers=[0],
)  # fmt: skip


@pytest.mark.parametrize(
  "preset, layers, total",
  [
    ("deepseek-v4-flash-base", 43, 284e9),
    ("glm-5", 75, 744e9),
    ("mistral-large-4", 71, 1e12),
    ("minimax-m2", 62, 230e9),
    ("qwen3.5-397b-a17b", 60, 397e9),
  ],
)
def test_a_2026_preset_holds_its_names_parameters(preset, layers, total):
  """The 2026 presets of sources other than the published config.json: their MoE layers, and
  their routed and shared experts, routers and the rest of the model add up to the total
  their releases give (within 6%: the totals round, and the rest is a stand-in's)."""
  config_json = planner.PRESETS[preset]
  config = planner._config(config_json, "infer", "released", 16)
  assert len(hf.moe_layers(config_json)) == layers
  d, f, e = config.hidden_size, config.intermediate_size, config.num_experts
  moe = layers * (3 * d * (e * f + config.shared_intermediate_size) + d * e)
  assert planner.rest_of_model_parameters(config_json) + moe == pytest.approx(total, rel=0.06)


@pytest.mark.parametrize(
  "arguments, message",
  [
    (dict(model="deepseek-v4"), "neither a preset"),
    (dict(model="deepseek-v3", gpu="h300"), "gpu='h300'; expected one of"),
    (dict(model="deepseek-v3", job="serve"), "job='serve'; expected one of"),
    (dict(model="deepseek-v3", job="train"), "job='train' trains every expert weight"),
    (dict(model="mixtral-8x22b", expert_parallel=16), "expert_parallel=16 must divide both"),
    (dict(model="qwen3-30b-a3b", expert_quant="int3"), "expert_quant='int3'; expected"),
    (dict(model="qwen3-30b-a3b", remat="some"), "remat='some'; expected"),
    # its released experts are fp8 blocks: a recipe quantizes float ones
    (dict(model="deepseek-v3", compute_quant="fp8_deepseek"), "stores them quantized: choose"),
  ],
)
def test_what_cannot_be_planned_is_refused_naming_it(arguments, message):
  with pytest.raises(ValueError, match=message):
    planner.fit(**arguments)


def test_a_checkpoint_folder_or_config_json_is_read_like_a_preset(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(TINY))
  for model in (tmp_path, str(tmp_path / "config.json")):
    with pytest.raises(ValueError, match="job='serve'"):  # read, then the job refused
      planner.fit(model, job="serve")


def test_the_command_line_exits_naming_a_bad_flag(capsys):
  """Presets and GPUs are the flags' choices: an unknown one is named with the list."""
  for flags, named in (
    (["--model", "nope"], "--model: invalid choice: 'nope' (choose from 'deepseek-v3'"),
    (["--model", "qwen3-30b-a3b", "--gpu", "h300"], "--gpu: invalid choice: 'h300'"),
  ):
    with pytest.raises(SystemExit):
      main(["fit", *flags])
    assert named in capsys.readouterr().err


def test_the_kv_cache_is_counted_by_its_formula():
  """Per token and layer: multi-head latent attention's latent and rope key; grouped-query
  attention's keys and values; a sliding-window layer at most its window."""
  assert (
    planner.kv_cache_bytes(planner.PRESETS["qwen3-30b-a3b"], 1000) == 48 * 1000 * 2 * 4 * 128 * 2
  )
  gpt_oss = planner.PRESETS["gpt-oss-120b"]
  assert planner.kv_cache_bytes(gpt_oss, 1000) == (18 * 1000 + 18 * 128) * 2 * 8 * 64 * 2
  assert planner.kv_cache_bytes(gpt_oss, 100) == 36 * 100 * 2 * 8 * 64 * 2  # within the window
  assert planner.kv_cache_bytes(planner.PRESETS["deepseek-v3"], 10) == 61 * 10 * (512 + 64) * 2


def test_the_rest_of_the_model_is_counted_by_its_formula():
  """DeepSeek-V3's parameters outside its MoE layers, from its config.json: 61 layers of
  multi-head latent attention, 3 dense FFN layers, embeddings and the output projection."""
  d, h, layers = 7168, 128, 61
  attention = d * 1536 + 1536 * h * 192 + d * (512 + 64) + 512 * h * (128 + 128) + h * 128 * d
  want = 2 * 129280 * d + layers * (attention + 2 * d) + 3 * (3 * d * 18432) + d
  assert planner.rest_of_model_parameters(planner.PRESETS["deepseek-v3"]) == want
  assert 14e9 < want < 16e9  # DeepSeek-V3's 671B less its MoE layers' ~656B
  # Grouped-query attention: q and o over 4 heads of 64, k and v over 2; one dense FFN layer.
  d, q, kv = 256, 256 * 4 * 64, 256 * 2 * 64
  want = 2 * 1000 * d + 4 * (2 * q + 2 * kv + 2 * d) + 3 * d * 512 + d
  assert planner.rest_of_model_parameters(TINY) == want


@pytest.mark.parametrize(
  "arguments, path",
  [
    (dict(), "tile_loop"),  # 2 local experts on a GPU, 2048 rows per chunk: ragged_dot's too many
    (dict(expert_quant="fp8_block", tokens_per_device=1), "tile_loop"),  # ragged_dot: no fp8
    (dict(expert_parallel=1, tokens_per_device=1), "ragged_dot"),  # decode-size: 2 rows, El 16
    (dict(expert_backend="fused", job="train"), "fused"),  # its Triton kernels, fwd and bwd
  ],
  ids=["float", "quantized", "decode", "fused"],
)
@pytest.mark.usefixtures("no_persistent_compilation_cache")
@GPU_COMPILE_TIER[0]
@GPU_COMPILE_TIER[1]
def test_the_estimate_takes_the_layers_expert_path(arguments, path):
  """The estimate's rate is the path the layer's call plan takes (`moejax.plan_call`, what
  `moe_apply` runs), not a rule of its own: the rows of the call, the quantized format and
  the backend asked for decide, not the local experts alone."""
  with expect_triton_deprecation() if path == "fused" else contextlib.nullcontext():
    report = planner.fit(TINY, "h200", **{"tokens_per_device": 256, **arguments})
  assert report.expert_path == path
  assert f"the layer's path: {path}" in " ".join(report.estimate.assumptions)
  # no kernel's layer rate is recorded: the fused path is estimated at the tile loop's
  assert ("no fused kernel rate" in report.estimate.rate_source) == (path == "fused")


@pytest.mark.parametrize("job", ["infer", "lora", "train"])
@pytest.mark.usefixtures("no_persistent_compilation_cache")
@GPU_COMPILE_TIER[0]
@GPU_COMPILE_TIER[1]
def test_a_report_reads_the_compiled_program(job):
  remat = "full" if job == "train" else "none"  # each layer rematerialized, in one case
  report = planner.fit(TINY, "h200", job=job, tokens_per_device=256, remat=remat)
  assert report.mesh == {"data": 1, "expert": 8} and report.moe_layers == 3
  per_device = report.per_device_bytes
  # 3 MoE layers of 16 experts, [D, 2F] + [F, D] bf16, split over 8 devices.
  assert per_device["expert_weights"] == 3 * 16 * (256 * 256 + 128 * 256) * 2 // 8
  assert (per_device["adapters"] > 0) == (job == "lora")
  # The rest of the model is compiled with it: its bf16 weights split over the 8 devices.
  assert per_device["rest_of_model"] == report.rest_of_model_parameters * 2 // 8
  # Adam's moments: float32 mu and nu of the float32 routers ([D, E] a layer, whole on every
  # device); float32 mu and bf16 nu of the bf16 weights and of the adapters (bf16, as the
  # layer stores them: the call record's dtype); and its step count.
  weights = per_device["expert_weights"] + per_device["other_moe_weights"]
  weights += per_device["rest_of_model"]
  routers = 3 * 256 * 16 * 4
  moments = {
    "infer": 0,
    "lora": 3 * per_device["adapters"] + 4,
    "train": 3 * (weights - routers) + 2 * routers + 4,
  }
  assert per_device["optimizer_state"] == moments[job]
  gradients = {"infer": 0, "lora": per_device["adapters"], "train": weights}
  assert per_device["gradients"] == gradients[job] <= per_device["temp"]
  # The arguments: weights, adapters, optimizer state and each device's 256 token ids.
  held = weights + per_device["adapters"] + per_device["optimizer_state"] + 256 * 4
  assert per_device["arguments"] == held
  # Training's temp holds at least every token's float32 logits over the vocabulary.
  assert per_device["temp"] > (256 * 1000 * 4 if job != "infer" else 0)
  compiled = per_device["arguments"] + per_device["temp"] + per_device["outputs_not_aliased"]
  assert per_device["total"] == compiled + per_device["kv_cache"]
  assert report.fits and report.headroom_bytes == report.gpu_memory_bytes - per_device["total"]
  estimate = report.estimate
  assert estimate.stack_s == pytest.approx(3 * estimate.layer_s) and estimate.layer_s > 0
  np.testing.assert_allclose(
    estimate.layer_s, estimate.compute_s + estimate.memory_s + estimate.exchange_s
  )
  assert (
    json.loads(json.dumps(report.to_json()))["per_device_bytes"]["total"] == per_device["total"]
  )
  # 8 experts' devices, K = 2: all_gather sends a token to 7 others, all_to_all to 2
  schemes = estimate.exchange_s_by_scheme
  assert schemes["all_gather"] == pytest.approx(schemes["all_to_all"] * 7 / 2)
  assert estimate.exchange_s in schemes.values()
  assert estimate.tokens_per_s_per_gpu == pytest.approx(256 / estimate.stack_s)


@pytest.mark.usefixtures("no_persistent_compilation_cache")
@GPU_COMPILE_TIER[0]
@GPU_COMPILE_TIER[1]
def test_a_preset_is_planned_at_its_real_shapes():
  """Qwen3-30B-A3B served on one 8xH200 node: its 48 MoE layers of 128 experts, in bf16."""
  report = planner.fit("qwen3-30b-a3b", "h200", job="infer")
  assert report.moe_layers == 48 and report.mesh == {"data": 1, "expert": 8}
  assert report.per_device_bytes["expert_weights"] == 48 * 128 * 3 * 2048 * 768 * 2 // 8
  assert report.fits and report.chunk_size <= report.tokens_per_device == 4096
  keys = report.to_json()
  assert {"fits", "gpu_memory_bytes", "per_device_bytes", "chunk_size"} <= set(keys)


@pytest.mark.usefixtures("no_persistent_compilation_cache")
@GPU_COMPILE_TIER[0]
@GPU_COMPILE_TIER[1]
def test_the_estimate_takes_a_tuning_files_rate(tmp_path, monkeypatch):
  """With a tuning entry for the call on the target's GPU kind, the layer's path and the
  estimate's rate are the entry's, and the report names the file."""
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(tmp_path))
  mesh = targets.target_mesh("h200", (1, 8))
  config = planner._config(TINY, "infer", "released", 16, dispatch="auto", chunk_size="auto")
  call = plan_call(config, (8 * 256, config.hidden_size), mesh=mesh)
  local = call.exchange.local_experts
  winner = tuning.Candidate(path="tile_loop", status="passed", forward_ms=2.0, train_ms=6.0)
  with platform.running_on(mesh.devices.flat[0]):
    entry = tuning.Entry(
      case=tuning.case_of(config, local),
      rows=call.received_rows * config.top_k,
      objective="train",
      candidates=(winner,),
      winner="tile_loop",
      versions=tuning.versions_now(),
    )
  path = tuning.user_file("NVIDIA H200")
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(tuning.TuningFile(device_kind="NVIDIA H200", entries=(entry,)).to_json())
  report = planner.fit(TINY, "h200", tokens_per_device=256)
  assert report.expert_path == "tile_loop"  # ragged_dot without the entry (above)
  assert str(path) in report.estimate.rate_source
  flops = 6 * entry.rows / 8 * config.hidden_size * config.intermediate_size
  efficiency = flops / 2e-3 / GPUS["h200"].peak_bf16_flops
  assert f"times {efficiency:.3f}" in " ".join(report.estimate.assumptions)


@pytest.mark.usefixtures("no_persistent_compilation_cache")
@GPU_COMPILE_TIER[0]
@GPU_COMPILE_TIER[1]
def test_the_command_warns_of_a_flag_that_does_nothing_and_fails_a_plan_that_does_not_fit(
  monkeypatch, capsys
):
  report = planner.fit(TINY, "h200", expert_fsdp=True, tokens_per_device=256)
  assert report.mesh["data"] == 1 and "expert_fsdp does nothing" in report.warnings[0]
  monkeypatch.setattr(fit_cli, "fit", lambda *args, **kwargs: report)
  main(["fit", "--model", "qwen3-30b-a3b", "--expert-fsdp"])  # fits: returns
  assert "warning: expert_fsdp does nothing" in capsys.readouterr().err
  too_big = dataclasses.replace(report, fits=False)
  monkeypatch.setattr(fit_cli, "fit", lambda *args, **kwargs: too_big)
  with pytest.raises(SystemExit) as exited:
    main(["fit", "--model", "qwen3-30b-a3b"])
  assert exited.value.code == 1 and "does NOT fit" in capsys.readouterr().out


def test_find_tries_the_fewest_nodes_first_and_stops_at_the_first_plan_that_fits(monkeypatch):
  """The search's order, with a stand-in planner that fits from 4 nodes with FSDP: 1 and 2
  nodes tried in full, then 4 nodes until the first FSDP plan."""
  calls = []

  def planner_stand_in(model, gpu, *, nodes, expert_fsdp, **kwargs):
    calls.append((nodes, kwargs["expert_parallel"], expert_fsdp))
    fits = nodes >= 4 and expert_fsdp
    return types.SimpleNamespace(fits=fits, per_device_bytes={"total": 100 // nodes}, nodes=nodes)

  monkeypatch.setattr(fit_search, "fit", planner_stand_in)
  fp8 = dict(compute_quant="fp8_deepseek", dispatch_quant="fp8")
  search = fit_search.find(
    "qwen3-30b-a3b", "h100", max_nodes=8, job="train", expert_quant=None, **fp8
  )
  # 128 experts: 8, 16 and 32 devices put every device on the expert axis first.
  assert calls == [
    (1, 8, False), (1, 4, True), (1, 2, True),
    (2, 16, False), (2, 8, True), (2, 4, True),
    (4, 32, False), (4, 16, True),
  ]  # fmt: skip
  assert search.found.nodes == 4 and len(search.tried) == len(calls)
  assert search.command == (
    "python -m moejax fit --model qwen3-30b-a3b --gpu h100 --nodes 4 --gpus-per-node 8 "
    "--expert-parallel 16 --expert-fsdp --shared-fsdp --dispatch all_to_all --remat full "
    "--job train --expert-quant none --compute-quant fp8_deepseek --dispatch-quant fp8"
  )
  assert vars(parser().parse_args(shlex.split(search.command)[3:])).items() >= fp8.items()
  plan = dict(
    expert_parallel=8, expert_fsdp=False, shared_fsdp=False, dispatch="auto", remat="none"
  )
  fused = fit_search.command("qwen3-30b-a3b", "h200", 1, 8, plan, dict(expert_backend="fused"))
  assert parser().parse_args(shlex.split(fused)[3:]).backend == "fused"
  never = lambda *args, **kwargs: types.SimpleNamespace(fits=False, per_device_bytes={"total": 1})
  monkeypatch.setattr(fit_search, "fit", never)
  search = fit_search.find("qwen3-30b-a3b", "h100", max_nodes=2)
  assert search.found is None and search.command is None and len(search.tried) == 6


def test_the_estimate_counts_the_emulated_fp8_compute_and_the_fp8_exchange():
  """`compute_quant` runs emulated (float32 products at full precision): its compute term is
  at the float32 rate (on the fp8 kernels, bf16's: no fp8 rate is measured); `dispatch_quant`
  sends the forward's rows as e4m3 values with a float32 scale each 128 (1 + 4/128 bytes a
  value, not bf16's 2), the other legs as they were."""
  config = planner._config(TINY, "train", None, 16)
  mesh_shape = {"data": 1, "expert": 8}
  call = plan_call(
    config, (8 * 256, config.hidden_size), mesh=jax.make_mesh((1, 8), ("data", "expert"))
  )
  h200 = GPUS["h200"]
  estimate = lambda **quant: planner.estimate_step(
    dataclasses.replace(config, **quant), h200, "train", mesh_shape, 1, 8, 256, call, 3
  )
  base, fp8 = estimate(), estimate(compute_quant="fp8_deepseek", dispatch_quant="fp8")
  assert fp8.compute_s / base.compute_s == pytest.approx(h200.peak_bf16_flops / h200.peak_f32_flops)
  assert h200.peak_f32_flops == pytest.approx(2 * 132 * 128 * h200.clock_ghz * 1e9)
  for scheme, seconds in base.exchange_s_by_scheme.items():  # training: 4 legs of bf16 rows
    ratio = fp8.exchange_s_by_scheme[scheme] / seconds
    assert ratio == pytest.approx((3 * 2 + 1 + 4 / 128) / (4 * 2))
  told = " ".join(fp8.assumptions)
  assert "float32 peak (fp8_deepseek, emulated)" in told and "forward rows in fp8" in told
  on_kernels = dataclasses.replace(call, expert=ExpertPlan(path="pallas", backend="mosaic"))
  kernels = planner.estimate_step(
    dataclasses.replace(config, compute_quant="fp8_deepseek"), h200, "train", mesh_shape, 1, 8,
    256, on_kernels, 3,
  )  # fmt: skip
  assert "bf16 peak (fp8_deepseek on the fp8 kernels: no fp8 rate measured)" in " ".join(
    kernels.assumptions
  )


@pytest.mark.usefixtures("no_persistent_compilation_cache")
@GPU_COMPILE_TIER[0]
@GPU_COMPILE_TIER[1]
def test_find_prints_a_command_whose_own_report_fits(tmp_path, capsys):
  path = tmp_path / "config.json"
  path.write_text(json.dumps(TINY))
  flags = ["--config", str(path), "--job", "infer", "--expert-quant", "none"]
  flags += ["--tokens-per-device", "256", "--max-nodes", "2"]
  main(["fit", *flags, "--find"])
  out = capsys.readouterr().out
  command = out.strip().splitlines()[-1].split(": ", 1)[1]
  assert out.splitlines()[1].split()[-2] == "yes"  # the first plan tried fits
  main(shlex.split(command)[3:])  # `fit ...`: exits 1 unless it fits
  assert "fits: " in capsys.readouterr().out


@pytest.mark.usefixtures("no_persistent_compilation_cache")
@GPU_COMPILE_TIER[0]
@GPU_COMPILE_TIER[1]
def test_a_training_job_in_fp8_is_compiled_as_moejax_runs_it(tmp_path, capsys):
  """--compute-quant and --dispatch-quant reach the compiled program: training on the tile
  loop (the recipe's one path) with the fp8 exchange between the 8 devices."""
  path = tmp_path / "config.json"
  path.write_text(json.dumps(TINY))
  flags = ["--config", str(path), "--job", "train", "--expert-quant", "none"]
  flags += ["--compute-quant", "fp8_deepseek", "--dispatch-quant", "fp8"]
  main(["fit", *flags, "--tokens-per-device", "256"])  # exits 1 unless it fits
  out = capsys.readouterr().out
  assert "experts bf16, computed in fp8_deepseek, dispatched in fp8, on 1 x 8 h200" in out
  assert "experts by tile_loop" in out and "(the forward rows in fp8 with their scales)" in out


def test_a_family_with_per_layer_clamps_plans_with_its_first_moe_layers_config():
  """Step-3.7's layers differ only in their clamps: fit plans with its first MoE layer's
  config (a list of clamps without a layer's entry is an error naming it); a block with one
  MoE layer per token type (ERNIE-4.5-VL) and a layer whose router is the model's (ZAYA) are
  refused by name."""
  step = dict(
    model_type="step3p5", hidden_size=64, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, share_expert_dim=32, num_hidden_layers=4,
    moe_layers_enum="1,2,3", swiglu_limits=[0, 7.0, 0, 0],
  )  # fmt: skip
  config = planner._config(step, "infer", "released", 16)
  assert (config.activation, config.swiglu_limit, config.num_experts) == (
    "swiglu_clamped_after",
    7.0,
    8,
  )
  with pytest.raises(ValueError, match="swiglu_limits has 2 entries, none for layer 3"):
    hf.config_from_hf({**step, "swiglu_limits": [0, 7.0]}, layer=3)
  with pytest.raises(NotImplementedError, match=r"\['text', 'vision'\]"):
    planner._config(dict(model_type="ernie4_5_vl_moe", hidden_size=64), "infer", "released", 16)
  with pytest.raises(NotImplementedError, match="zaya: its MoE layers take their router's"):
    planner._config(dict(model_type="zaya", hidden_size=64), "infer", "released", 16)


@pytest.mark.parametrize("model_type", ["minimax_m3_vl", "glm5_next", "hy_v4_vl", "mistral_large4"])
def test_a_text_model_saved_alone_plans_as_its_model(model_type):
  """A vision-language model's text model saved alone (model type `*_text`, its fields at the
  top level) plans the MoE layer its model does (`fit --config`; the loading of each is
  tests/test_hf_transformers.py's)."""
  text = dict(
    hidden_size=64, num_hidden_layers=3, n_routed_experts=8, num_local_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=32, n_shared_experts=1,
    shared_intermediate_size=32, n_group=1, topk_group=1,
    mlp_layer_types=["dense", "sparse", "sparse"],
  )  # fmt: skip
  alone = planner._config(dict(model_type=f"{model_type}_text", **text), "infer", "released", 16)
  within = planner._config(dict(model_type=model_type, text_config=text), "infer", "released", 16)
  assert alone == within
  assert (alone.num_experts, alone.top_k, alone.hidden_size) == (8, 2, 64)


def test_the_reports_parts_sit_under_the_figure_they_are_part_of():
  """The text report indents each part under the compiler's figure it belongs to, so the
  unindented lines add up to the total and no byte is read twice."""
  per_device = dict(
    expert_weights=6, other_moe_weights=1, adapters=1, rest_of_model=2, gradients=3,
    optimizer_state=4, arguments=15, temp=5, outputs_not_aliased=1, kv_cache=2, total=23,
  )  # fmt: skip
  lines = fit_cli._memory_lines({k: v * fit_cli.GIB for k, v in per_device.items()})
  top = {line.split()[0]: float(line.split()[1]) for line in lines if not line.startswith("   ")}
  assert list(top) == ["arguments", "temp", "outputs_not_aliased", "kv_cache", "total"]
  assert sum(top.values()) - top["total"] == top["total"]
  assert lines[lines.index(next(x for x in lines if "temp" in x)) + 1].split()[0] == "gradients"
  assert len(lines) == len(per_device)


def test_the_expert_parallel_default_is_told_alike_in_help_code_and_docs(capsys):
  with pytest.raises(SystemExit):
    main(["fit", "--help"])
  told = " ".join(capsys.readouterr().out.split())
  assert "the most that divide both the devices and the experts" in told
  docs = " ".join((Path(__file__).parents[1] / "docs" / "fit.md").read_text().split())
  assert "defaults to the most devices that divide both the devices and the experts" in docs
  assert planner._expert_parallel(None, devices=16, experts=24) == 8  # the largest such


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--find", "--nodes", "2", "--remat", "full"], "--nodes, --remat would be ignored: --find"),
    (["--max-nodes", "4"], "--max-nodes would be ignored: it bounds --find's search"),
    (["--job", "train", "--context-tokens", "64"], "--context-tokens would be ignored: only"),
    (["--lora-rank", "8"], "--lora-rank would be ignored: only --job lora trains adapters"),
  ],
)
def test_a_flag_the_command_would_ignore_is_refused(flags, message):
  with pytest.raises(SystemExit, match=f"moejax fit: {message}"):
    main(["fit", "--model", "qwen3-30b-a3b", *flags])
