"""Checkpoints written here in each family's real key names and layouts (float, fp8, raw
safetensors for the dtypes NumPy's writer lacks), and each family's MoE block in NumPy, from
the checkpoint's own tensors: what the `moejax.hf` tests load and compare against."""

import json

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

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
