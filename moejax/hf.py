"""Hugging Face checkpoints: a model's `config.json` -> `MoEConfig`, one MoE layer -> `MoEParams`.

Reads local safetensors files with NumPy (no torch): a single `model.safetensors` or a sharded
checkpoint with `model.safetensors.index.json`. Experts may be stored as per-expert linear
layers (`experts.{e}.gate_proj.weight`, Mixtral's `w1`/`w3`/`w2`) or as fused 3-D tensors
(`experts.gate_up_proj`, GPT-OSS's with gate and up interleaved column by column).

>>> len(FAMILIES), sorted(FAMILIES)[:3]
(19, ['dbrx', 'deepseek_v2', 'deepseek_v3'])
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from kernels_pallas.quantized import BlockScaled, is_block_scaled
from moejax.config import MoEConfig
from moejax.params import MoEParams, check_params
from moejax.sharding import LayerSpecs, check_mesh, map_params, placement

_ACTIVATIONS = {
  "silu": "silu",
  "swish": "silu",
  "gelu": "gelu",
  "gelu_pytorch_tanh": "gelu_tanh",
  "gelu_new": "gelu_tanh",
}


@dataclasses.dataclass(frozen=True)
class Family:
  """Where one model family keeps an MoE layer's weights, and how its config reads.

  Attributes:
    block: the MoE block's key prefix, with `{layer}`.
    router: the router's [E (+ Z), D] weight, relative to the block.
    config: config.json dict -> `MoEConfig` keyword arguments.
    expert_names: per-expert (gate, up, down) linear layer names under `experts.{e}.`.
    fused_input_major: fused `experts.gate_up_proj` is [E, D, 2F] (GPT-OSS, Llama 4), not
      transformers' [E, 2F, D].
    interleaved: fused gate/up columns alternate gate, up (GPT-OSS), not halves.
    fused: the fused (gate_up, down) tensors' keys relative to the block.
    flat_experts: DBRX's (gate, up, down) keys, each [E * F, D] (down transposed).
    router_bias: the router's bias key, or None.
    selection_bias: the selection-only bias key (DeepSeek's `e_score_correction_bias`).
    shared: the shared experts' key prefix (gate_proj, up_proj, down_proj), or None.
    shared_gate: the shared experts' [1, D] gate weight key, or None.
  """

  block: str
  router: str
  config: Callable[[dict], dict]
  expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  fused_input_major: bool = False
  interleaved: bool = False
  fused: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")
  flat_experts: tuple[str, str, str] | None = None
  router_bias: str | None = None
  selection_bias: str | None = None
  shared: str | None = None
  shared_gate: str | None = None


def _activation(hf: dict) -> str:
  name = hf.get("hidden_act") or hf.get("ffn_config", {}).get("ffn_act_fn", {}).get("name", "silu")
  if name not in _ACTIVATIONS:
    raise NotImplementedError(f"hidden_act={name!r}: moejax has {sorted(_ACTIVATIONS)}")
  return _ACTIVATIONS[name]


def _softmax_top_k(hf: dict, experts: str, top_k: str, width: str, renormalize: bool) -> dict:
  return dict(
    num_experts=hf[experts],
    top_k=hf[top_k],
    intermediate_size=hf[width],
    renormalize=renormalize,
  )


def _shared_experts(count: int | None, width: int) -> dict:
  """Config fields for `count` shared experts of `width` each (fused: width count * width)."""
  if not count:
    return {}
  return dict(num_shared_experts=count, shared_intermediate_size=count * width)


def _ernie(hf: dict) -> dict:
  options = _softmax_top_k(hf, "moe_num_experts", "moe_k", "moe_intermediate_size", True)
  options.update(use_routing_bias=True)
  options.update(_shared_experts(hf.get("moe_num_shared_experts"), hf["moe_intermediate_size"]))
  return options


def _hunyuan(hf: dict) -> dict:
  top_k = hf["moe_topk"]
  options = dict(
    num_experts=hf["num_experts"],
    top_k=top_k if isinstance(top_k, int) else top_k[0],
    intermediate_size=hf["intermediate_size"],
    renormalize=True,
  )
  shared = hf.get("num_shared_expert", 1)
  shared = shared if isinstance(shared, int) else shared[0]
  if hf.get("use_mixed_mlp_moe", True):
    options.update(_shared_experts(shared, hf["intermediate_size"]))
  return options


def _lfm2(hf: dict) -> dict:
  return dict(
    num_experts=hf["num_experts"],
    top_k=hf["num_experts_per_tok"],
    intermediate_size=hf["moe_intermediate_size"],
    scoring="sigmoid",
    use_routing_bias=bool(hf.get("use_expert_bias", True)),
    renormalize=bool(hf.get("norm_topk_prob", True)),
    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
  )


def _dbrx(hf: dict) -> dict:
  ffn = hf["ffn_config"]
  if ffn.get("moe_normalize_expert_weights") not in (None, 1, 1.0):
    raise NotImplementedError(
      f"DBRX moe_normalize_expert_weights={ffn['moe_normalize_expert_weights']}: moejax "
      "renormalizes with the sum (p=1) only"
    )
  return dict(
    num_experts=ffn["moe_num_experts"],
    top_k=ffn["moe_top_k"],
    intermediate_size=ffn["ffn_hidden_size"],
    renormalize=ffn.get("moe_normalize_expert_weights") is not None,
  )


def _mixtral(hf: dict) -> dict:
  return _softmax_top_k(hf, "num_local_experts", "num_experts_per_tok", "intermediate_size", True)


def _phimoe(hf: dict) -> dict:
  return dict(
    num_experts=hf["num_local_experts"],
    top_k=hf["num_experts_per_tok"],
    intermediate_size=hf["intermediate_size"],
    scoring="sparsemixer",
    sparsemixer_eps=hf.get("router_jitter_noise", 0.01),
  )


def _qwen(hf: dict, *, moe_width: str = "moe_intermediate_size") -> dict:
  options = dict(
    num_experts=hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
    top_k=hf["num_experts_per_tok"],
    intermediate_size=hf[moe_width],
    renormalize=bool(hf.get("norm_topk_prob", False)),
  )
  if hf.get("shared_expert_intermediate_size"):
    options.update(
      num_shared_experts=1,
      shared_intermediate_size=hf["shared_expert_intermediate_size"],
      shared_expert_gate=True,
    )
  return options


def _deepseek(hf: dict, *, biased: bool) -> dict:
  grouped = biased or hf.get("topk_method") == "group_limited_greedy"
  options = dict(
    num_experts=hf["n_routed_experts"],
    top_k=hf["num_experts_per_tok"],
    intermediate_size=hf["moe_intermediate_size"],
    scoring="sigmoid" if biased else "softmax",
    use_routing_bias=biased,
    renormalize=bool(hf.get("norm_topk_prob", False)),
    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    num_expert_groups=hf.get("n_group", 1) if grouped else 1,
    topk_groups=hf.get("topk_group", 1) if grouped else 1,
  )
  options.update(_shared_experts(hf.get("n_shared_experts"), hf["moe_intermediate_size"]))
  return options


def _gpt_oss(hf: dict) -> dict:
  return dict(
    num_experts=hf["num_local_experts"],
    top_k=hf["num_experts_per_tok"],
    intermediate_size=hf["intermediate_size"],
    renormalize=True,  # softmax over the top-k logits
    router_bias=True,
    expert_bias=True,
    activation="swiglu_oai",
    swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
  )


def _llama4(hf: dict) -> dict:
  return dict(
    num_experts=hf["num_local_experts"],
    top_k=hf["num_experts_per_tok"],
    intermediate_size=hf["intermediate_size"],
    scoring="sigmoid",
    apply_router_weight_on_input=True,
    num_shared_experts=1,
    shared_intermediate_size=hf["intermediate_size"],
  )


def _longcat(hf: dict) -> dict:
  return dict(
    num_experts=hf["n_routed_experts"],
    top_k=hf["moe_topk"],
    intermediate_size=hf["expert_ffn_hidden_size"],
    num_zero_experts=hf.get("zero_expert_num") or 0,
    use_routing_bias=True,
    router_bias=bool(hf.get("router_bias", False)),
    routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
  )


_W1_W3_W2 = ("w1", "w3", "w2")  # Mixtral's names of gate, up and down
_DEEPSEEK_V3 = Family(
  "model.layers.{layer}.mlp",
  "gate.weight",
  lambda hf: _deepseek(hf, biased=True),
  selection_bias="gate.e_score_correction_bias",
  shared="shared_experts",
)
_QWEN_SHARED = Family(
  "model.layers.{layer}.mlp",
  "gate.weight",
  _qwen,
  shared="shared_expert",
  shared_gate="shared_expert_gate.weight",
)

FAMILIES: dict[str, Family] = {
  "mixtral": Family("model.layers.{layer}.block_sparse_moe", "gate.weight", _mixtral, _W1_W3_W2),
  "phimoe": Family("model.layers.{layer}.block_sparse_moe", "gate.weight", _phimoe, _W1_W3_W2),
  "qwen2_moe": _QWEN_SHARED,
  "qwen3_next": _QWEN_SHARED,
  "qwen3_moe": Family("model.layers.{layer}.mlp", "gate.weight", _qwen),
  "olmoe": Family(
    "model.layers.{layer}.mlp",
    "gate.weight",
    lambda hf: _qwen(hf, moe_width="intermediate_size"),
  ),
  "deepseek_v2": Family(
    "model.layers.{layer}.mlp",
    "gate.weight",
    lambda hf: _deepseek(hf, biased=False),
    shared="shared_experts",
  ),
  "deepseek_v3": _DEEPSEEK_V3,
  "glm4_moe": _DEEPSEEK_V3,
  "gpt_oss": Family(
    "model.layers.{layer}.mlp",
    "router.weight",
    _gpt_oss,
    fused_input_major=True,
    interleaved=True,
    router_bias="router.bias",
  ),
  "llama4_text": Family(
    "model.layers.{layer}.feed_forward",
    "router.weight",
    _llama4,
    fused_input_major=True,
    shared="shared_expert",
  ),
  "minimax": Family("model.layers.{layer}.block_sparse_moe", "gate.weight", _mixtral, _W1_W3_W2),
  "granitemoe": Family(
    "model.layers.{layer}.block_sparse_moe",
    "router.layer.weight",
    _mixtral,  # the same config fields and routing
    fused=("input_linear.weight", "output_linear.weight"),
  ),
  "jamba": Family(
    "model.layers.{layer}.feed_forward",
    "router.weight",
    lambda hf: _softmax_top_k(hf, "num_experts", "num_experts_per_tok", "intermediate_size", False),
  ),
  "ernie4_5_moe": Family(
    "model.layers.{layer}.mlp",
    "gate.weight",
    _ernie,
    selection_bias="moe_statics.e_score_correction_bias",
    shared="shared_experts",
  ),
  "hunyuan_v1_moe": Family(
    "model.layers.{layer}.mlp", "gate.wg.weight", _hunyuan, shared="shared_mlp"
  ),
  "lfm2_moe": Family(
    "model.layers.{layer}.feed_forward",
    "gate.weight",
    _lfm2,
    _W1_W3_W2,
    selection_bias="expert_bias",
  ),
  "dbrx": Family(
    "transformer.blocks.{layer}.ffn",
    "router.layer.weight",
    _dbrx,
    flat_experts=("experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2"),
  ),
  "longcat_flash": Family(
    "model.layers.{layer}.mlp",
    "router.classifier.weight",
    _longcat,
    router_bias="router.classifier.bias",
    selection_bias="router.e_score_correction_bias",
  ),
}


def _family(hf: dict) -> Family:
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(
      f"model_type={model_type!r} is not supported; moejax.hf reads {sorted(FAMILIES)}"
    )
  return FAMILIES[model_type]


def config_from_hf(config: dict[str, Any], **overrides: Any) -> MoEConfig:
  """The `MoEConfig` of a model's MoE layers, from its `config.json` as a dict.

  Args:
    config: the parsed config.json; `model_type` picks the family (see `FAMILIES`).
    **overrides: further `MoEConfig` fields (chunk_size, dtype, dispatch, ...).

  A checkpoint's `quantization_config` sets `expert_quant`: `quant_method` "fp8" with a
  `weight_block_size` [out, in] is "fp8_block" with `quant_block_size` (in, out); "mxfp4" is
  "mxfp4".

  Raises:
    ValueError: for an unsupported model_type (the message lists the supported ones).
    NotImplementedError: for quantization methods and activations moejax lacks.
  """
  options = {
    "hidden_size": config.get("hidden_size") or config["d_model"],
    "activation": _activation(config),
    **_family(config).config(config),  # a family's own activation (GPT-OSS) wins
    **_quantization(config.get("quantization_config")),
  }
  return MoEConfig(**{**options, **overrides})


def _quantization(quantization: dict | None) -> dict:
  """`MoEConfig` fields of a checkpoint's `quantization_config`."""
  if not quantization:
    return {}
  method = quantization.get("quant_method")
  if method == "fp8" and quantization.get("weight_block_size"):
    out_block, in_block = quantization["weight_block_size"]
    return dict(expert_quant="fp8_block", quant_block_size=(int(in_block), int(out_block)))
  if method == "mxfp4":
    return dict(expert_quant="mxfp4")
  raise NotImplementedError(
    f"quantization_config with quant_method={method!r} is not supported: moejax reads "
    "'fp8' with weight_block_size (fine-grained fp8) and 'mxfp4'"
  )


# safetensors dtypes NumPy lacks (safetensors' NumPy reader fails on them): read raw.
_RAW_DTYPES = {
  "F8_E4M3": ml_dtypes.float8_e4m3fn,
  "F8_E5M2": ml_dtypes.float8_e5m2,
  "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


class _Checkpoint(contextlib.ExitStack):
  """The tensors of a local safetensors checkpoint, single file or sharded, read lazily.

  A context manager: each file is opened once, on its first read, and closed on exit.
  `get` returns a fine-grained fp8 weight dequantized with its `…_scale_inv` (blocks of
  `fp8_block`, [out, in]); `get_raw` returns what the file holds.
  """

  def __init__(self, path: Path, fp8_block: tuple[int, int] | None = None):
    super().__init__()
    self.fp8_block = fp8_block
    self._open: dict[Path, Any] = {}
    self._headers: dict[Path, dict] = {}
    index = path / "model.safetensors.index.json"
    if index.exists():
      weight_map = json.loads(index.read_text())["weight_map"]
      self.files = {key: path / name for key, name in weight_map.items()}
    elif (path / "model.safetensors").exists():
      single = path / "model.safetensors"
      self.files = dict.fromkeys(self._file(single).keys(), single)
    else:
      raise FileNotFoundError(f"{path} has neither model.safetensors nor its index")

  def _file(self, path: Path):
    if path not in self._open:
      from safetensors import safe_open

      self._open[path] = self.enter_context(safe_open(path, "np"))
    return self._open[path]

  def __contains__(self, key: str) -> bool:
    return key in self.files

  def _header(self, path: Path) -> dict:
    """The safetensors header of a file: {key: {dtype, shape, data_offsets}}."""
    if path not in self._headers:
      with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        self._headers[path] = {"__size__": size, **json.loads(file.read(size))}
    return self._headers[path]

  def get_raw(self, key: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The tensor as stored (fp8 as ml_dtypes arrays, memory-mapped)."""
    if key not in self.files:
      near = sorted(k for k in self.files if k.startswith(key.rsplit(".", 2)[0]))[:5]
      raise KeyError(f"checkpoint has no tensor {key!r} (keys near it: {near})")
    path = self.files[key]
    header = self._header(path)
    info = header[key]
    if info["dtype"] in _RAW_DTYPES:
      start, end = info["data_offsets"]
      raw = np.memmap(path, np.uint8, "r", offset=8 + header["__size__"] + start, shape=end - start)
      value = raw.view(_RAW_DTYPES[info["dtype"]]).reshape(info["shape"])
    else:
      value = self._file(path).get_tensor(key)
    if shape is not None and value.shape != shape:
      raise ValueError(f"checkpoint tensor {key!r} has shape {value.shape}, expected {shape}")
    return value

  def get(self, key: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The tensor; an fp8 weight with a `…_scale_inv` comes dequantized, in float32."""
    value = self.get_raw(key, shape)
    if f"{key}_scale_inv" not in self:
      return value
    if self.fp8_block is None:
      raise ValueError(f"{key} has a scale_inv but config.json has no weight_block_size")
    scales = np.asarray(self.get_raw(f"{key}_scale_inv"), np.float32)
    block = (self.fp8_block[1], self.fp8_block[0])  # as (in, out) of the transposed weight
    return np.asarray(BlockScaled(value.T, scales.T, block).dequantize()).T


def load_layer(
  path: str | Path,
  layer: int,
  config: MoEConfig | None = None,
  *,
  mesh: Mesh | None = None,
  dequantize: bool = False,
) -> MoEParams:
  """One MoE layer's weights from a local Hugging Face checkpoint folder.

  Args:
    path: the folder (config.json and safetensors files).
    layer: the decoder layer index; it must be an MoE layer of the model.
    config: the layer's `MoEConfig`; None reads it with `config_from_hf` (dtype float32).
    mesh: place each parameter on this mesh as `MoELayer` does (experts split over the expert
      axis): each device receives only its slice, though each tensor is read whole into host
      memory first; None gives host NumPy arrays.
    dequantize: with a quantized checkpoint (`config.expert_quant`), return float expert
      weights (for the config with `expert_quant=None`) instead of `BlockScaled` ones in the
      checkpoint's format. Quantized shared experts are always dequantized.

  Returns:
    `MoEParams` in the config's `param_dtype` (quantized experts kept as stored).

  Raises:
    KeyError: a tensor the layer needs is missing (the message names the key).
    ValueError: a tensor has another shape than the config implies, or the family is unknown.
    NotImplementedError: a quantized layout moejax does not read (named).
  """
  path = Path(path)
  hf = json.loads((path / "config.json").read_text())
  family = _family(hf)
  config = config_from_hf(hf) if config is None else config
  block = family.block.format(layer=layer)
  fp8_block = (hf.get("quantization_config") or {}).get("weight_block_size")
  with _Checkpoint(path, fp8_block) as checkpoint:
    values = _read_layer(checkpoint, block, family, config)
  dtype = np.dtype(config.param_dtype)
  as_stored = lambda v: v if is_block_scaled(v) else np.asarray(v).astype(dtype)
  params = MoEParams(**{name: as_stored(value) for name, value in values.items()})
  if dequantize and config.expert_quant is not None:
    config = dataclasses.replace(config, expert_quant=None)
    params = params._replace(
      **{name: np.asarray(v.dequantize(dtype)) for name, v in values.items() if is_block_scaled(v)}
    )
  try:
    check_params(params, config)
  except ValueError as error:
    raise ValueError(f"read from {block}: {error}") from None
  if mesh is None:
    return params
  check_mesh(mesh, config)
  place = lambda value, spec: jax.make_array_from_callback(
    value.shape, placement(mesh, spec), value.__getitem__
  )  # each device gets only its slice
  return map_params(place, LayerSpecs.from_config(config).params(params), params)


def _read_layer(checkpoint: _Checkpoint, block: str, family: Family, config: MoEConfig) -> dict:
  """The layer's parameters as float32 NumPy arrays in moejax's layout ([in, out])."""
  d, f, e = config.hidden_size, config.intermediate_size, config.num_experts
  outputs = config.num_router_outputs
  key = lambda name: f"{block}.{name}"
  f32 = lambda a: np.asarray(a, np.float32)
  values = {"router_kernel": f32(checkpoint.get(key(family.router), (outputs, d))).T}
  if family.router_bias and config.router_bias:
    values["router_bias"] = f32(checkpoint.get(key(family.router_bias), (outputs,)))
  if family.selection_bias and config.use_routing_bias:
    bias = f32(checkpoint.get(key(family.selection_bias)))  # ERNIE stores it as [1, E]
    if bias.size != outputs:
      raise ValueError(
        f"{key(family.selection_bias)} has shape {bias.shape}, expected {(outputs,)}"
      )
    values["routing_bias"] = bias.reshape(outputs)
  if config.expert_quant == "mxfp4":
    values.update(_read_mxfp4_experts(checkpoint, key, config))
  elif config.expert_quant == "fp8_block":
    values.update(_read_fp8_experts(checkpoint, key, family, config))
  else:
    values.update(_read_experts(checkpoint, key, family, e, d, f))
  if config.has_shared_experts and family.shared:
    fs = config.shared_intermediate_size
    gate, up, down = (
      f32(checkpoint.get(key(f"{family.shared}.{name}.weight"), shape))
      for name, shape in (("gate_proj", (fs, d)), ("up_proj", (fs, d)), ("down_proj", (d, fs)))
    )
    values["shared_w_gate_up"] = np.concatenate([gate.T, up.T], axis=1)
    values["shared_w_down"] = down.T
  if config.shared_expert_gate and family.shared_gate:
    values["shared_gate_kernel"] = f32(checkpoint.get(key(family.shared_gate), (1, d))).T
  return values


def _read_experts(checkpoint: _Checkpoint, key, family: Family, e: int, d: int, f: int) -> dict:
  """w_gate_up [E, D, 2F], w_down [E, F, D] (and biases) from fused or per-expert tensors."""
  f32 = lambda a: np.asarray(a, np.float32)
  values = {}
  if family.flat_experts:
    gate, up, down = (f32(checkpoint.get(key(name), (e * f, d))) for name in family.flat_experts)
    gate_up = np.concatenate([gate.reshape(e, f, d), up.reshape(e, f, d)], axis=1)
    return {"w_gate_up": gate_up.transpose(0, 2, 1), "w_down": down.reshape(e, f, d)}
  fused_gate_up, fused_down = (key(name) for name in family.fused)
  if fused_gate_up in checkpoint:
    gate_up = f32(checkpoint.get(fused_gate_up))[:e]
    down = f32(checkpoint.get(fused_down))[:e]
    if not family.fused_input_major:  # transformers' [E, 2F, D] and [E, D, F]
      gate_up, down = gate_up.transpose(0, 2, 1), down.transpose(0, 2, 1)
    if gate_up.shape != (e, d, 2 * f) or down.shape != (e, f, d):
      raise ValueError(
        f"{key('experts')}: fused gate_up {gate_up.shape} / down {down.shape}, expected "
        f"{(e, d, 2 * f)} / {(e, f, d)}"
      )
    values["w_gate_up"], values["w_down"] = _halves(gate_up, family.interleaved), down
    if key("experts.gate_up_proj_bias") in checkpoint:
      bias = f32(checkpoint.get(key("experts.gate_up_proj_bias"), None))[:e]
      values["b_gate_up"] = _halves(bias, family.interleaved)
      values["b_down"] = f32(checkpoint.get(key("experts.down_proj_bias"), None))[:e]
    return values
  gate_name, up_name, down_name = family.expert_names
  weight = lambda i, name, shape: f32(checkpoint.get(key(f"experts.{i}.{name}.weight"), shape))
  values["w_gate_up"] = np.stack(
    [
      np.concatenate([weight(i, gate_name, (f, d)).T, weight(i, up_name, (f, d)).T], axis=1)
      for i in range(e)
    ]
  )
  values["w_down"] = np.stack([weight(i, down_name, (d, f)).T for i in range(e)])
  return values


def _read_fp8_experts(checkpoint: _Checkpoint, key, family: Family, config: MoEConfig) -> dict:
  """Fine-grained fp8 experts as `BlockScaled` w_gate_up [E, D, 2F] and w_down [E, F, D],
  transposed to [in, out]: per-expert linear layers (DeepSeek-V3, Kimi-K2, Qwen3-MoE FP8)
  or transformers' fused `FP8Experts` tensors (`experts.gate_up_proj` [E, 2F, D] with
  `experts.gate_up_proj_scale_inv`, `experts.down_proj` [E, D, F])."""
  if family.flat_experts or family.interleaved or family.fused_input_major:
    raise NotImplementedError(
      "fp8 experts are read from per-expert linear layers or transformers' fused [E, out, in] "
      "tensors; this family stores its experts another way"
    )
  e, d, f = config.num_experts, config.hidden_size, config.intermediate_size
  block = config.quant_block  # (in, out)

  def read(weight: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(values, scales) of `weight` [..., out, in], as [..., in, out] and its blocks."""
    *lead, rows, cols = shape
    scales_shape = (*lead, -(-rows // block[1]), -(-cols // block[0]))
    values = np.asarray(checkpoint.get_raw(weight, shape))
    scales = np.asarray(checkpoint.get_raw(f"{weight}_scale_inv", scales_shape))
    if values.dtype != ml_dtypes.float8_e4m3fn or scales.dtype != np.float32:
      raise ValueError(
        f"{weight}: expected float8_e4m3fn values with float32 scale_inv, got "
        f"{values.dtype} and {scales.dtype}"
      )
    return np.swapaxes(values, -1, -2), np.swapaxes(scales, -1, -2)

  fused_gate_up, fused_down = (key(name) for name in family.fused)
  if fused_gate_up in checkpoint:
    return {
      "w_gate_up": BlockScaled(*read(fused_gate_up, (e, 2 * f, d)), block),
      "w_down": BlockScaled(*read(fused_down, (e, d, f)), block),
    }
  if family.expert_names is None:
    raise NotImplementedError("this family's fp8 experts are neither fused nor per-expert")
  expert = lambda i, name, shape: read(f"{key(f'experts.{i}.{name}')}.weight", shape)
  gate_name, up_name, down_name = family.expert_names
  gate_up, down = [], []
  for i in range(e):
    (gate_v, gate_s), (up_v, up_s) = (expert(i, n, (f, d)) for n in (gate_name, up_name))
    gate_up.append((np.concatenate([gate_v, up_v], 1), np.concatenate([gate_s, up_s], 1)))
    down.append(expert(i, down_name, (d, f)))
  stacked = lambda pairs: BlockScaled(
    np.stack([v for v, _ in pairs]), np.stack([s for _, s in pairs]), block
  )
  return {"w_gate_up": stacked(gate_up), "w_down": stacked(down)}


# e2m1 codes 0..15 (sign in bit 3) as the values they stand for.
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def unpack_mxfp4(blocks: np.ndarray) -> np.ndarray:
  """[..., n, 16] uint8 -> [..., 32 n] float4_e2m1fn: value 2j of each block is byte j's low
  nibble, 2j + 1 its high nibble (GPT-OSS's `*_blocks`).

  >>> unpack_mxfp4(np.array([[0x21, 0xF7] + [0] * 14], np.uint8)).astype(float)[:4].tolist()
  [0.5, 1.0, 6.0, -6.0]
  """
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., n, 16, 2]
  codes = codes.reshape(*blocks.shape[:-2], -1)
  return _E2M1[codes].astype(ml_dtypes.float4_e2m1fn)


def _read_mxfp4_experts(checkpoint: _Checkpoint, key, config: MoEConfig) -> dict:
  """GPT-OSS's MXFP4 experts as `BlockScaled` (values and e8m0 scales transposed to
  [in, out], gate/up de-interleaved), and their float biases."""
  e, d, f = config.num_experts, config.hidden_size, config.intermediate_size

  def matrix(name: str, rows: int, cols: int) -> BlockScaled:
    """[E, rows=out, cols=in] stored -> [E, in, out] with scales [E, in/32, out]."""
    blocks = checkpoint.get_raw(key(f"experts.{name}_blocks"), (e, rows, cols // 32, 16))
    scales = checkpoint.get_raw(key(f"experts.{name}_scales"), (e, rows, cols // 32))
    values = unpack_mxfp4(np.asarray(blocks)).transpose(0, 2, 1)
    scales = np.asarray(scales).view(ml_dtypes.float8_e8m0fnu).transpose(0, 2, 1)
    return BlockScaled(values, scales, (32, 1))

  gate_up = matrix("gate_up_proj", 2 * f, d)
  f32 = lambda name, shape: np.asarray(checkpoint.get(key(f"experts.{name}"), shape), np.float32)
  return {
    "w_gate_up": BlockScaled(
      _halves(gate_up.values, True), _halves(gate_up.scales, True), gate_up.block
    ),
    "w_down": matrix("down_proj", d, f),
    "b_gate_up": _halves(f32("gate_up_proj_bias", (e, 2 * f)), True),
    "b_down": f32("down_proj_bias", (e, d)),
  }


def _halves(gate_up: np.ndarray, interleaved: bool) -> np.ndarray:
  """[..., 2F] with gate then up halves (de-interleaving GPT-OSS's alternating columns)."""
  if not interleaved:
    return gate_up
  return np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], axis=-1)
