"""Checkpoints written here in each family's real key names and layouts (float; DeepSeek's fp8,
GPT-OSS's MXFP4, Kimi's INT4 and NVIDIA's NVFP4 as released; raw safetensors for the dtypes
NumPy's writer lacks), and each family's MoE block in NumPy, from the checkpoint's own
tensors: what the `moejax.hf` tests load and compare against."""

import json

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from moejax.hf.nvfp4 import Nvfp4Names

D, F, FS, E, T = 16, 12, 10, 8, 24


# --- each family's MoE block in NumPy, from the checkpoint's own tensors ---------------------


def softmax(z):
  z = np.exp(z - z.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def silu(z):
  return z * sigmoid(z)


def linear_mlp(x, gate, up, down):
  """torch Linear weights: gate, up [F, D], down [D, F]."""
  return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def top(scores, k):
  return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def weighted_sum(ids, weights, expert_out):
  """sum_k weights[t, k] * expert_out(ids[t, k], x[t])."""
  return np.stack(
    [sum(w * expert_out(e, t) for e, w in zip(ids[t], weights[t], strict=True)) for t in range(T)]
  )


def per_expert_block(x, get, names, ids, weights):
  gate, up, down = names
  mlp = lambda e, t: linear_mlp(
    x[t], get(f"experts.{e}.{gate}.weight"), get(f"experts.{e}.{up}.weight"),
    get(f"experts.{e}.{down}.weight"),
  )  # fmt: skip
  return weighted_sum(ids, weights, mlp)


def shared_block(x, get, prefix):
  return linear_mlp(
    x, get(f"{prefix}.gate_proj.weight"), get(f"{prefix}.up_proj.weight"),
    get(f"{prefix}.down_proj.weight"),
  )  # fmt: skip


def mixtral_block(x, get, hf_config):
  p = softmax(x @ get("gate.weight").T)
  ids = top(p, hf_config["num_experts_per_tok"])
  w = np.take_along_axis(p, ids, -1)
  return per_expert_block(x, get, ("w1", "w3", "w2"), ids, w / w.sum(-1, keepdims=True))


def softmax_block(x, get, k, router, names, renormalize, shared=None):
  """Softmax top-k routing of linear experts (Jamba, HunYuan; Mixtral's renormalized form)."""
  p = softmax(x @ get(router).T)
  ids = top(p, k)
  w = np.take_along_axis(p, ids, -1)
  w = w / w.sum(-1, keepdims=True) if renormalize else w
  y = per_expert_block(x, get, names, ids, w)
  return y if shared is None else y + shared_block(x, get, shared)


def biased_block(x, get, hf_config, k, score, bias, names, shared=None):
  """Selection by score + bias, weights the unbiased scores, renormalized (ERNIE, LFM2)."""
  s = score(x @ get("gate.weight").T)
  ids = top(s + get(bias).reshape(1, -1), k)
  w = np.take_along_axis(s, ids, -1)
  w = w / w.sum(-1, keepdims=True) * hf_config.get("routed_scaling_factor", 1.0)
  y = per_expert_block(x, get, names, ids, w)
  return y if shared is None else y + shared_block(x, get, shared)


def granite_block(x, get, hf_config):
  logits = x @ get("router.layer.weight").T
  ids = top(logits, hf_config["num_experts_per_tok"])
  w = softmax(np.take_along_axis(logits, ids, -1))
  gate_up, down = get("input_linear.weight"), get("output_linear.weight")  # [E, 2F, D], [E, D, F]

  def expert(e, t):
    h = gate_up[e] @ x[t]
    return down[e] @ (silu(h[:F]) * h[F:])

  return weighted_sum(ids, w, expert)


def dbrx_block(x, get, hf_config):
  p = softmax(x @ get("router.layer.weight").T)
  ids = top(p, hf_config["ffn_config"]["moe_top_k"])
  w = np.take_along_axis(p, ids, -1)
  w1, v1, w2 = (get(f"experts.mlp.{n}").reshape(E, F, D) for n in ("w1", "v1", "w2"))
  expert = lambda e, t: (silu(w1[e] @ x[t]) * (v1[e] @ x[t])) @ w2[e]
  return weighted_sum(ids, w / w.sum(-1, keepdims=True), expert)


def phimoe_block(x, get, hf_config):
  logits, eps = x @ get("gate.weight").T, hf_config["router_jitter_noise"]
  ids, weights = np.zeros((T, 2), int), np.zeros((T, 2))
  for t in range(T):
    s, candidates = logits[t], logits[t].copy()
    for k in range(2):
      best = int(np.argmax(candidates))
      factor = np.maximum(np.abs(s), candidates[best])
      keep = ((candidates[best] - s) / factor <= 2 * eps) & np.isfinite(candidates)
      gates = softmax(np.where(keep, candidates, -np.inf))
      ids[t, k], weights[t, k] = best, gates[best]
      candidates[best] = -np.inf
  return per_expert_block(x, get, ("w1", "w3", "w2"), ids, weights)


def qwen_block(x, get, hf_config):
  p = softmax(x @ get("gate.weight").T)
  ids = top(p, hf_config["num_experts_per_tok"])
  w = np.take_along_axis(p, ids, -1)
  if hf_config.get("norm_topk_prob"):
    w = w / w.sum(-1, keepdims=True)
  y = per_expert_block(x, get, QWEN_NAMES, ids, w)
  if "shared_expert_intermediate_size" in hf_config:
    gate = sigmoid(x @ get("shared_expert_gate.weight").T)
    y = y + gate * shared_block(x, get, "shared_expert")
  return y


def deepseek_block(x, get, hf_config, biased):
  logits = x @ get("gate.weight").T
  scores = sigmoid(logits) if biased else softmax(logits)
  choice = scores + get("gate.e_score_correction_bias") if biased else scores.copy()
  groups, kept = hf_config["n_group"], hf_config["topk_group"]
  grouped = choice.reshape(T, groups, -1)
  group_score = np.sort(grouped, -1)[..., -2:].sum(-1) if biased else grouped.max(-1)
  dropped = np.argsort(-group_score, -1, kind="stable")[:, kept:]
  for t in range(T):
    grouped[t, dropped[t]] = -np.inf
  ids = top(grouped.reshape(T, -1), hf_config["num_experts_per_tok"])
  w = np.take_along_axis(scores, ids, -1)
  if hf_config.get("norm_topk_prob"):
    w = w / w.sum(-1, keepdims=True)
  w = w * hf_config.get("routed_scaling_factor", 1.0)
  y = per_expert_block(x, get, QWEN_NAMES, ids, w)
  return y + shared_block(x, get, "shared_experts")


def gpt_oss_block(x, get, hf_config):
  logits = x @ get("router.weight").T + get("router.bias")
  ids = top(logits, hf_config["num_experts_per_tok"])
  w = softmax(np.take_along_axis(logits, ids, -1))
  limit = hf_config["swiglu_limit"]
  gate_up, gate_up_bias = get("experts.gate_up_proj"), get("experts.gate_up_proj_bias")
  down, down_bias = get("experts.down_proj"), get("experts.down_proj_bias")

  def expert(e, t):
    h = x[t] @ gate_up[e] + gate_up_bias[e]
    g, u = np.minimum(h[::2], limit), np.clip(h[1::2], -limit, limit)
    return ((u + 1) * g * sigmoid(1.702 * g)) @ down[e] + down_bias[e]

  return weighted_sum(ids, w, expert)


def llama4_block(x, get, hf_config):
  logits = x @ get("router.weight").T
  ids = top(logits, 1)
  w = sigmoid(np.take_along_axis(logits, ids, -1))
  gate_up, down = get("experts.gate_up_proj"), get("experts.down_proj")

  def expert(e, t):
    h = (w[t, 0] * x[t]) @ gate_up[e]
    return (silu(h[:F]) * h[F:]) @ down[e]

  routed = weighted_sum(ids, np.ones_like(w), expert)
  return routed + shared_block(x, get, "shared_expert")


def longcat_block(x, get, hf_config):
  scores = softmax(x @ get("router.classifier.weight").T)
  ids = top(scores + get("router.e_score_correction_bias"), hf_config["moe_topk"])
  w = np.take_along_axis(scores, ids, -1) * hf_config["routed_scaling_factor"]
  names = ("gate_proj", "up_proj", "down_proj")
  mlp = lambda e, t: (
    x[t] if e >= E else linear_mlp(x[t], *(get(f"experts.{e}.{name}.weight") for name in names))
  )
  return weighted_sum(ids, w, mlp)


# --- tiny checkpoints in each family's layout ------------------------------------------------


def linear_experts(rng, names, count=E):
  gate, up, down = names
  out = {}
  for e in range(count):
    out[f"experts.{e}.{gate}.weight"] = rng.standard_normal((F, D))
    out[f"experts.{e}.{up}.weight"] = rng.standard_normal((F, D))
    out[f"experts.{e}.{down}.weight"] = rng.standard_normal((D, F))
  return out


def shared_linear(rng, prefix, width):
  return {
    f"{prefix}.gate_proj.weight": rng.standard_normal((width, D)),
    f"{prefix}.up_proj.weight": rng.standard_normal((width, D)),
    f"{prefix}.down_proj.weight": rng.standard_normal((D, width)),
  }


MIXTRAL = ("w1", "w3", "w2")
QWEN_NAMES = ("gate_proj", "up_proj", "down_proj")
QWEN = dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F)
DEEPSEEK = dict(
  n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=F, n_shared_experts=1,
  n_group=4, topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=True,
)  # fmt: skip
# model_type -> (config fields, block prefix, tensors(rng) in torch layout, NumPy block)
FAMILIES = {
  "mixtral": (
    dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=F),
    "block_sparse_moe",
    lambda rng: {"gate.weight": rng.standard_normal((E, D)), **linear_experts(rng, MIXTRAL)},
    mixtral_block,
  ),
  "phimoe": (
    dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=F, router_jitter_noise=0.1),
    "block_sparse_moe",
    lambda rng: {"gate.weight": rng.standard_normal((E, D)), **linear_experts(rng, MIXTRAL)},
    phimoe_block,
  ),
  "qwen2_moe": (
    dict(**QWEN, shared_expert_intermediate_size=FS),
    "mlp",
    lambda rng: {
      "gate.weight": rng.standard_normal((E, D)),
      **linear_experts(rng, QWEN_NAMES),
      **shared_linear(rng, "shared_expert", FS),
      "shared_expert_gate.weight": rng.standard_normal((1, D)),
    },
    qwen_block,
  ),
  "qwen3_moe": (
    dict(**QWEN, norm_topk_prob=True),
    "mlp",
    lambda rng: {
      "gate.weight": rng.standard_normal((E, D)),
      **linear_experts(rng, QWEN_NAMES),
    },
    qwen_block,
  ),
  "deepseek_v2": (
    dict(DEEPSEEK, topk_method="group_limited_greedy"),
    "mlp",
    lambda rng: {
      "gate.weight": rng.standard_normal((E, D)),
      **linear_experts(rng, QWEN_NAMES),
      **shared_linear(rng, "shared_experts", F),
    },
    lambda x, get, c: deepseek_block(x, get, c, biased=False),
  ),
  "deepseek_v3": (
    DEEPSEEK,
    "mlp",
    lambda rng: {
      "gate.weight": rng.standard_normal((E, D)),
      "gate.e_score_correction_bias": rng.standard_normal(E),
      **linear_experts(rng, QWEN_NAMES),
      **shared_linear(rng, "shared_experts", F),
    },
    lambda x, get, c: deepseek_block(x, get, c, biased=True),
  ),
  "gpt_oss": (
    dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=F, swiglu_limit=2.0),
    "mlp",
    lambda rng: {
      "router.weight": rng.standard_normal((E, D)),
      "router.bias": rng.standard_normal(E),
      "experts.gate_up_proj": rng.standard_normal((E, D, 2 * F)),
      "experts.gate_up_proj_bias": rng.standard_normal((E, 2 * F)),
      "experts.down_proj": rng.standard_normal((E, F, D)),
      "experts.down_proj_bias": rng.standard_normal((E, D)),
    },
    gpt_oss_block,
  ),
  "llama4_text": (
    dict(num_local_experts=E, num_experts_per_tok=1, intermediate_size=F),
    "feed_forward",
    lambda rng: {
      "router.weight": rng.standard_normal((E, D)),
      "experts.gate_up_proj": rng.standard_normal((E, D, 2 * F)),
      "experts.down_proj": rng.standard_normal((E, F, D)),
      **shared_linear(rng, "shared_expert", F),
    },
    llama4_block,
  ),
  "longcat_flash": (
    dict(n_routed_experts=E, zero_expert_num=3, moe_topk=3, expert_ffn_hidden_size=F,
         routed_scaling_factor=2.0),
    "mlp",
    lambda rng: {
      "router.classifier.weight": rng.standard_normal((E + 3, D)),
      "router.e_score_correction_bias": 0.1 * rng.standard_normal(E + 3),
      **linear_experts(rng, QWEN_NAMES),
    },
    longcat_block,
  ),
  "qwen3_next": (
    dict(**QWEN, shared_expert_intermediate_size=FS, norm_topk_prob=True),
    "mlp",
    lambda rng: {
      "gate.weight": rng.standard_normal((E, D)),
      **linear_experts(rng, QWEN_NAMES),
      **shared_linear(rng, "shared_expert", FS),
      "shared_expert_gate.weight": rng.standard_normal((1, D)),
    },
    qwen_block,
  ),
  "olmoe": (
    dict(num_experts=E, num_experts_per_tok=2, intermediate_size=F),
    "mlp",
    lambda rng: {"gate.weight": rng.standard_normal((E, D)), **linear_experts(rng, QWEN_NAMES)},
    qwen_block,
  ),
  "minimax": (
    dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=F),
    "block_sparse_moe",
    lambda rng: {"gate.weight": rng.standard_normal((E, D)), **linear_experts(rng, MIXTRAL)},
    mixtral_block,
  ),
  "granitemoe": (
    dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=F),
    "block_sparse_moe",
    lambda rng: {
      "router.layer.weight": rng.standard_normal((E, D)),
      "input_linear.weight": rng.standard_normal((E, 2 * F, D)),
      "output_linear.weight": rng.standard_normal((E, D, F)),
    },
    granite_block,
  ),
  "jamba": (
    dict(num_experts=E, num_experts_per_tok=2, intermediate_size=F),
    "feed_forward",
    lambda rng: {"router.weight": rng.standard_normal((E, D)), **linear_experts(rng, QWEN_NAMES)},
    lambda x, get, c: softmax_block(x, get, 2, "router.weight", QWEN_NAMES, renormalize=False),
  ),
  "ernie4_5_moe": (
    dict(moe_num_experts=E, moe_k=2, moe_intermediate_size=F, moe_num_shared_experts=1),
    "mlp",
    lambda rng: {
      "gate.weight": rng.standard_normal((E, D)),
      "moe_statics.e_score_correction_bias": 0.1 * rng.standard_normal((1, E)),
      **linear_experts(rng, QWEN_NAMES),
      **shared_linear(rng, "shared_experts", F),
    },
    lambda x, get, c: biased_block(
      x, get, c, 2, softmax, "moe_statics.e_score_correction_bias", QWEN_NAMES, "shared_experts"
    ),
  ),
  "hunyuan_v1_moe": (
    dict(num_experts=E, moe_topk=2, intermediate_size=F),
    "mlp",
    lambda rng: {
      "gate.wg.weight": rng.standard_normal((E, D)),
      **linear_experts(rng, QWEN_NAMES),
      **shared_linear(rng, "shared_mlp", F),
    },
    lambda x, get, c: softmax_block(
      x, get, 2, "gate.wg.weight", QWEN_NAMES, renormalize=True, shared="shared_mlp"
    ),
  ),
  "lfm2_moe": (
    dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F, routed_scaling_factor=1.5),
    "feed_forward",
    lambda rng: {
      "gate.weight": rng.standard_normal((E, D)),
      "expert_bias": 0.1 * rng.standard_normal(E),
      **linear_experts(rng, MIXTRAL),
    },
    lambda x, get, c: biased_block(x, get, c, 2, sigmoid, "expert_bias", MIXTRAL),
  ),
  "dbrx": (
    dict(ffn_config=dict(moe_num_experts=E, moe_top_k=2, ffn_hidden_size=F,
                         moe_normalize_expert_weights=1)),
    "transformer.blocks.{layer}.ffn",
    lambda rng: {
      "router.layer.weight": rng.standard_normal((E, D)),
      **{f"experts.mlp.{n}": rng.standard_normal((E * F, D)) for n in ("w1", "v1", "w2")},
    },
    dbrx_block,
  ),
}  # fmt: skip
FAMILIES["glm4_moe"] = FAMILIES["deepseek_v3"]  # the same layout and routing


# --- checkpoint writers --------------------------------------------------------------------


def write_checkpoint(path, model_type, layer, shards=1, seed=0):
  """config.json and safetensors (one file, or `shards` files plus the index) for one layer."""
  fields, prefix, make, _ = FAMILIES[model_type]
  rng = np.random.default_rng(seed)
  tensors = {name: (0.3 * v).astype(np.float32) for name, v in make(rng).items()}
  prefix = prefix if "{layer}" in prefix else f"model.layers.{{layer}}.{prefix}"
  stored = {f"{prefix.format(layer=layer)}.{name}": v for name, v in tensors.items()}
  stored["model.embed_tokens.weight"] = rng.standard_normal((32, D)).astype(np.float32)
  config = dict(model_type=model_type, hidden_size=D, hidden_act="silu", **fields)
  if model_type == "dbrx":  # DBRX names its sizes d_model and ffn_config
    config = dict(model_type=model_type, d_model=D, **fields)
  (path / "config.json").write_text(json.dumps(config))
  if shards == 1:
    save_file(stored, str(path / "model.safetensors"))
  else:
    names = sorted(stored)
    weight_map = {}
    for i in range(shards):
      file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
      part = names[i::shards]
      save_file({n: stored[n] for n in part}, str(path / file))
      weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return config, tensors.__getitem__


def save_raw(tensors: dict[str, np.ndarray], path, dtype: str | dict[str, str]) -> None:
  """A safetensors file written byte by byte, for dtypes NumPy's writer lacks ("BF16");
  `dtype` is every tensor's safetensors dtype, or each one's by name."""
  header, data, offset = {}, [], 0
  for name, value in tensors.items():
    raw = np.ascontiguousarray(value).tobytes()
    header[name] = {
      "dtype": dtype if isinstance(dtype, str) else dtype[name],
      "shape": list(value.shape),
      "data_offsets": [offset, offset + len(raw)],
    }
    data.append(raw)
    offset += len(raw)
  encoded = json.dumps(header).encode()
  path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + b"".join(data))


def save_raw_or_numpy(tensors: dict, path) -> None:
  """NumPy's writer for what it takes, the raw writer for the dtypes it lacks (bfloat16, the
  fp8s), one file."""
  header_dtypes = {
    np.dtype(np.float32): "F32",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint8): "U8",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
  }
  if all(v.dtype in (np.float32, np.int32, np.int64, np.uint8) for v in tensors.values()):
    save_file(tensors, str(path / "model.safetensors"))
    return
  by_dtype = {k: header_dtypes[v.dtype] for k, v in tensors.items()}
  save_raw(tensors, path / "model.safetensors", by_dtype)


LAYER = 2  # the decoder layer the quantized checkpoints hold
# Kimi-K2's MoE fields (DeepSeek-V3's names) at small sizes: D 64, E 8, F 32.
KIMI = dict(
  hidden_size=64, hidden_act="silu", n_routed_experts=8, num_experts_per_tok=2,
  moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
  routed_scaling_factor=2.5,
)  # fmt: skip
FP8_BLOCK = [4, 8]  # weight_block_size: [out, in]


def fp8_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """[out, in] float -> (float8_e4m3fn values, float32 scale_inv [ceil(out/4), ceil(in/8)]),
  as DeepSeek quantizes (edge blocks partial)."""
  bo, bi = FP8_BLOCK
  rows, cols = w.shape
  padded = np.zeros((-(-rows // bo) * bo, -(-cols // bi) * bi), np.float32)
  padded[:rows, :cols] = w
  blocks = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
  scale = np.abs(blocks).max(axis=(1, 3)) / np.float32(448)
  values = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
  return values.astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


def fp8_dequantize(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
  bo, bi = FP8_BLOCK
  full = np.repeat(np.repeat(scale, bo, 0), bi, 1)[: values.shape[0], : values.shape[1]]
  return values.astype(np.float64) * full


def write(path, config: dict, tensors: dict, prefix: str) -> None:
  stored = {f"model.layers.{LAYER}.{prefix}.{name}": v for name, v in tensors.items()}
  (path / "config.json").write_text(json.dumps(config))
  save_file(stored, str(path / "model.safetensors"))


def fuse_experts(stored: dict, experts: int) -> dict:
  """Per-expert fp8 linears as transformers' fused `FP8Experts` tensors: gate_up [E, 2F, D]
  (gate rows, then up rows) and down [E, D, F], each with its [E, out blocks, in blocks]
  scale_inv."""
  fused = {k: v for k, v in stored.items() if not k.startswith("experts.")}
  stack = lambda name, suffix: np.stack(
    [stored[f"experts.{i}.{name}.weight{suffix}"] for i in range(experts)]
  )
  for suffix in ("", "_scale_inv"):
    gate_up = [stack(name, suffix) for name in ("gate_proj", "up_proj")]
    fused[f"experts.gate_up_proj{suffix}"] = np.concatenate(gate_up, axis=1)
    fused[f"experts.down_proj{suffix}"] = stack("down_proj", suffix)
  return fused


def deepseek_fp8_checkpoint(path, seed: int, fused: bool = False):
  """DeepSeek-V3's layer with every expert and shared-expert linear in fp8 (the routed
  experts per expert, or `fused` as transformers saves them); returns the config.json
  dict, the stored tensors and the dequantized float tensors by name."""
  fields, _, make, _ = FAMILIES["deepseek_v3"]
  rng = np.random.default_rng(seed)
  floats = {name: 0.3 * v for name, v in make(rng).items()}
  stored, dequantized = {}, {}
  for name, w in floats.items():
    if "experts" in name:  # routed and shared experts' linear weights
      values, scale = fp8_quantize(w)
      stored[name], stored[f"{name}_scale_inv"] = values, scale
      dequantized[name] = fp8_dequantize(values, scale)
    else:
      stored[name] = w.astype(np.float32)
      dequantized[name] = w
  quantization = {"quant_method": "fp8", "weight_block_size": FP8_BLOCK}
  config = dict(
    model_type="deepseek_v3", hidden_size=16, hidden_act="silu", **fields,
    quantization_config=quantization,
  )  # fmt: skip
  if fused:
    stored = fuse_experts(stored, fields["n_routed_experts"])
  write(path, config, stored, "mlp")
  return config, stored, dequantized.__getitem__


# --- GPT-OSS's MXFP4 ------------------------------------------------------------------------

# An e2m1 code's value, by code (sign bit 8, 2 exponent bits of bias 1, 1 mantissa bit).
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
GPT_OSS_MXFP4 = dict(hidden_size=64, intermediate_size=32, num_local_experts=8)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """[E, rows, n, 16] uint8 + [E, rows, n] uint8 -> [E, 32 n, rows] float64, GPT-OSS's input-
  major float layout (low nibble first, scale 2^(s - 127))."""
  low, high = E2M1[blocks & 0x0F], E2M1[blocks >> 4]
  values = np.stack([low, high], -1).reshape(*blocks.shape[:-1], 32).astype(np.float64)
  values = values * 2.0 ** (scales.astype(np.float64) - 127)[..., None]
  return values.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1)


def gpt_oss_mxfp4_checkpoint(path, seed: int):
  """A GPT-OSS MoE layer as released: experts in MXFP4 (`_blocks`, `_scales`, gate and up
  interleaved), their biases and the router float; returns the config.json dict, the stored
  tensors and the float tensors they stand for (experts [E, in, out] float64)."""
  rng = np.random.default_rng(seed)
  d, f, e = (GPT_OSS_MXFP4[k] for k in ("hidden_size", "intermediate_size", "num_local_experts"))
  blocks = lambda rows, cols: rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
  scales = lambda rows, cols: rng.integers(122, 127, (e, rows, cols // 32), dtype=np.uint8)
  stored = {
    "router.weight": 0.3 * rng.standard_normal((e, d)).astype(np.float32),
    "router.bias": 0.3 * rng.standard_normal(e).astype(np.float32),
    "experts.gate_up_proj_blocks": blocks(2 * f, d),
    "experts.gate_up_proj_scales": scales(2 * f, d),
    "experts.gate_up_proj_bias": 0.3 * rng.standard_normal((e, 2 * f)).astype(np.float32),
    "experts.down_proj_blocks": blocks(d, f),
    "experts.down_proj_scales": scales(d, f),
    "experts.down_proj_bias": 0.3 * rng.standard_normal((e, d)).astype(np.float32),
  }
  floats = {name: v for name, v in stored.items() if "proj_b" not in name[-7:]}
  for name in ("gate_up_proj", "down_proj"):
    floats[f"experts.{name}"] = mxfp4_dequantize(
      stored[f"experts.{name}_blocks"], stored[f"experts.{name}_scales"]
    )
  config = dict(
    model_type="gpt_oss", hidden_act="silu", num_experts_per_tok=2, swiglu_limit=2.0,
    quantization_config={"quant_method": "mxfp4"}, **GPT_OSS_MXFP4,
  )  # fmt: skip
  write(path, config, stored, "mlp")
  return config, stored, floats


# --- Kimi-K2-Thinking's INT4 (compressed-tensors pack-quantized) ------------------------------

INT4_GROUP = 32
INT4_WEIGHTS = dict(
  num_bits=4, type="int", symmetric=True, strategy="group", group_size=INT4_GROUP,
  actorder=None, dynamic=False, observer="minmax",
)  # fmt: skip
# The linears of one DeepSeek-V3-style expert, [out, in] at KIMI's sizes.
KIMI_LINEARS = {
  "gate_proj": (KIMI["moe_intermediate_size"], KIMI["hidden_size"]),
  "up_proj": (KIMI["moe_intermediate_size"], KIMI["hidden_size"]),
  "down_proj": (KIMI["hidden_size"], KIMI["moe_intermediate_size"]),
}


def int4_quantization_config(**weights) -> dict:
  """Kimi-K2-Thinking's `quantization_config`, with `weights` fields changed."""
  group = dict(targets=["Linear"], weights={**INT4_WEIGHTS, **weights}, input_activations=None)
  return dict(
    quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
    config_groups=dict(group_0=group), ignore=["lm_head", "re:.*self_attn.*", "re:.*shared.*"],
  )  # fmt: skip


def pack_int4(values: np.ndarray) -> np.ndarray:
  """int values in [-8, 7] [..., n] -> int32 words [..., n / 8]: value i is nibble i of its
  row's bytes (low nibble first) plus 8, the words little-endian."""
  nibbles = (values.astype(np.int16) + 8).astype(np.uint8).reshape(*values.shape[:-1], -1, 2)
  data = (nibbles[..., 0] | (nibbles[..., 1] << 4)).astype(np.uint8)
  return np.ascontiguousarray(data).view("<i4").astype(np.int32)


def kimi_checkpoint(path, seed: int, nested: bool = False):
  """A Kimi-K2 (or, `nested`, K2.5) MoE layer: routed experts pack-quantized, shared experts
  and the router float (the `ignore` list); returns the config.json dict and the float
  tensors the stored ones stand for (NumPy float64 [out, in]: values times scales)."""
  rng = np.random.default_rng(seed)
  experts, dim = KIMI["n_routed_experts"], KIMI["hidden_size"]
  stored = {
    "gate.weight": 0.3 * rng.standard_normal((experts, dim)).astype(np.float32),
    "gate.e_score_correction_bias": 0.1 * rng.standard_normal(experts).astype(np.float32),
  }
  for name, shape in KIMI_LINEARS.items():
    stored[f"shared_experts.{name}.weight"] = (0.3 * rng.standard_normal(shape)).astype(np.float32)
  floats = dict(stored)
  for e in range(experts):
    for name, (rows, cols) in KIMI_LINEARS.items():
      values = rng.integers(-8, 8, (rows, cols))
      groups = (rows, cols // INT4_GROUP)
      scales = 2.0 ** rng.integers(-9, -5, groups) * rng.uniform(1, 2, groups)
      scales = scales.astype(ml_dtypes.bfloat16)
      key = f"experts.{e}.{name}.weight"
      stored[f"{key}_packed"] = pack_int4(values)
      stored[f"{key}_scale"] = scales
      stored[f"{key}_shape"] = np.array([rows, cols], np.int64)
      floats[key] = values * np.repeat(scales.astype(np.float64), INT4_GROUP, axis=1)
  quantization = int4_quantization_config()
  config = dict(model_type="kimi_k2", quantization_config=quantization, **KIMI)
  prefix = f"model.layers.{LAYER}.mlp"
  if nested:  # K2.5: the text model's fields in text_config, its weights under language_model
    config = dict(model_type="kimi_k25", quantization_config=quantization,
                  text_config=dict(model_type="kimi_k2", **KIMI))  # fmt: skip
    prefix = f"language_model.{prefix}"
  (path / "config.json").write_text(json.dumps(config))
  save_raw_or_numpy({f"{prefix}.{name}": v for name, v in stored.items()}, path)
  return config, floats


# --- NVIDIA's NVFP4 (ModelOpt, compressed-tensors nvfp4-pack-quantized) ----------------------

MODELOPT_CONFIG = dict(
  quant_method="modelopt", quant_algo="NVFP4", group_size=16, kv_cache_quant_algo=None,
  exclude_modules=["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"],
)  # fmt: skip
NVFP4_WEIGHTS = dict(
  num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
  dynamic=False, observer="minmax",
)  # fmt: skip


def nvfp4_quantization_config(**weights) -> dict:
  """compressed-tensors' NVFP4 (W4A4) `quantization_config`, with `weights` fields changed."""
  activations = {**NVFP4_WEIGHTS, "dynamic": "local"}
  group = dict(targets=["Linear"], weights={**NVFP4_WEIGHTS, **weights},
               input_activations=activations)  # fmt: skip
  return dict(
    quant_method="compressed-tensors", format="nvfp4-pack-quantized",
    quantization_status="compressed", config_groups=dict(group_0=group),
    ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
  )  # fmt: skip


def nvfp4_linear(rng, rows: int, cols: int, names: Nvfp4Names) -> tuple[dict, np.ndarray]:
  """One NVFP4 linear layer [out, in]: its stored tensors (suffix -> array, activation scale
  included) and the float32 weight they stand for, dequantized as the convention does
  (ModelOpt: codes * (scale * scale_2); compressed-tensors: codes * (scale / g))."""
  codes = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
  scales = rng.uniform(16, 448, (rows, cols // 16)).astype(ml_dtypes.float8_e4m3fn)
  matrix = np.float32(2.0 ** rng.uniform(-13, -11))
  if names.reciprocal:
    matrix = np.float32(1) / matrix  # g, as compressed-tensors stores it
  effective = np.repeat(scales.astype(np.float32), 16, axis=1)
  effective = effective / matrix if names.reciprocal else effective * matrix
  activation = "input_global_scale" if names.reciprocal else "input_scale"
  stored = {
    names.codes: codes[:, 0::2] | (codes[:, 1::2] << 4),
    names.scales: scales,
    names.matrix_scale: np.full((1,) if names.reciprocal else (), matrix, np.float32),
    activation: np.ones((1,) if names.reciprocal else (), np.float32),
  }
  return stored, E2M1[codes] * effective


def nvfp4_checkpoint(path, seed: int, names: Nvfp4Names, quantization: dict, drop: str = ""):
  """A DeepSeek-V3 MoE layer with its routed and shared experts in NVFP4 (as NVIDIA's
  DeepSeek-R1-FP4), the router float, without the tensor `drop` names; returns the
  config.json dict and the float32 weights the stored ones stand for ([out, in], by linear:
  "experts.5.gate_proj")."""
  rng = np.random.default_rng(seed)
  experts, dim = KIMI["n_routed_experts"], KIMI["hidden_size"]
  stored = {
    "gate.weight": 0.3 * rng.standard_normal((experts, dim)).astype(np.float32),
    "gate.e_score_correction_bias": 0.1 * rng.standard_normal(experts).astype(np.float32),
  }
  floats = {}
  layers = [f"shared_experts.{n}" for n in KIMI_LINEARS] + [
    f"experts.{e}.{n}" for e in range(experts) for n in KIMI_LINEARS
  ]
  for layer in layers:
    tensors, floats[layer] = nvfp4_linear(rng, *KIMI_LINEARS[layer.rsplit(".", 1)[1]], names)
    stored.update({f"{layer}.{suffix}": value for suffix, value in tensors.items()})
  config = dict(model_type="deepseek_v3", quantization_config=quantization, **KIMI)
  (path / "config.json").write_text(json.dumps(config))
  prefix = f"model.layers.{LAYER}.mlp"
  kept = {f"{prefix}.{name}": v for name, v in stored.items() if name != drop}
  save_raw_or_numpy(kept, path)
  return config, floats
