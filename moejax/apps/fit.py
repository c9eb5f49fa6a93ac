"""Will it fit, and how fast would it run? A real MoE model compiled for GPU nodes on a machine
without them.

`fit` builds the model's MoE layers (their real number, scanned, real shapes) and a stand-in
of the rest of it (attention, dense layers, embeddings: `moejax.apps.fit_model`) on a mesh of
compile-only devices of the target (`moejax.targets`, JAX's CUDA plugin, no GPU), compiles the
job as it runs (the forward for "infer"; loss, gradient and Adam update for "lora" and
"train") and reports, per device, the compiler's memory figures against the GPU's memory. The
step time is an estimate of the MoE layers alone (`StepEstimate`), every assumption in its
report.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.formats import FORMATS
from kernels_pallas.gpus import GPUS, Gpu
from moejax import hf, targets
from moejax.apps import fit_model
from moejax.call_plan import CallPlan, plan_call
from moejax.compute_quant import GROUP
from moejax.config import MoEConfig
from moejax.experts import runs_fp8_kernels
from moejax.forward import moe_apply
from moejax.params import ADAPTER_PARAMS, EXPERT_PARAMS, MoEParams
from moejax.remat import REMAT_POLICIES
from moejax.stacking import stacked_sharding
from moejax.testing import abstract_params

JOBS = ("infer", "lora", "train")

# Published config.json fields of each preset (what `moejax.hf` and the rest-of-model count
# read), as the models' repositories hold them.
_DEEPSEEK_V3 = dict(
  model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
  num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
  n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
  qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8,
  topk_group=4, num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3,
  norm_topk_prob=True, scoring_func="sigmoid", vocab_size=129280, tie_word_embeddings=False,
  hidden_act="silu",
  quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                           weight_block_size=[128, 128]),
)  # fmt: skip
_KIMI_K2 = {
  **_DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
  "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1,
  "first_k_dense_replace": 1, "vocab_size": 163840,
}  # fmt: skip
_QWEN3_MOE = dict(
  model_type="qwen3_moe", num_experts_per_tok=8, num_experts=128, decoder_sparse_step=1,
  mlp_only_layers=[], norm_topk_prob=True, vocab_size=151936, head_dim=128,
  num_key_value_heads=4, tie_word_embeddings=False, hidden_act="silu",
)  # fmt: skip
# Three 2026 flagships whose published config.json the stored sources do not hold: transformers
# 5.25's config classes document them (`@auto_docstring(checkpoint=...)`: DeepseekV4Config
# deepseek-ai/DeepSeek-V4-Flash-Base, GlmMoeDsaConfig zai-org/GLM-5, MistralLarge4TextConfig
# mistralai/Mistral-Large-4-1T-A52B) and their defaults are these fields. Third-party pages
# agree on the MoE sizes (DeepSeek-V4-Flash: 43 layers, 256 routed experts and one shared,
# top-6, NVIDIA NeMo AutoModel; GLM-5: 78 layers, 3 dense, hidden 6144, 64 heads, 256 experts,
# top-8, NVIDIA Megatron-Bridge and Vultr), as do the totals the names give (284B, 744B, 1T).
# The releases' quantization is not among the defaults: each is planned in bf16.
_DEEPSEEK_V4_FLASH_BASE = dict(
  model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048,
  num_hidden_layers=43, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
  q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1,
  scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
  swiglu_limit=10.0, hidden_act="silu", tie_word_embeddings=False,
)  # fmt: skip
_GLM_5 = dict(
  model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
  moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64,
  num_key_value_heads=64, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
  kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64, v_head_dim=256,
  qk_nope_head_dim=192, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
  hidden_act="silu", tie_word_embeddings=False, first_k_dense_replace=3,
)  # fmt: skip
_MISTRAL_LARGE_4 = dict(
  model_type="mistral_large4", vocab_size=204800, hidden_size=6144, intermediate_size=24576,
  moe_intermediate_size=6144, num_hidden_layers=72, num_attention_heads=64,
  num_key_value_heads=64, n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0,
  kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=64, n_group=1,
  topk_group=1, num_experts_per_tok=4, hidden_act="silu", tie_word_embeddings=False,
  first_k_dense_replace=1,
)  # fmt: skip
# MiniMax-M2, from its configuration class's defaults as copied beside a third-party
# quantization of it (huggingface.co/ModelCloud/MiniMax-M2-GPTQMODEL-W4A16,
# configuration_minimax_m2.py), the same fields as a published config.json of MiniMax-M2.1
# (huggingface.co/QuixiAI/MiniMax-M2.1-bf16) and as far as it shows, the official repository's
# (MiniMaxAI/MiniMax-M2, commit 35c5c79: head_dim 128, vocab 200064, routing bias, untied
# embeddings); its parameters are its published total, 230B. Planned in bf16.
_MINIMAX_M2 = dict(
  model_type="minimax_m2", vocab_size=200064, hidden_size=3072, intermediate_size=1536,
  num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
  num_local_experts=256, num_experts_per_tok=8, hidden_act="silu", tie_word_embeddings=False,
)  # fmt: skip
# Qwen3.5-397B-A17B's text model, from NVIDIA/Megatron-LM's examples/mimo/configs/qwen35_vlm.py
# ("All values match the HuggingFace text_config for Qwen3.5-397B-A17B"), its vocabulary
# Qwen3.5's (THUDM/slime, scripts/models/qwen3.5-27B.sh). In bf16, as released.
_QWEN3_5_397B = dict(
  model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=4096, num_hidden_layers=60,
  num_attention_heads=32, num_key_value_heads=2, head_dim=256, num_experts=512,
  num_experts_per_tok=10, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
  hidden_act="silu", tie_word_embeddings=False,
)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
  "deepseek-v3": _DEEPSEEK_V3,
  "kimi-k2": _KIMI_K2,
  "kimi-k2-thinking": {  # the same model, its routed experts INT4 in groups of 32
    **_KIMI_K2,
    "quantization_config": dict(
      quant_method="compressed-tensors", format="pack-quantized",
      config_groups=dict(group_0=dict(
        targets=["Linear"], input_activations=None,
        weights=dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32,
                     actorder=None, dynamic=False))),
      ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"],
    ),
  },
  "qwen3-235b-a22b": dict(
    **_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
    num_hidden_layers=94, num_attention_heads=64,
  ),
  "qwen3-30b-a3b": dict(
    **_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32,
  ),
  "gpt-oss-120b": dict(
    model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=128,
    num_experts_per_tok=4, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, vocab_size=201088, swiglu_limit=7.0, tie_word_embeddings=False,
    quantization_config=dict(quant_method="mxfp4"),
    # Attention alternates a 128-token window and the full context, the window first.
    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 18,
  ),
  "deepseek-v4-flash-base": _DEEPSEEK_V4_FLASH_BASE,
  "glm-5": _GLM_5,
  "mistral-large-4": _MISTRAL_LARGE_4,
  "minimax-m2": _MINIMAX_M2,
  "qwen3.5-397b-a17b": _QWEN3_5_397B,
  "mixtral-8x22b": dict(
    model_type="mixtral", hidden_size=6144, intermediate_size=16384, num_local_experts=8,
    num_experts_per_tok=2, num_hidden_layers=56, num_attention_heads=48, num_key_value_heads=8,
    vocab_size=32000, tie_word_embeddings=False, hidden_act="silu",
  ),
}  # fmt: skip

# The network per GPU across nodes, bytes per second (400 Gb/s): the GPUs' own rates are
# `kernels_pallas.gpus.Gpu`'s.
NETWORK = 50e9


@dataclasses.dataclass(frozen=True)
class StepEstimate:
  """An estimated time of one step, per MoE layer and for the stack (seconds), with every
  assumption it makes; `rate_source` says where the expert path's rate came from (a tuning
  file's entry for the GPU kind, else the recorded H200 run)."""

  rate_source: str
  compute_s: float
  memory_s: float
  exchange_s: float
  layer_s: float
  stack_s: float
  assumptions: tuple[str, ...]
  exchange_s_by_scheme: dict[str, float]
  tokens_per_s_per_gpu: float


@dataclasses.dataclass(frozen=True)
class FitReport:
  """What `fit` found: per-device bytes (`per_device_bytes`: expert_weights,
  other_moe_weights, adapters, rest_of_model (its weights), gradients, optimizer_state,
  arguments, temp, outputs_not_aliased, kv_cache, total; the first six parts of the
  compiler's figures, gradients within temp, the rest arguments; total = arguments + temp +
  outputs_not_aliased + kv_cache), the GPU's memory, whether it fits and with
  what headroom, the mesh, chunk and expert path the program used (its `moejax.plan_call`),
  the step estimate, the KV cache's `context_tokens` (0 for a job that trains), `warnings`:
  settings that changed nothing (e.g. `expert_fsdp` with no data axis to split over), and
  the job's fp8 recipe and exchange (`compute_quant`, `dispatch_quant`: `MoEConfig`'s)."""

  model: str
  gpu: str
  nodes: int
  gpus_per_node: int
  job: str
  expert_quant: str | None
  mesh: dict[str, int]
  expert_fsdp: bool
  dispatch: str
  remat: str
  chunk_size: int
  expert_path: str
  tokens_per_device: int
  moe_layers: int
  per_device_bytes: dict[str, int]
  gpu_memory_bytes: int
  fits: bool
  headroom_bytes: int
  rest_of_model_parameters: int
  estimate: StepEstimate
  notes: tuple[str, ...]
  shared_fsdp: bool = False
  context_tokens: int = 0
  warnings: tuple[str, ...] = ()
  compute_quant: str | None = None
  dispatch_quant: str | None = None

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def fit(
  model: str | Path | dict[str, Any],
  gpu: str = "h200",
  *,
  nodes: int = 1,
  gpus_per_node: int = 8,
  job: str = "infer",
  expert_quant: str | None = "released",
  lora_rank: int = 16,
  compute_quant: str | None = None,
  dispatch_quant: str | None = None,
  expert_backend: str = "auto",
  tokens_per_device: int = 4096,
  expert_parallel: int | None = None,
  expert_fsdp: bool = False,
  shared_fsdp: bool = False,
  dispatch: str = "auto",
  receive_capacity_factor: float | None = None,
  chunk_size: int | str = "auto",
  remat: str = "none",
  context_tokens: int | None = None,
  progress: bool = False,
) -> FitReport:
  """Compiles the model's MoE stack for `nodes` x `gpus_per_node` GPUs of `gpu` and reports
  whether the job fits, per device.

  Args:
    model: a name in `PRESETS`, config.json as a dict, or a checkpoint folder / config.json
      path (any family `moejax.hf` reads).
    gpu: a name in `moejax.targets.GPUS`.
    nodes, gpus_per_node: the GPUs (one process per node).
    job: "infer" (the forward), "lora" (adapters of `lora_rank` on the experts, trained with
      Adam; the experts frozen) or "train" (Adam over every float MoE parameter).
    expert_quant: "released" (the checkpoint's format), None (bf16) or a format of
      `kernels_pallas.formats.FORMATS`.
    compute_quant, dispatch_quant: `MoEConfig`'s: the expert matmuls' operands quantized to
      fp8 on the fly (a recipe of `moejax.compute_quant`), the dispatched rows sent as fp8.
      The program compiled is the one moejax runs: the recipe emulated on the XLA tile loop
      (float32 products of the dequantized operands; the backward keeps the bf16 rows, as
      without it, and quantizes again), so its memory is the compiled figures.
    expert_backend: `MoEConfig`'s: "auto" (what a GPU takes without a tuning entry: XLA),
      "xla", "pallas" (the grouped-matmul kernels) or "fused" (`kernels_pallas.fused_moe`,
      its Triton kernels compiled for the target).
    tokens_per_device: tokens each device holds per step.
    expert_parallel: devices of the expert axis (default: the most that divide both the
      devices and the experts); the rest form the data axis.
    expert_fsdp, shared_fsdp, dispatch, receive_capacity_factor, chunk_size: as
      `MoEConfig`'s.
    remat: each layer rematerialized in the backward pass: "none", "full" (recompute
      everything) or "names" (keep `moejax.CHECKPOINT_NAMES`), as `moejax.remat.REMAT_POLICIES`.
    context_tokens: for "infer", the tokens of context each device's KV cache holds (its
      sequences' together; `kv_cache_bytes`); None: `tokens_per_device`. Training jobs hold
      no cache.
    progress: show a progress bar while building and compiling.

  Raises:
    ValueError: an unknown preset, GPU or job, a mesh that does not divide, a job the
      config cannot run (training quantized experts, a recipe over quantized experts or
      widths not a multiple of its group).
    RuntimeError: JAX's CUDA plugin is missing (`moejax.targets`).
  """
  name, config_json = model_json(model)
  if gpu not in GPUS:
    raise ValueError(f"gpu={gpu!r}; expected one of {sorted(GPUS)}")
  if job not in JOBS:
    raise ValueError(f"job={job!r}; expected one of {JOBS}")
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat={remat!r}; expected one of {tuple(REMAT_POLICIES)}")
  devices = nodes * gpus_per_node
  config = _config(
    config_json,
    job,
    expert_quant,
    lora_rank,
    dispatch=dispatch,
    receive_capacity_factor=receive_capacity_factor,
    chunk_size=chunk_size,
    expert_fsdp=expert_fsdp,
    shared_fsdp=shared_fsdp,
    compute_quant=compute_quant,
    dispatch_quant=dispatch_quant,
    expert_backend=expert_backend,
  )
  ep = _expert_parallel(expert_parallel, devices, config.num_experts)
  mesh_shape = {"data": devices // ep, "expert": ep}
  layers = len(hf.moe_layers(config_json))
  from tqdm import tqdm  # imported here: only a progress bar needs it

  with tqdm(total=3, desc=f"fit {name}", disable=not progress) as bar:
    mesh = targets.target_mesh(
      gpu, tuple(mesh_shape.values()), nodes=nodes, gpus_per_node=gpus_per_node
    )
    bar.update()
    program, arguments, parts = _program(
      config, config_json, mesh, job, tokens_per_device, REMAT_POLICIES[remat]
    )
    lowered = jax.jit(program, donate_argnums=_donated(job)).lower(*arguments)
    bar.update()
    memory = lowered.compile().memory_analysis()
    bar.update()
  if job != "infer":
    context_tokens = 0
  elif context_tokens is None:
    context_tokens = tokens_per_device
  kv_cache = kv_cache_bytes(config_json, context_tokens)
  compiled = memory.argument_size_in_bytes + memory.temp_size_in_bytes
  compiled += memory.output_size_in_bytes - memory.alias_size_in_bytes
  per_device = {
    **parts,
    "arguments": int(memory.argument_size_in_bytes),
    "temp": int(memory.temp_size_in_bytes),
    "outputs_not_aliased": int(memory.output_size_in_bytes - memory.alias_size_in_bytes),
    "kv_cache": int(kv_cache),
    "total": int(compiled + kv_cache),
  }
  target = GPUS[gpu]
  # What the compiled program's layer decided: its chunk, exchange and expert path.
  call = plan_call(config, (tokens_per_device * devices, config.hidden_size), mesh=mesh)
  estimate = estimate_step(
    config, target, job, mesh_shape, nodes, gpus_per_node, tokens_per_device, call, layers
  )
  return FitReport(
    model=name,
    gpu=gpu,
    nodes=nodes,
    gpus_per_node=gpus_per_node,
    job=job,
    expert_quant=config.expert_quant,
    mesh=mesh_shape,
    expert_fsdp=expert_fsdp,
    dispatch=dispatch,
    remat=remat,
    chunk_size=call.layout.chunk,
    expert_path=call.expert.path,
    tokens_per_device=tokens_per_device,
    moe_layers=layers,
    per_device_bytes=per_device,
    gpu_memory_bytes=target.memory_bytes,
    fits=per_device["total"] <= target.memory_bytes,
    headroom_bytes=target.memory_bytes - per_device["total"],
    rest_of_model_parameters=rest_of_model_parameters(config_json),
    estimate=estimate,
    shared_fsdp=shared_fsdp,
    context_tokens=context_tokens,
    compute_quant=compute_quant,
    dispatch_quant=dispatch_quant,
    warnings=_ineffective_settings(expert_fsdp, shared_fsdp, mesh_shape),
    notes=(
      *_whole_weights_note(config_json, devices),
      "the model compiled for the target by XLA (memory_analysis): its MoE layers moejax's, "
      "the rest (attention, dense FFN layers, norms, embeddings, output projection) a "
      "stand-in at its config.json's shapes (moejax.apps.fit_model: weights split over every "
      "device and gathered per use, cuDNN flash attention over each device's tokens as one "
      "sequence, rotary embeddings and biases left out), each kind of layer scanned; the loss "
      "is the cross-entropy of every token's logits (infer: each device's last token's); "
      "total = arguments + temp + outputs_not_aliased + kv_cache (weights, adapters and "
      "optimizer state are parts of the arguments, gradients of temp)",
      f"KV cache: {context_tokens} tokens of context per device in bf16, every layer "
      "(kv_cache_bytes; a job that trains holds none)",
    ),
  )


def _whole_weights_note(config_json: dict[str, Any], devices: int) -> tuple[str, ...]:
  """A note naming the rest of the model's weights that the device count divides none of the
  dimensions of (each device holds them whole), if any."""
  rest = fit_model.shapes(config_json)
  shapes = {**fit_model.layer_weights(rest, dense=True), **fit_model.model_weights(rest)}
  whole = sorted(n for n, shape in shapes.items() if fit_model.split_dim(shape, devices) is None)
  if not whole:
    return ()
  return (
    f"rest of the model: no dimension of {', '.join(whole)} divides {devices} devices: "
    "each device holds them whole",
  )


def _ineffective_settings(
  expert_fsdp: bool, shared_fsdp: bool, mesh_shape: dict[str, int]
) -> tuple[str, ...]:
  """What a setting asked for that the plan cannot do, in words."""
  warnings = []
  if expert_fsdp and mesh_shape["data"] == 1:
    warnings.append(
      f"expert_fsdp does nothing here: the expert axis takes all {mesh_shape['expert']} "
      "devices, so the data axis has 1 device to split the expert weights over (choose a "
      "smaller expert_parallel)"
    )
  if shared_fsdp and mesh_shape["data"] * mesh_shape["expert"] == 1:
    warnings.append("shared_fsdp does nothing here: one device holds the whole mesh")
  return tuple(warnings)


def model_json(model: str | Path | dict[str, Any]) -> tuple[str, dict[str, Any]]:
  """(its name, config.json) of a preset, a checkpoint folder or config.json, or a dict."""
  if isinstance(model, dict):
    return str(model.get("model_type")), model
  if model in PRESETS:
    return model, PRESETS[model]
  if isinstance(model, str | Path) and Path(model).exists():
    return str(model), hf.config_json(model)
  raise ValueError(
    f"model={model!r} is neither a preset ({sorted(PRESETS)}) nor an existing checkpoint "
    "folder or config.json"
  )


def _config(config_json, job, expert_quant, lora_rank, compute_quant=None, **settings):
  """The MoEConfig of the job: bf16, the experts in the chosen format, `settings` (dispatch,
  receive_capacity_factor, chunk_size, expert_fsdp, shared_fsdp, dispatch_quant,
  expert_backend) as given,
  then `compute_quant`. A family whose layers differ only in their activations' clamps
  (Step-3.7) is planned with its first MoE layer's config: the clamps change no shape. Blocks
  with parts (ERNIE-4.5-VL) and layers without a router of their own (ZAYA) are refused,
  named."""
  family = hf.family_of(config_json.get("model_type"))
  if family.parts:
    raise NotImplementedError(
      f"{config_json.get('model_type')}: fit plans one MoE layer per block; these blocks hold "
      f"one per token type ({sorted(family.parts)})"
    )
  if family.router is None:
    raise NotImplementedError(
      f"{config_json.get('model_type')}: its MoE layers take their router's logits from the "
      "model (an MLP carrying state from layer to layer), which fit's stand-in for the rest "
      "of the model does not hold"
    )
  layers = hf.moe_layers(config_json)
  config = hf.config_from_hf(
    config_json,
    layer=layers[0] if family.layer_options and layers else None,
    dtype=jnp.bfloat16,
    param_dtype=jnp.bfloat16,
    lora_rank=lora_rank if job == "lora" else 0,
    **settings,
  )
  if expert_quant != "released":
    if expert_quant is not None and expert_quant not in FORMATS:
      raise ValueError(
        f"expert_quant={expert_quant!r}; expected 'released', None or one of {sorted(FORMATS)}"
      )
    config = dataclasses.replace(config, expert_quant=expert_quant)
  if job == "train" and config.expert_quant is not None:
    raise ValueError(
      f"job='train' trains every expert weight: quantized experts ({config.expert_quant!r}) "
      "are frozen; train in bf16 (expert_quant=None) or tune adapters (job='lora')"
    )
  # after the experts' format: a recipe quantizes float experts (MoEConfig says so)
  return dataclasses.replace(config, compute_quant=compute_quant)


def _expert_parallel(chosen: int | None, devices: int, experts: int) -> int:
  if chosen is None:
    return math.gcd(devices, experts)
  if chosen < 1 or devices % chosen or experts % chosen:
    raise ValueError(
      f"expert_parallel={chosen} must divide both the devices ({devices}) and the experts "
      f"({experts})"
    )
  return chosen


def _stacked(config: MoEConfig, mesh, layers: int) -> MoEParams:
  """`layers` layers' abstract parameters, the layer axis on no mesh axis, the rest as the
  layer's."""
  place = lambda leaf: jax.ShapeDtypeStruct(
    (layers, *leaf.shape), leaf.dtype, sharding=stacked_sharding(leaf.sharding)
  )
  return jax.tree.map(place, abstract_params(config, mesh))


def _bytes_per_device(tree) -> int:
  """Bytes of a tree of sharded shapes on one device; 4-bit values packed two to a byte, as
  XLA stores them."""
  shard = lambda leaf: np.prod(leaf.sharding.shard_shape(leaf.shape))
  bits = sum(shard(leaf) * jax.dtypes.itemsize_bits(leaf.dtype) for leaf in jax.tree.leaves(tree))
  return int(bits) // 8


def _program(
  config: MoEConfig,
  config_json: dict[str, Any],
  mesh,
  job: str,
  tokens_per_device: int,
  policy,
):
  """(the job's function, its abstract arguments, the per-device bytes of its parts): the whole
  model, its MoE layers moejax's and the rest `fit_model`'s stand-in."""
  rest = fit_model.shapes(config_json)
  stack = _stacked(config, mesh, rest.moe_layers)
  weights = fit_model.abstract_weights(rest, mesh)
  axes = tuple(mesh.axis_names)
  ids = jax.ShapeDtypeStruct(
    (mesh.devices.size * tokens_per_device,), jnp.int32, sharding=NamedSharding(mesh, P(axes))
  )
  field = lambda names: {n: getattr(stack, n) for n in names if getattr(stack, n) is not None}
  other = [n for n in MoEParams._fields if n not in EXPERT_PARAMS + ADAPTER_PARAMS]
  parts = {
    "expert_weights": _bytes_per_device(field(EXPERT_PARAMS)),
    "other_moe_weights": _bytes_per_device(field(other)),
    "adapters": _bytes_per_device(field(ADAPTER_PARAMS)),
    "rest_of_model": _bytes_per_device(weights),
    "gradients": 0,
    "optimizer_state": 0,
  }
  moe_ffn = lambda params, x: moe_apply(params, x, config=config, mesh=mesh)[0]
  dense_layer, moe_layer = fit_model.decoder_layers(rest, mesh, moe_ffn, policy)

  def losses(weights, stack: MoEParams, ids: jax.Array) -> jax.Array:
    x = fit_model.embed(rest, mesh, weights["model"], ids)
    if weights["dense"] is not None:
      x = jax.lax.scan(dense_layer, x, (weights["dense"], None))[0]
    x = jax.lax.scan(moe_layer, x, (weights["moe"], stack))[0]
    return fit_model.token_loss(rest, mesh, weights["model"], x, ids, last_only=job == "infer")

  if job == "infer":
    return losses, (weights, stack, ids), parts
  trains = lambda name: (name in ADAPTER_PARAMS) == (job == "lora")
  moe_trained = stack._replace(**{n: None for n in MoEParams._fields if not trains(n)})
  moe_frozen = stack._replace(**{n: None for n in MoEParams._fields if trains(n)})
  trained = {"moe": moe_trained, "rest": weights if job == "train" else None}
  frozen = {"moe": moe_frozen, "rest": None if job == "train" else weights}
  optimizer = optax.adam(1e-4, mu_dtype=jnp.float32)
  state = _like_params(jax.eval_shape(optimizer.init, trained), trained)
  parts["gradients"] = _bytes_per_device(trained)  # within temp, while the update runs
  parts["optimizer_state"] = _bytes_per_device(state)

  def loss(trained, frozen, ids: jax.Array) -> jax.Array:
    pick = lambda t, f: t if t is not None else f
    moe = MoEParams(*map(pick, trained["moe"], frozen["moe"]))
    return jnp.mean(losses(pick(trained["rest"], frozen["rest"]), moe, ids))

  def step(trained, state, frozen, ids):
    grads = jax.grad(loss)(trained, frozen, ids)
    updates, state = optimizer.update(grads, state, trained)
    return optax.apply_updates(trained, updates), state

  return step, (trained, state, frozen, ids), parts


def _like_params(state, trained):
  """Adam's state laid out as the parameters it tracks (each moment a tree like `trained`; its
  step count replicated)."""
  params = jax.tree.structure(trained)
  like = lambda moment: jax.tree.map(
    lambda m, p: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=p.sharding), moment, trained
  )
  replicated = NamedSharding(jax.tree.leaves(trained)[0].sharding.mesh, P())
  place = lambda sub: (
    like(sub)
    if jax.tree.structure(sub) == params
    else jax.ShapeDtypeStruct(sub.shape, sub.dtype, sharding=replicated)
  )
  return jax.tree.map(place, state, is_leaf=lambda sub: jax.tree.structure(sub) == params)


def _donated(job: str) -> tuple[int, ...]:
  """Arguments the step overwrites (parameters and optimizer state): their buffers reused."""
  return () if job == "infer" else (0, 1)


def rest_of_model_parameters(config_json: dict[str, Any]) -> int:
  """Parameters of the model outside its MoE layers' FFNs, from config.json: embeddings (and an
  untied output projection), each layer's attention (multi-head latent attention where
  `kv_lora_rank` is set, else grouped-query: q, k, v, o) and two norms, each dense layer's
  gated FFN (3 D x intermediate_size), the final norm: the stand-in `fit` compiles
  (`moejax.apps.fit_model`). Biases and the latent norms are not counted."""
  return fit_model.parameter_count(fit_model.shapes(config_json))


def kv_cache_bytes(config_json: dict[str, Any], context_tokens: int) -> int:
  """Bytes of an inference KV cache holding `context_tokens` tokens, in bf16, over every layer
  of the model: per token and layer, multi-head latent attention's compressed latent and
  rope key (`kv_lora_rank + qk_rope_head_dim` values, as vLLM and SGLang cache it), else a key
  and a value per KV head (`2 * num_key_value_heads * head_dim`). A layer of `layer_types`
  "sliding_attention" (or every layer, with `sliding_window` set and `layer_types` absent)
  holds at most `sliding_window` tokens.

  >>> kv_cache_bytes(PRESETS["deepseek-v3"], 4096) == 61 * 4096 * (512 + 64) * 2
  True
  """
  config_json = hf.config_json(config_json)
  read = lambda key, default=None: config_json.get(key, default)
  if read("kv_lora_rank"):
    per_token = read("kv_lora_rank") + read("qk_rope_head_dim")
  else:
    heads = read("num_attention_heads")
    head_dim = read("head_dim") or read("hidden_size") // heads
    per_token = 2 * read("num_key_value_heads", heads) * head_dim
  layers = hf.family_of(read("model_type")).layers(config_json)
  window = read("sliding_window") if read("use_sliding_window", True) else None
  kinds = read("layer_types") or ["sliding_attention" if window else "full_attention"] * layers
  held = [
    min(context_tokens, window) if k == "sliding_attention" else context_tokens for k in kinds
  ]
  return sum(held) * per_token * 2


# The XLA expert paths' forward in the recorded H200 run (docs/performance.md, "GPU"): 8192
# tokens, K=2, D=2048, F=1024, bf16, one device: milliseconds by (path, local experts).
RECORDED_H200_MS = {("ragged_dot", 8): 2.95, ("tile loop", 8): 6.41, ("tile loop", 32): 7.22}
_RECORDED_FLOPS = 2 * 8192 * 2 * 3 * 2048 * 1024


def _efficiency(call: CallPlan, config: MoEConfig, gpu: Gpu) -> tuple[str, float]:
  """(the rate's source, the fraction of the GPU's bf16 peak it is) for the expert path the
  call plan took: the forward a tuning file measured for the call on this GPU kind (its
  winner's, at its rows: each device's local (row, choice) assignments, 6·D·F FLOPs each),
  else the recorded H200 run's: ragged_dot's forward at 8 local experts (its best: the rate
  falls as they grow), else the tile loop's at 32. The Pallas kernels (the fused path's too)
  have no recorded layer rate: without a tuning entry they are estimated at the tile loop's,
  and the report says so."""
  tuned = call.tuned
  if tuned is not None and tuned.candidate.forward_ms:
    devices = config.num_physical_experts // tuned.entry.case["local_experts"]
    flops = 6 * tuned.entry.rows / devices * config.expert_width * config.intermediate_size
    rate = flops / (tuned.candidate.forward_ms * 1e-3)
    source = f"{tuned.candidate.name}'s forward at {tuned.entry.rows} rows in {tuned.source}"
    return source, rate / gpu.peak_bf16_flops
  path = call.expert.path
  key = ("ragged_dot", 8) if path == "ragged_dot" else ("tile loop", 32)
  source = f"the XLA {key[0]} path"
  if path in ("pallas", "fused"):
    source = f"the tile loop (no {path} kernel rate)"
  recorded = _RECORDED_FLOPS / (RECORDED_H200_MS[key] * 1e-3) / GPUS["h200"].peak_bf16_flops
  return f"{source} in the recorded H200 run", recorded


def recorded_error() -> float:
  """The estimate's compute term on the recorded run's other shape: the tile loop's rate at
  8 local experts predicted from its 32-expert figure (the same FLOPs), relative error."""
  predicted, measured = RECORDED_H200_MS["tile loop", 32], RECORDED_H200_MS["tile loop", 8]
  return abs(predicted - measured) / measured


def estimate_step(
  config: MoEConfig,
  gpu: Gpu,
  job: str,
  mesh_shape: dict[str, int],
  nodes: int,
  gpus_per_node: int,
  tokens_per_device: int,
  call: CallPlan,
  layers: int,
) -> StepEstimate:
  """One step's time, per layer and for the stack, as compute + HBM + exchange (no overlap
  counted), for the chunk, scheme and expert path of the layer's `call` plan: an estimate,
  not a measurement."""
  d, f, k = config.hidden_size, config.intermediate_size, config.top_k
  w = config.expert_width  # what the routed experts and the exchange see: D, or a latent width
  ep = mesh_shape["expert"]
  chunk, scheme = call.layout.chunk, call.scheme
  source, efficiency = _efficiency(call, config, gpu)
  passes = {"infer": 1, "lora": 2, "train": 3}[job]  # forward; + input gradient; + weight gradient
  per_token = 2 * k * 3 * w * f + 2 * 3 * d * config.shared_intermediate_size
  flops = passes * tokens_per_device * per_token
  peak, peak_words = gpu.peak_bf16_flops, "bf16 peak"
  if runs_fp8_kernels(config, call.expert):
    peak_words = f"bf16 peak ({config.compute_quant} on the fp8 kernels: no fp8 rate measured)"
  elif config.compute_quant is not None:  # emulated: float32 products at full precision
    peak, peak_words = gpu.peak_f32_flops, f"float32 peak ({config.compute_quant}, emulated)"
  compute = flops / (peak * efficiency)
  weights = _expert_bytes_per_device(config, ep)
  chunks = -(-tokens_per_device // chunk)
  memory = passes * chunks * weights / gpu.memory_bandwidth
  across = max(0, ep - gpus_per_node) / max(ep - 1, 1) if nodes > 1 else 0.0
  bandwidth = 1 / ((1 - across) / gpu.nvlink_bandwidth + across / NETWORK)
  copies_by_scheme = {"all_gather": ep - 1, "all_to_all": min(k, ep)}
  row_bytes = w * jnp.dtype(config.dtype).itemsize
  legs = 2 * (2 if job != "infer" else 1)  # there and back; the backward's too
  sent = legs * row_bytes  # per token and copy; the fp8 exchange: the forward's rows in fp8
  if config.dispatch_quant is not None:
    sent += w * (1 + 4 / GROUP) - row_bytes  # e4m3 values, a float32 scale each 128
  exchange_by_scheme = {
    name: tokens_per_device * copies * sent / bandwidth for name, copies in copies_by_scheme.items()
  }
  copies, exchange = copies_by_scheme[scheme], exchange_by_scheme[scheme]
  other = next(name for name in copies_by_scheme if name != scheme)
  layer = compute + memory + exchange
  return StepEstimate(
    rate_source=source,
    compute_s=compute,
    memory_s=memory,
    exchange_s=exchange,
    layer_s=layer,
    stack_s=layer * layers,
    exchange_s_by_scheme=exchange_by_scheme,
    tokens_per_s_per_gpu=tokens_per_device / (layer * layers),
    assumptions=(
      f"compute: {passes} pass(es) of the routed and shared experts' matmuls at the "
      f"{gpu.name} {peak_words} ({peak / 1e12:.0f} TFLOP/s) times {efficiency:.3f}, "
      f"the fraction of its peak reached by {source} (routing balanced); the layer's "
      f"path: {call.expert.path} ({call.expert_reason})",
      f"HBM: each chunk ({chunks} of {chunk} tokens) reads the device's expert weights "
      f"({weights / 2**30:.2f} GiB) once per pass at {gpu.memory_bandwidth / 1e12:.1f} TB/s",
      f"exchange: {scheme} sends each token to {copies} other device(s) and back"
      f"{' (the forward rows in fp8 with their scales)' if config.dispatch_quant else ''}, at "
      f"{gpu.nvlink_bandwidth / 1e9:.0f} GB/s NVLink within a node and {NETWORK / 1e9:.0f} GB/s "
      f"across nodes ({other} would send each to {copies_by_scheme[other]}: "
      f"{exchange_by_scheme[other] * 1e3:.2f} ms per layer against {exchange * 1e3:.2f} ms)",
      "no overlap of the three; attention and the rest of the model not included (so "
      "tokens_per_s_per_gpu is the MoE stack's alone)",
      f"error on the recorded H200 run's shapes: {recorded_error():.0%} (the tile loop at 8 "
      "local experts predicted from its rate at 32); untested at these shapes",
    ),
  )


def _expert_bytes_per_device(config: MoEConfig, ep: int) -> int:
  stack = abstract_params(config)
  experts = [getattr(stack, n) for n in EXPERT_PARAMS if getattr(stack, n) is not None]
  bits = sum(leaf.size * jax.dtypes.itemsize_bits(leaf.dtype) for leaf in jax.tree.leaves(experts))
  return bits // 8 // ep
