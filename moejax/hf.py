"""Hugging Face checkpoints: a model's `config.json` -> `MoEConfig`, one MoE layer -> `MoEParams`.

`FAMILIES` is the table: one `Family` row per `model_type`, saying where the MoE block's
tensors are, which config.json keys give the layer's sizes and options, and how its experts
are stored (`PerExpert` linear layers, `Fused` 3-D tensors, DBRX's `Flat` ones), float or
quantized. Adding a family is adding a row. The files are read by `moejax.safetensors_files`
(NumPy, no torch).

>>> len(FAMILIES), sorted(FAMILIES)[:3]
(21, ['dbrx', 'deepseek_v2', 'deepseek_v3'])
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from kernels_pallas.quantized import BlockScaled, is_block_scaled
from moejax import hf_nvfp4
from moejax.config import INT4_GROUP_SIZES, MoEConfig
from moejax.params import MoEParams, check_params
from moejax.safetensors_files import SafetensorsFiles
from moejax.sharding import LayerSpecs, check_mesh, map_params, placement

_ACTIVATIONS = {
  "silu": "silu",
  "swish": "silu",
  "gelu": "gelu",
  "gelu_pytorch_tanh": "gelu_tanh",
  "gelu_new": "gelu_tanh",
}
_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class Read:
  """A config.json value: `key` (dotted for nested dicts; a tuple for alternatives, the first
  present wins; null counts as absent), else `default` (a missing key without one raises
  KeyError), `convert`ed."""

  key: str | tuple[str, ...]
  default: Any = _REQUIRED
  convert: Callable[[Any], Any] = lambda value: value

  def __call__(self, hf: dict) -> Any:
    for key in (self.key,) if isinstance(self.key, str) else self.key:
      value = hf
      for part in key.split("."):
        value = value.get(part, _REQUIRED) if isinstance(value, dict) else _REQUIRED
      if value is not _REQUIRED and value is not None:  # as config.json's null
        return self.convert(value)
    if self.default is _REQUIRED:
      raise KeyError(f"config.json has no {self.key!r}")
    return self.convert(self.default)


@dataclasses.dataclass(frozen=True)
class Shared:
  """How config.json gives the shared experts: `count` of `width` each, fused into one MLP of
  count * width (none where either is 0 or missing, or `enabled` reads false); `gate` for
  Qwen's sigmoid gate."""

  count: Read | int
  width: Read
  gate: bool = False
  enabled: Read | bool = True

  def options(self, hf: dict) -> dict:
    read = lambda field: field(hf) if isinstance(field, Read) else field
    count, width = read(self.count), read(self.width)
    if not (read(self.enabled) and count and width):
      return {}
    gate = {"shared_expert_gate": True} if self.gate else {}
    return dict(num_shared_experts=count, shared_intermediate_size=count * width, **gate)


def halves(gate_up: np.ndarray, interleaved: bool) -> np.ndarray:
  """[..., 2F] with gate then up halves (de-interleaving GPT-OSS's alternating columns)."""
  if not interleaved:
    return gate_up
  return np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], axis=-1)


class _Layout(abc.ABC):
  """How a family stores its routed experts. Each read returns moejax's tensors ([in, out]):
  `w_gate_up` [E, D, 2F], `w_down` [E, F, D] (and biases), float32 or `BlockScaled`; `key`
  turns a name relative to the MoE block into the checkpoint's key."""

  @abc.abstractmethod
  def present(self, files: SafetensorsFiles, key: Callable[[str], str]) -> bool:
    """Whether the layer's experts are stored this way."""

  @abc.abstractmethod
  def floats(self, files: SafetensorsFiles, key, e: int, d: int, f: int) -> dict:
    """Float experts (fp8 ones with a `…_scale_inv` dequantized), float32."""

  def fp8(self, files: SafetensorsFiles, key, e: int, d: int, f: int, block) -> dict:
    raise NotImplementedError(f"fp8 experts stored as {self} are not read")

  def mxfp4(self, files: SafetensorsFiles, key, e: int, d: int, f: int) -> dict:
    raise NotImplementedError(f"mxfp4 experts stored as {self} are not read")

  def int4(self, files: SafetensorsFiles, key, e: int, d: int, f: int, group: int) -> dict:
    raise NotImplementedError(f"pack-quantized int4 experts stored as {self} are not read")

  def nvfp4(self, files: SafetensorsFiles, key, e: int, d: int, f: int) -> dict:
    raise NotImplementedError(f"nvfp4 experts stored as {self} are not read")


def _read_fp8(files: SafetensorsFiles, weight: str, shape: tuple[int, ...], block):
  """(values, scales) of an fp8 `weight` [..., out, in] as [..., in, out] and its blocks;
  scales stored as e8m0 (`scale_fmt: "ue8m0"` checkpoints may) widen to float32 (exact)."""
  *lead, rows, cols = shape
  scales_shape = (*lead, -(-rows // block[1]), -(-cols // block[0]))
  values = np.asarray(files.get_raw(weight, shape))
  scales = np.asarray(files.get_raw(f"{weight}_scale_inv", scales_shape))
  if scales.dtype == ml_dtypes.float8_e8m0fnu:
    scales = scales.astype(np.float32)
  if values.dtype != ml_dtypes.float8_e4m3fn or scales.dtype != np.float32:
    raise ValueError(
      f"{weight}: expected float8_e4m3fn values with float32 scale_inv, got "
      f"{values.dtype} and {scales.dtype}"
    )
  return np.swapaxes(values, -1, -2), np.swapaxes(scales, -1, -2)


def unpack_int4(packed: np.ndarray, columns: int) -> np.ndarray:
  """compressed-tensors' pack-quantized int32 words [..., n] -> int4 [..., columns]: value i
  of a row is nibble i (low nibble first, little-endian words) minus 8.

  >>> unpack_int4(np.array([[0x0000_00F8]], np.uint32).view(np.int32), 2).astype(int).tolist()
  [[0, 7]]
  """
  data = np.ascontiguousarray(packed).astype("<i4").view(np.uint8)
  nibbles = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
  return (nibbles[..., :columns].astype(np.int8) - 8).astype(ml_dtypes.int4)


def _read_int4(files: SafetensorsFiles, weight: str, shape: tuple[int, int], group: int):
  """A pack-quantized `weight` [out, in] (`…_packed` int32 [out, in/8], `…_scale` [out,
  in/group], `…_shape`) as a `BlockScaled` [in, out] with scales [in/group, out]."""
  rows, cols = shape
  stored_shape = tuple(int(n) for n in np.asarray(files.get_raw(f"{weight}_shape")))
  if stored_shape != shape:
    raise ValueError(f"{weight}_shape is {stored_shape}, expected {shape}")
  packed = np.asarray(files.get_raw(f"{weight}_packed", (rows, -(-cols // 8))))
  scales = np.asarray(files.get_raw(f"{weight}_scale", (rows, cols // group)))
  if packed.dtype != np.int32:
    raise ValueError(f"{weight}_packed: expected int32 words, got {packed.dtype}")
  if scales.dtype != ml_dtypes.bfloat16:
    scales = scales.astype(np.float32)  # float16 or float32: exact in float32
  return BlockScaled(unpack_int4(packed, cols).T, scales.T, (group, 1))


@dataclasses.dataclass(frozen=True)
class PerExpert(_Layout):
  """One linear layer per expert and projection, `experts.{e}.{name}.weight` [out, in]."""

  gate: str = "gate_proj"
  up: str = "up_proj"
  down: str = "down_proj"

  def _layer(self, e: int, name: str) -> str:
    return f"experts.{e}.{name}"

  def _weight(self, e: int, name: str) -> str:
    return f"{self._layer(e, name)}.weight"

  def present(self, files, key) -> bool:
    return key(self._weight(0, self.gate)) in files

  def floats(self, files, key, e, d, f) -> dict:
    weight = lambda i, name, shape: files.get(key(self._weight(i, name)), shape).T
    gate_up = lambda i: np.concatenate(
      [weight(i, self.gate, (f, d)), weight(i, self.up, (f, d))], 1
    )
    return {
      "w_gate_up": np.stack([gate_up(i) for i in range(e)]),
      "w_down": np.stack([weight(i, self.down, (d, f)) for i in range(e)]),
    }

  def fp8(self, files, key, e, d, f, block) -> dict:
    read = lambda layer, shape: BlockScaled(
      *_read_fp8(files, f"{layer}.weight", shape, block), block
    )
    return self._quantized(read, key, e, d, f)

  def int4(self, files, key, e, d, f, group) -> dict:
    read = lambda layer, shape: _read_int4(files, f"{layer}.weight", shape, group)
    return self._quantized(read, key, e, d, f)

  def nvfp4(self, files, key, e, d, f) -> dict:
    def read(layer: str, shape: tuple[int, int]) -> BlockScaled:
      names = hf_nvfp4.stored_names(files, layer)
      if names is None:
        raise KeyError(
          f"checkpoint has no NVFP4 matrix scale at {layer} (ModelOpt's "
          f"{hf_nvfp4.MODELOPT.matrix_scale!r} or compressed-tensors' "
          f"{hf_nvfp4.COMPRESSED_TENSORS.matrix_scale!r})"
        )
      return hf_nvfp4.read_nvfp4(files, layer, shape, names)

    return self._quantized(read, key, e, d, f)

  def _quantized(self, read, key, e: int, d: int, f: int) -> dict:
    """`w_gate_up` and `w_down` of `BlockScaled` matrices `read(layer, [out, in])` gives,
    one per expert and projection ([in, out]; gate and up side by side)."""
    matrices = lambda name, shape: [read(key(self._layer(i, name)), shape) for i in range(e)]
    gate_up = [
      _on_host(np.concatenate, g, u, axis=-1)
      for g, u in zip(matrices(self.gate, (f, d)), matrices(self.up, (f, d)), strict=True)
    ]
    down = matrices(self.down, (d, f))
    return {"w_gate_up": _on_host(np.stack, *gate_up), "w_down": _on_host(np.stack, *down)}


def _on_host(join, *matrices: BlockScaled, **kwargs) -> BlockScaled:
  """`join` (np.concatenate, np.stack) of the matrices' leaves, leaf by leaf, in host memory
  (a checkpoint's experts pass no device on their way)."""
  return jax.tree.map(
    lambda *leaves: join([np.asarray(leaf) for leaf in leaves], **kwargs), *matrices
  )


@dataclasses.dataclass(frozen=True)
class Fused(_Layout):
  """3-D tensors of all experts: `gate_up` [E, 2F, D] and `down` [E, D, F] (transformers'
  [E, out, in]; [E, in, out] with `input_major`), gate and up as halves or, `interleaved`,
  alternating columns (GPT-OSS); biases at `{gate_up}_bias` and `{down}_bias` if stored."""

  gate_up: str = "experts.gate_up_proj"
  down: str = "experts.down_proj"
  input_major: bool = False
  interleaved: bool = False
  marked_transposed: bool = False  # transformers marks the module `is_transposed` (PEFT reads)

  def present(self, files, key) -> bool:
    return key(self.gate_up) in files or key(f"{self.gate_up}_blocks") in files

  def floats(self, files, key, e, d, f) -> dict:
    gate_up, down = files.get(key(self.gate_up))[:e], files.get(key(self.down))[:e]
    if not self.input_major:
      gate_up, down = gate_up.transpose(0, 2, 1), down.transpose(0, 2, 1)
    if gate_up.shape != (e, d, 2 * f) or down.shape != (e, f, d):
      raise ValueError(
        f"{key('experts')}: fused gate_up {gate_up.shape} / down {down.shape}, expected "
        f"{(e, d, 2 * f)} / {(e, f, d)}"
      )
    biases = self._biases(files, key, e)
    return {"w_gate_up": halves(gate_up, self.interleaved), "w_down": down, **biases}

  def _biases(self, files, key, e: int) -> dict:
    if key(f"{self.gate_up}_bias") not in files:
      return {}
    return {
      "b_gate_up": halves(files.get(key(f"{self.gate_up}_bias"))[:e], self.interleaved),
      "b_down": files.get(key(f"{self.down}_bias"))[:e],
    }

  def fp8(self, files, key, e, d, f, block) -> dict:
    if self.input_major or self.interleaved:
      super().fp8(files, key, e, d, f, block)
    return {
      "w_gate_up": BlockScaled(*_read_fp8(files, key(self.gate_up), (e, 2 * f, d), block), block),
      "w_down": BlockScaled(*_read_fp8(files, key(self.down), (e, d, f), block), block),
    }

  def mxfp4(self, files, key, e, d, f) -> dict:
    """GPT-OSS's MXFP4: `{name}_blocks` [E, out, in/32, 16] uint8 and `{name}_scales`
    [E, out, in/32] e8m0, as `BlockScaled` [E, in, out] with scales [E, in/32, out]."""

    def matrix(name: str, rows: int, cols: int) -> BlockScaled:
      blocks = files.get_raw(key(f"{name}_blocks"), (e, rows, cols // 32, 16))
      scales = files.get_raw(key(f"{name}_scales"), (e, rows, cols // 32))
      values = unpack_mxfp4(np.asarray(blocks)).transpose(0, 2, 1)
      scales = np.asarray(scales).view(ml_dtypes.float8_e8m0fnu).transpose(0, 2, 1)
      return BlockScaled(values, scales, (32, 1))

    gate_up = matrix(self.gate_up, 2 * f, d)
    split = lambda a: halves(a, self.interleaved)
    return {
      "w_gate_up": BlockScaled(split(gate_up.values), split(gate_up.scales), gate_up.block),
      "w_down": matrix(self.down, d, f),
      **self._biases(files, key, e),
    }


@dataclasses.dataclass(frozen=True)
class Flat(_Layout):
  """DBRX: (gate, up, down) tensors of [E * F, D] each (down stored transposed)."""

  gate: str
  up: str
  down: str

  def present(self, files, key) -> bool:
    return key(self.gate) in files

  def floats(self, files, key, e, d, f) -> dict:
    gate, up, down = (files.get(key(name), (e * f, d)) for name in (self.gate, self.up, self.down))
    gate_up = np.concatenate([gate.reshape(e, f, d), up.reshape(e, f, d)], axis=1)
    return {"w_gate_up": gate_up.transpose(0, 2, 1), "w_down": down.reshape(e, f, d)}


# transformers 5 saves fused experts; checkpoints on the Hub hold per-expert layers.
_FUSED_OR_PER_EXPERT = (Fused(), PerExpert())
_W1_W3_W2 = (Fused(), PerExpert("w1", "w3", "w2"))  # Mixtral's names of gate, up and down


# Which decoder layers are MoE: (config.json, layer index, number of layers) -> bool, each
# family's rule as transformers builds its model (with its config class's defaults).
LayerRule = Callable[[dict, int, int], bool]


def _every_layer(hf: dict, layer: int, layers: int) -> bool:
  return True


def _after_dense(first_dense_default: int) -> LayerRule:
  """DeepSeek's: the layers from `first_k_dense_replace` on (every `moe_layer_freq`-th)."""

  def rule(hf: dict, layer: int, layers: int) -> bool:
    first = Read("first_k_dense_replace", first_dense_default)(hf)
    return layer >= first and layer % Read("moe_layer_freq", 1)(hf) == 0

  return rule


def _qwen_sparse_step(hf: dict, layer: int, layers: int) -> bool:
  """Qwen's: every `decoder_sparse_step`-th layer, but those in `mlp_only_layers`."""
  dense = Read("mlp_only_layers", [])(hf)
  return layer not in dense and (layer + 1) % Read("decoder_sparse_step", 1)(hf) == 0


def _ernie_interval(hf: dict, layer: int, layers: int) -> bool:
  """ERNIE's: every `moe_layer_interval`-th layer from `moe_layer_start_index` to
  `moe_layer_end_index` (-1: the last), inclusive."""
  end = Read("moe_layer_end_index", -1)(hf)
  end = layers - 1 if end == -1 else end
  start = Read("moe_layer_start_index", 1)(hf)
  return (layer + 1) % Read("moe_layer_interval", 1)(hf) == 0 and start <= layer <= end


def _after_dense_layers(hf: dict, layer: int, layers: int) -> bool:
  """LFM2-MoE's: the layers from `num_dense_layers` on."""
  return layer >= Read("num_dense_layers", 2)(hf)


def _jamba_period(hf: dict, layer: int, layers: int) -> bool:
  """Jamba's: layer % `expert_layer_period` == `expert_layer_offset`."""
  return layer % Read("expert_layer_period", 2)(hf) == Read("expert_layer_offset", 1)(hf)


def _llama4_interleave(hf: dict, layer: int, layers: int) -> bool:
  """Llama 4's: `moe_layers`, else every `interleave_moe_layer_step`-th layer."""
  step = Read("interleave_moe_layer_step", 1)(hf)
  return layer in Read("moe_layers", range(step - 1, layers, step))(hf)


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: where an MoE layer's weights are, and how its config reads.

  Attributes:
    block: the MoE block's key prefix, with `{layer}`.
    router: the router's [E (+ Z), D] weight, relative to the block.
    options: `MoEConfig` field -> a `Read` of config.json, or a fixed value (sizes first).
    experts: the layouts its experts may be stored in, tried in order (the last when none
      is found, so that its missing tensor is named).
    shared: the shared experts' key prefix (gate_proj, up_proj, down_proj), or None.
    shared_sizes: how config.json gives them (`Shared`), or None.
    router_bias: the router's bias key, or None.
    selection_bias: the selection-only bias key (DeepSeek's `e_score_correction_bias`).
    shared_gate: the shared experts' [1, D] gate weight key, or None.
    derived: config.json -> further options no single key gives, or None.
    layers: the number of decoder layers.
    moe_layer: which decoder layers are MoE layers (`LayerRule`; the others are dense).
    module: the block's module path in transformers' loaded model, with `{layer}`, where
      transformers renames the checkpoint's `block` as it loads (Mixtral's
      `block_sparse_moe` is its `mlp`); None where they agree. PEFT names adapters after
      the loaded modules.
  """

  block: str
  router: str
  options: dict[str, Read | Any]
  experts: tuple[_Layout, ...] = _FUSED_OR_PER_EXPERT
  shared: str | None = None
  shared_sizes: Shared | None = None
  router_bias: str | None = None
  selection_bias: str | None = None
  shared_gate: str | None = None
  derived: Callable[[dict], dict] | None = None
  layers: Read = Read(("num_hidden_layers", "n_layers"))
  moe_layer: LayerRule = _every_layer
  module: str | None = None

  def loaded_block(self, layer: int) -> str:
    """The block's module path in transformers' loaded model (`module`, else `block`)."""
    return (self.module or self.block).format(layer=layer)

  def config_options(self, hf: dict) -> dict:
    """The `MoEConfig` keyword arguments of this family's config.json."""
    options = {name: v(hf) if isinstance(v, Read) else v for name, v in self.options.items()}
    options.update(self.shared_sizes.options(hf) if self.shared_sizes else {})
    return {**options, **(self.derived(hf) if self.derived else {})}


def _sizes(experts: str | tuple[str, ...], top_k: str, width: str) -> dict:
  """The options of E, K and F, read from these keys."""
  return dict(num_experts=Read(experts), top_k=Read(top_k), intermediate_size=Read(width))


def _first(value):
  """Hunyuan stores some values as one per layer: the first."""
  return value if isinstance(value, int) else value[0]


def _dbrx_renormalize(p) -> bool:
  """DBRX's `moe_normalize_expert_weights` p: None (no renormalization) or 1 (by the sum)."""
  if p not in (None, 1, 1.0):
    raise NotImplementedError(
      f"DBRX moe_normalize_expert_weights={p}: moejax renormalizes with the sum (p=1) only"
    )
  return p is not None


def _limited_groups(hf: dict) -> dict:
  """DeepSeek-V2's grouped top-k, only with `topk_method="group_limited_greedy"`."""
  if hf.get("topk_method") != "group_limited_greedy":
    return {}
  return dict(num_expert_groups=hf.get("n_group", 1), topk_groups=hf.get("topk_group", 1))


# fmt: off
_NORM_TOPK = Read("norm_topk_prob", False, bool)
_SCALING = Read("routed_scaling_factor", 1.0, float)
_MIXTRAL = dict(**_sizes("num_local_experts", "num_experts_per_tok", "intermediate_size"),
                renormalize=True)
_QWEN = dict(**_sizes(("num_experts", "num_local_experts"), "num_experts_per_tok",
                      "moe_intermediate_size"), renormalize=_NORM_TOPK)
_DEEPSEEK = dict(**_sizes("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
                 renormalize=_NORM_TOPK, routed_scaling_factor=_SCALING)
_DEEPSEEK_SHARED = Shared(Read("n_shared_experts", 0), Read("moe_intermediate_size"))
_DEEPSEEK_V3 = Family(
  "model.layers.{layer}.mlp", "gate.weight",
  dict(**_DEEPSEEK, scoring="sigmoid", use_routing_bias=True,
       num_expert_groups=Read("n_group", 1), topk_groups=Read("topk_group", 1)),
  shared="shared_experts", shared_sizes=_DEEPSEEK_SHARED,
  selection_bias="gate.e_score_correction_bias", moe_layer=_after_dense(3),
)
_QWEN_WITH_SHARED = Family(
  "model.layers.{layer}.mlp", "gate.weight", _QWEN,
  shared="shared_expert", shared_gate="shared_expert_gate.weight",
  shared_sizes=Shared(1, Read("shared_expert_intermediate_size", 0), gate=True),
  moe_layer=_qwen_sparse_step,
)
_BLOCK_SPARSE = "model.layers.{layer}.block_sparse_moe"
_MLP = "model.layers.{layer}.mlp"  # transformers 5's name of Mixtral's block_sparse_moe

FAMILIES: dict[str, Family] = {
  "mixtral": Family(_BLOCK_SPARSE, "gate.weight", _MIXTRAL, _W1_W3_W2, module=_MLP),
  "minimax": Family(_BLOCK_SPARSE, "gate.weight", _MIXTRAL, _W1_W3_W2, module=_MLP),
  "phimoe": Family(
    _BLOCK_SPARSE, "gate.weight",
    dict(**_sizes("num_local_experts", "num_experts_per_tok", "intermediate_size"),
         scoring="sparsemixer", sparsemixer_eps=Read("router_jitter_noise", 0.01)),
    _W1_W3_W2, module=_MLP,
  ),
  "granitemoe": Family(  # Mixtral's config fields and routing
    _BLOCK_SPARSE, "router.layer.weight", _MIXTRAL,
    (Fused("input_linear.weight", "output_linear.weight"),),
  ),
  "qwen2_moe": _QWEN_WITH_SHARED,
  "qwen3_next": _QWEN_WITH_SHARED,
  "qwen3_moe": Family(
    "model.layers.{layer}.mlp", "gate.weight", _QWEN, moe_layer=_qwen_sparse_step
  ),
  "olmoe": Family(
    "model.layers.{layer}.mlp", "gate.weight",
    {**_QWEN, "intermediate_size": Read("intermediate_size")},
  ),
  "deepseek_v2": Family(
    "model.layers.{layer}.mlp", "gate.weight",
    dict(**_DEEPSEEK, scoring="softmax", use_routing_bias=False),
    shared="shared_experts", shared_sizes=_DEEPSEEK_SHARED, derived=_limited_groups,
    moe_layer=_after_dense(0),
  ),
  "deepseek_v3": _DEEPSEEK_V3,
  "glm4_moe": dataclasses.replace(_DEEPSEEK_V3, moe_layer=_after_dense(1)),
  "gpt_oss": Family(
    "model.layers.{layer}.mlp", "router.weight",
    dict(**_sizes("num_local_experts", "num_experts_per_tok", "intermediate_size"),
         renormalize=True,  # softmax over the top-k logits
         router_bias=True, expert_bias=True, activation="swiglu_oai",
         swiglu_limit=Read("swiglu_limit", 7.0, float)),
    (Fused(input_major=True, interleaved=True, marked_transposed=True),),
    router_bias="router.bias",
  ),
  "llama4_text": Family(
    "model.layers.{layer}.feed_forward", "router.weight",
    dict(**_sizes("num_local_experts", "num_experts_per_tok", "intermediate_size"),
         scoring="sigmoid", apply_router_weight_on_input=True),
    (Fused(input_major=True),),
    shared="shared_expert", shared_sizes=Shared(1, Read("intermediate_size")),
    moe_layer=_llama4_interleave,
  ),
  "jamba": Family(
    "model.layers.{layer}.feed_forward", "router.weight",
    _sizes("num_experts", "num_experts_per_tok", "intermediate_size"),
    moe_layer=_jamba_period,
  ),
  "ernie4_5_moe": Family(
    "model.layers.{layer}.mlp", "gate.weight",
    dict(**_sizes("moe_num_experts", "moe_k", "moe_intermediate_size"),
         renormalize=True, use_routing_bias=True),
    shared="shared_experts",
    shared_sizes=Shared(Read("moe_num_shared_experts", 0), Read("moe_intermediate_size")),
    selection_bias="moe_statics.e_score_correction_bias", moe_layer=_ernie_interval,
  ),
  "hunyuan_v1_moe": Family(
    "model.layers.{layer}.mlp", "gate.wg.weight",
    dict(num_experts=Read("num_experts"), top_k=Read("moe_topk", convert=_first),
         intermediate_size=Read("intermediate_size"), renormalize=True),
    shared="shared_mlp",
    shared_sizes=Shared(Read("num_shared_expert", 1, _first), Read("intermediate_size"),
                        enabled=Read("use_mixed_mlp_moe", True)),
  ),
  "lfm2_moe": Family(
    "model.layers.{layer}.feed_forward", "gate.weight",
    dict(**_sizes("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
         scoring="sigmoid", use_routing_bias=Read("use_expert_bias", True, bool),
         renormalize=Read("norm_topk_prob", True, bool), routed_scaling_factor=_SCALING),
    _W1_W3_W2,
    selection_bias="expert_bias", moe_layer=_after_dense_layers,
  ),
  "dbrx": Family(
    "transformer.blocks.{layer}.ffn", "router.layer.weight",
    dict(**_sizes("ffn_config.moe_num_experts", "ffn_config.moe_top_k",
                  "ffn_config.ffn_hidden_size"),
         renormalize=Read("ffn_config.moe_normalize_expert_weights", None, _dbrx_renormalize)),
    (Flat("experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2"),),
  ),
  "kimi_k2": _DEEPSEEK_V3,  # Kimi-K2 (Thinking): DeepSeek-V3's MoE
  # Kimi-K2.5: DeepSeek-V3's MoE under a multimodal model (config in `text_config`)
  "kimi_k25": dataclasses.replace(
    _DEEPSEEK_V3, block="language_model.model.layers.{layer}.mlp",
    module="model.language_model.layers.{layer}.mlp",
  ),
  "longcat_flash": Family(
    "model.layers.{layer}.mlp", "router.classifier.weight",
    dict(**_sizes("n_routed_experts", "moe_topk", "expert_ffn_hidden_size"),
         num_zero_experts=Read("zero_expert_num", 0), use_routing_bias=True,
         router_bias=Read("router_bias", False, bool), routed_scaling_factor=_SCALING),
    router_bias="router.classifier.bias",
    selection_bias="router.e_score_correction_bias",
    layers=Read("num_layers"),  # each of two attentions and one MoE block
  ),
}
# fmt: on
# Multimodal model types whose text model's config.json fields sit in `text_config`.
NESTED_TEXT = ("kimi_k25",)


def _family(hf: dict) -> Family:
  return family_of(hf.get("model_type"))


def family_of(model_type: str | None) -> Family:
  """The `FAMILIES` row of a config.json `model_type`; ValueError listing them otherwise."""
  if model_type not in FAMILIES:
    raise ValueError(
      f"model_type={model_type!r} is not supported; moejax.hf reads {sorted(FAMILIES)}"
    )
  return FAMILIES[model_type]


def _activation(hf: dict) -> str:
  name = Read(("hidden_act", "ffn_config.ffn_act_fn.name"), "silu")(hf)
  if name not in _ACTIVATIONS:
    raise NotImplementedError(f"hidden_act={name!r}: moejax has {sorted(_ACTIVATIONS)}")
  return _ACTIVATIONS[name]


def config_from_hf(config: dict[str, Any] | str | Path, **overrides: Any) -> MoEConfig:
  """The `MoEConfig` of a model's MoE layers, from its `config.json`.

  Args:
    config: the parsed config.json (a dict), a transformers config (`model.config`: its
      `to_dict()`), or the path of a checkpoint folder or of its config.json; `model_type`
      picks the family (see `FAMILIES`).
    **overrides: further `MoEConfig` fields (chunk_size, dtype, dispatch, ...).

  A checkpoint's `quantization_config` sets `expert_quant`: `quant_method` "fp8" with a
  `weight_block_size` [out, in] is "fp8_block" with `quant_block_size` (in, out) (`scale_fmt`
  "ue8m0": power-of-two scales, checked on load); "mxfp4" is "mxfp4"; "compressed-tensors"
  with symmetric INT4 weights `pack-quantized` in groups is "int4_group" with
  `quant_block_size` (group, 1), its `nvfp4-pack-quantized` and "modelopt" with `quant_algo`
  "NVFP4" are "nvfp4" (activation quantization, if any, is not read: moejax computes W4A16).
  A multimodal config whose text model is nested (Kimi-K2.5's `text_config`) is read from
  its text model.

  Raises:
    ValueError: for an unsupported model_type (the message lists the supported ones).
    NotImplementedError: for quantization methods and activations moejax lacks.
    TypeError: `config` is none of the above.
  """
  config = config_json(config)
  options = {
    "hidden_size": Read(("hidden_size", "d_model"))(config),
    "activation": _activation(config),
    **_family(config).config_options(config),  # a family's own activation (GPT-OSS) wins
    **_quantization(config.get("quantization_config")),
  }
  return MoEConfig(**{**options, **overrides})


def config_json(config: dict[str, Any] | str | Path) -> dict[str, Any]:
  """A model's config.json as a dict (a nested multimodal model's text model: Kimi-K2.5's
  `text_config`), from what `config_from_hf` takes."""
  return _text_model(_config_dict(config))


def _config_dict(config) -> dict:
  """config.json as a dict, from a dict, a transformers config or a path."""
  if isinstance(config, dict):
    return config
  if isinstance(config, str | Path):
    path = Path(config)
    return json.loads((path / "config.json" if path.is_dir() else path).read_text())
  if callable(getattr(config, "to_dict", None)):
    return config.to_dict()
  raise TypeError(
    "config must be config.json as a dict, a transformers config or a path, got "
    f"{type(config).__name__}"
  )


def _text_model(hf: dict) -> dict:
  """config.json's fields of the text model: a `NESTED_TEXT` model's `text_config` (with the
  outer `quantization_config` where the text model has none, and the outer model_type, which
  names its family), else `hf` itself."""
  if hf.get("model_type") not in NESTED_TEXT:
    return hf
  text = dict(hf.get("text_config") or {})
  text.setdefault("quantization_config", hf.get("quantization_config"))
  return {**text, "model_type": hf["model_type"]}


def _quantization(quantization: dict | None) -> dict:
  """`MoEConfig` fields of a checkpoint's `quantization_config`."""
  if not quantization:
    return {}
  method = quantization.get("quant_method")
  if method == "fp8" and quantization.get("weight_block_size"):
    if quantization.get("scale_fmt") not in (None, "ue8m0"):
      raise ValueError(
        f"quantization_config.scale_fmt={quantization['scale_fmt']!r}: moejax reads fp8 "
        "block scales as float32 (scale_fmt absent) or powers of two ('ue8m0')"
      )
    out_block, in_block = quantization["weight_block_size"]
    return dict(expert_quant="fp8_block", quant_block_size=(int(in_block), int(out_block)))
  if method == "mxfp4":
    return dict(expert_quant="mxfp4")
  if method == "compressed-tensors":
    return _compressed_tensors(quantization)
  if method == "modelopt":
    return hf_nvfp4.modelopt_fields(quantization)
  raise NotImplementedError(
    f"quantization_config with quant_method={method!r} is not supported: moejax reads "
    "'fp8' with weight_block_size (fine-grained fp8), 'mxfp4', 'compressed-tensors' "
    "(pack-quantized INT4, nvfp4-pack-quantized) and 'modelopt' (NVFP4)"
  )


# compressed-tensors' formats moejax reads: weight quantization fields, field by field.
_COMPRESSED_TENSORS = {
  "pack-quantized": dict(num_bits=4, type="int", symmetric=True, strategy="group"),
  "nvfp4-pack-quantized": hf_nvfp4.COMPRESSED_TENSORS_WEIGHTS,
}


def _compressed_tensors(quantization: dict) -> dict:
  """The fields of compressed-tensors' `pack-quantized` symmetric INT4 weights with a scale
  per group (Kimi-K2-Thinking, K2.5, W4A16 releases) or its `nvfp4-pack-quantized` ones;
  ValueError naming any other field."""
  where = "quantization_config"
  groups = quantization.get("config_groups") or {}
  if len(groups) != 1:
    raise ValueError(f"{where}.config_groups: expected one group, got {sorted(groups)}")
  ((name, group),) = groups.items()
  form = group.get("format") or quantization.get("format")
  if form not in _COMPRESSED_TENSORS:
    raise ValueError(
      f"{where}.format={form!r}: moejax reads compressed-tensors {sorted(_COMPRESSED_TENSORS)}"
    )
  weights = group.get("weights") or {}
  for field, expected in _COMPRESSED_TENSORS[form].items():
    if weights.get(field) != expected:
      what = " (asymmetric INT4 has zero points)" if field == "symmetric" else ""
      raise ValueError(
        f"{where}.config_groups.{name}.weights.{field}={weights.get(field)!r}, expected "
        f"{expected!r}{what}"
      )
  if form == "nvfp4-pack-quantized":  # activation scales, if any, are not read (W4A16)
    return dict(expert_quant="nvfp4")
  if weights.get("actorder") == "group":
    raise ValueError(
      f"{where}.config_groups.{name}.weights.actorder='group' (a per-input g_idx) is not read"
    )
  size = weights.get("group_size")
  if size not in INT4_GROUP_SIZES:
    raise ValueError(
      f"{where}.config_groups.{name}.weights.group_size={size!r}, expected one of "
      f"{INT4_GROUP_SIZES}"
    )
  if group.get("input_activations") is not None:
    raise NotImplementedError(
      f"{where}.config_groups.{name}.input_activations: quantized activations are not read "
      "(moejax computes in float: W4A16)"
    )
  return dict(expert_quant="int4_group", quant_block_size=(int(size), 1))


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
    `MoEParams` in the config's `param_dtype` (quantized experts kept as stored), without
    LoRA adapters whatever `config.lora_rank` (`load_lora` reads a PEFT adapter's).

  Raises:
    KeyError: a tensor the layer needs is missing (the message names the key).
    ValueError: a tensor has another shape than the config implies, or the family is unknown.
    NotImplementedError: a quantized layout moejax does not read (named).
  """
  path = Path(path)
  hf = _text_model(json.loads((path / "config.json").read_text()))
  family = _family(hf)
  config = config_from_hf(hf) if config is None else config
  block = family.block.format(layer=layer)
  quantization = hf.get("quantization_config") or {}
  with SafetensorsFiles(path, quantization.get("weight_block_size")) as files:
    values = _read_layer(files, block, family, config)
  if quantization.get("scale_fmt") == "ue8m0":
    _check_powers_of_two(values, block)
  dtype = np.dtype(config.param_dtype)
  as_stored = lambda v: v if is_block_scaled(v) else np.asarray(v).astype(dtype)
  params = MoEParams(**{name: as_stored(value) for name, value in values.items()})
  if dequantize and config.expert_quant is not None:
    config = dataclasses.replace(config, expert_quant=None)
    params = params._replace(
      **{name: np.asarray(v.dequantize(dtype)) for name, v in values.items() if is_block_scaled(v)}
    )
  try:  # the base weights only: adapters come from `load_lora` (or `moejax.lora.init_like`)
    check_params(params, dataclasses.replace(config, lora_rank=0))
  except ValueError as error:
    raise ValueError(f"read from {block}: {error}") from None
  if mesh is None:
    return params
  check_mesh(mesh, config)
  place = lambda value, spec: jax.make_array_from_callback(
    value.shape, placement(mesh, spec), value.__getitem__
  )  # each device gets only its slice
  return map_params(place, LayerSpecs.from_config(config).params(params), params)


def moe_layers(config: dict[str, Any] | str | Path) -> tuple[int, ...]:
  """The decoder layers of a model that are MoE layers, by its family's rule (`Family.moe_layer`:
  DeepSeek's `first_k_dense_replace`, Qwen's `decoder_sparse_step` and `mlp_only_layers`,
  Llama 4's `moe_layers` / `interleave_moe_layer_step`, ERNIE's start, end and interval,
  LFM2-MoE's `num_dense_layers`, Jamba's period and offset; every layer for the others), with
  transformers' defaults for absent keys.

  Args:
    config: as for `config_from_hf` (config.json as a dict, a transformers config, a path).

  >>> moe_layers({"model_type": "deepseek_v3", "num_hidden_layers": 5, "first_k_dense_replace": 3})
  (3, 4)
  """
  hf = config_json(config)
  family = _family(hf)
  layers = family.layers(hf)
  return tuple(layer for layer in range(layers) if family.moe_layer(hf, layer, layers))


def load_stack(
  path: str | Path,
  config: MoEConfig | None = None,
  *,
  layers: Sequence[int] | None = None,
  mesh: Mesh | None = None,
  dequantize: bool = False,
  progress: bool = True,
) -> MoEParams:
  """Every MoE layer of a checkpoint, stacked for a scanned stack of layers: `load_layer` for
  each of `moe_layers(path)`, in order, each parameter with a leading layer axis [L, ...].

  Args:
    path, config, dequantize: as for `load_layer` (quantized experts stay quantized unless
      `dequantize`).
    layers: the decoder layers to stack, in this order (e.g. one pipeline stage's); None:
      `moe_layers(path)`.
    mesh: place the stack on this mesh as it loads, each layer's slice written into a stack
      whose layer axis is on no mesh axis (the rest as `MoELayer` lays out one layer: experts
      split over the expert axis): devices hold the stack and one layer at a time, the host
      one layer's tensors; None gives host NumPy arrays.
    progress: show a progress bar (one step per layer).

  Returns:
    `MoEParams` [L, ...] of the L layers, in order.

  Raises:
    What `load_layer` raises, naming the layer's block.
  """
  from tqdm import tqdm  # imported here: `moejax.hf` needs it for this progress bar only

  layers = moe_layers(path) if layers is None else tuple(layers)
  config = config_from_hf(path) if config is None else config
  stack = None
  for position, layer in enumerate(tqdm(layers, desc="MoE layers", disable=not progress)):
    params = load_layer(path, layer, config, mesh=mesh, dequantize=dequantize)
    stack = _empty_stack(params, len(layers)) if stack is None else stack
    stack = jax.tree.map(functools.partial(_put_layer, position=position), stack, params)
  return stack


def _empty_stack(params: MoEParams, layers: int) -> MoEParams:
  """Room for `layers` layers like `params`: a leading layer axis on no mesh axis."""

  def empty(leaf):
    if not isinstance(leaf, jax.Array):
      return np.empty((layers, *leaf.shape), leaf.dtype)
    spec = (None, *leaf.sharding.spec)
    sharding = jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec(*spec))
    zeros = functools.partial(jax.numpy.zeros, (layers, *leaf.shape), leaf.dtype)
    return jax.jit(zeros, out_shardings=sharding)()

  return jax.tree.map(empty, params)


def _put_layer(stack, layer, position: int):
  """`stack[position] = layer`, in place (on devices: the stack's buffer donated)."""
  if not isinstance(stack, jax.Array):
    stack[position] = layer
    return stack
  return _set_layer(stack, layer, position)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack: jax.Array, layer: jax.Array, position: jax.Array) -> jax.Array:
  return stack.at[position].set(layer)


def _check_powers_of_two(values: dict, block: str) -> None:
  """Raises ValueError unless every quantized weight's scales are powers of two (an fp8
  checkpoint with `scale_fmt: "ue8m0"`)."""
  for name, value in values.items():
    if is_block_scaled(value):
      scales = np.asarray(value.scales, np.float32)
      if not np.all((scales > 0) & (np.frexp(scales)[0] == 0.5)):
        raise ValueError(
          f"{block}: {name}'s scales are not all powers of two, as scale_fmt='ue8m0' says"
        )


def _read_layer(files: SafetensorsFiles, block: str, family: Family, config: MoEConfig) -> dict:
  """The layer's parameters as float32 NumPy arrays (or `BlockScaled`) in moejax's layout."""
  d, f, e = config.hidden_size, config.intermediate_size, config.num_experts
  outputs = config.num_router_outputs
  key = lambda name: f"{block}.{name}"
  values = {"router_kernel": files.get(key(family.router), (outputs, d)).T}
  if family.router_bias and config.router_bias:
    values["router_bias"] = files.get(key(family.router_bias), (outputs,))
  if family.selection_bias and config.use_routing_bias:
    bias = files.get(key(family.selection_bias))  # ERNIE stores it as [1, E]
    if bias.size != outputs:
      raise ValueError(
        f"{key(family.selection_bias)} has shape {bias.shape}, expected {(outputs,)}"
      )
    values["routing_bias"] = bias.reshape(outputs)
  layout = next((lay for lay in family.experts if lay.present(files, key)), family.experts[-1])
  if config.expert_quant == "fp8_block":
    values.update(layout.fp8(files, key, e, d, f, config.quant_block))
  elif config.expert_quant == "mxfp4":
    values.update(layout.mxfp4(files, key, e, d, f))
  elif config.expert_quant == "int4_group":
    values.update(layout.int4(files, key, e, d, f, config.quant_block[0]))
  elif config.expert_quant == "nvfp4":
    values.update(layout.nvfp4(files, key, e, d, f))
  else:
    values.update(layout.floats(files, key, e, d, f))
  if config.has_shared_experts and family.shared:
    fs = config.shared_intermediate_size
    gate, up, down = (
      _float_linear(files, key(f"{family.shared}.{name}.weight"), shape, config)
      for name, shape in (("gate_proj", (fs, d)), ("up_proj", (fs, d)), ("down_proj", (d, fs)))
    )
    values["shared_w_gate_up"] = np.concatenate([gate.T, up.T], axis=1)
    values["shared_w_down"] = down.T
  if config.shared_expert_gate and family.shared_gate:
    values["shared_gate_kernel"] = files.get(key(family.shared_gate), (1, d)).T
  return values


def _float_linear(files: SafetensorsFiles, weight: str, shape, config: MoEConfig) -> np.ndarray:
  """A linear layer's [out, in] weight in float32: as stored, fp8 dequantized with its
  `scale_inv`, or a pack-quantized INT4 or an NVFP4 one (a checkpoint that quantizes it: its
  `ignore` list does not name it) dequantized."""
  layer = weight.removesuffix(".weight")
  nvfp4 = hf_nvfp4.stored_names(files, layer)
  if nvfp4 is not None:
    return np.asarray(hf_nvfp4.read_nvfp4(files, layer, shape, nvfp4).dequantize()).T
  if weight not in files and f"{weight}_packed" in files:
    return np.asarray(_read_int4(files, weight, shape, config.quant_block[0]).dequantize()).T
  return files.get(weight, shape)


def unpack_mxfp4(blocks: np.ndarray) -> np.ndarray:
  """[..., n, 16] uint8 -> [..., 32 n] float4_e2m1fn: value 2j of each block is byte j's low
  nibble, 2j + 1 its high nibble (GPT-OSS's `*_blocks`).

  >>> unpack_mxfp4(np.array([[0x21, 0xF7] + [0] * 14], np.uint8)).astype(float)[:4].tolist()
  [0.5, 1.0, 6.0, -6.0]
  """
  return hf_nvfp4.unpack_fp4(blocks).reshape(*blocks.shape[:-2], -1)


# PEFT adapters of these layers: `moejax.hf_lora` (it reads `FAMILIES`, so it comes last).
from moejax.hf_lora import LoadedAdapters, load_lora, save_lora  # noqa: E402, F401
