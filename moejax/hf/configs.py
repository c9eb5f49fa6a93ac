"""A model's config.json -> `MoEConfig` (its family's keys and its `quantization_config`),
and which of its decoder layers are MoE layers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernels_pallas.formats import FORMATS
from moejax.config import MoEConfig
from moejax.hf import nvfp4
from moejax.hf.families import NESTED_TEXT, Family, Read, family_of

_ACTIVATIONS = {
  "silu": "silu",
  "swish": "silu",
  "gelu": "gelu",
  "gelu_pytorch_tanh": "gelu_tanh",
  "gelu_new": "gelu_tanh",
}


def _activation(hf: dict) -> str:
  keys = ("hidden_act", "hidden_activation", "ffn_config.ffn_act_fn.name", "activation_function")
  name = Read(keys, "silu")(hf)
  if name not in _ACTIVATIONS:
    raise NotImplementedError(f"hidden_act={name!r}: moejax has {sorted(_ACTIVATIONS)}")
  return _ACTIVATIONS[name]


def config_from_hf(
  config: dict[str, Any] | str | Path,
  *,
  layer: int | None = None,
  part: str | None = None,
  **overrides: Any,
) -> MoEConfig:
  """The `MoEConfig` of a model's MoE layers, from its `config.json`.

  Args:
    config: the parsed config.json (a dict), a transformers config (`model.config`: its
      `to_dict()`), or the path of a checkpoint folder or of its config.json; `model_type`
      picks the family (see `FAMILIES`).
    layer: the config of this MoE layer (decoder layer index); None: the one config of every
      MoE layer. Needed where a family's layers differ (Step-3.7's per-layer clamps:
      `Family.layer_options`); elsewhere every layer has the same config.
    part: the MoE layer of a block that holds one per token type (ERNIE-4.5-VL's "text" and
      "vision": `Family.parts`); None for the others.
    **overrides: further `MoEConfig` fields (chunk_size, dtype, dispatch, ...).

  A checkpoint's `quantization_config` sets `expert_quant`: `quant_method` "fp8" with a
  `weight_block_size` [out, in] is "fp8_block" with `quant_block_size` (in, out) (`scale_fmt`
  "ue8m0": power-of-two scales, checked on load); "mxfp4" is "mxfp4"; "compressed-tensors"
  with symmetric INT4 weights `pack-quantized` in groups is "int4_group" with
  `quant_block_size` (group, 1), its `nvfp4-pack-quantized` and "modelopt" with `quant_algo`
  "NVFP4" are "nvfp4" (activation quantization, if any, is not read: moejax computes W4A16).
  A multimodal config whose text model is nested (Kimi-K2.5's `text_config`) is read from
  its text model. The checkpoint's dtype (`dtype`, or transformers 4's `torch_dtype`:
  "bfloat16", "float16" or "float32") is `param_dtype`, so a bf16 checkpoint loads as bf16;
  the compute `dtype` stays float32 unless overridden (pass `param_dtype=` to store
  otherwise).

  Raises:
    ValueError: for an unsupported model_type (the message lists the supported ones); `layer`
      is not an MoE layer; `layer` is None and the MoE layers' configs differ (the message
      names two that do); `part` is not one of the family's parts (named).
    NotImplementedError: for quantization methods and activations moejax lacks.
    TypeError: `config` is none of the above.
  """
  config = config_json(config)
  family = family_of(config.get("model_type")).part(part)
  if layer is not None:
    check_moe_layer(config, family, layer)
  elif family.layer_options is not None and moe_layers(config):
    return one_config(config, moe_layers(config), part=part, **overrides)
  options = {
    "hidden_size": Read(("hidden_size", "d_model"))(config),
    "activation": _activation(config),
    # a family's own activation (GPT-OSS) wins, and a layer's own options (Step-3.7's clamps)
    **family.config_options(config),
    **(family.layer_options(config, layer) if family.layer_options else {}),
    **_quantization(config.get("quantization_config")),
    **({} if "param_dtype" in overrides else _param_dtype(config)),
  }
  return MoEConfig(**{**options, **overrides})


def one_config(
  config: dict[str, Any] | str | Path,
  layers: Sequence[int],
  *,
  part: str | None = None,
  **overrides: Any,
) -> MoEConfig:
  """The config every one of `layers` (MoE layers; of `part`) has, as `config_from_hf(config,
  layer=)` gives each: what one stack of them, or one `MoELayer` for all, is built with.

  Raises:
    ValueError: `layers` is empty, or two of the layers' configs differ (the message names
      them and the fields).
  """
  hf = config_json(config)
  if not layers:
    raise ValueError("layers is empty: name the MoE layers whose config to read")
  (first, chosen), *others = (
    (layer, config_from_hf(hf, layer=layer, part=part, **overrides)) for layer in layers
  )
  for layer, other in others:
    if other != chosen:
      fields = [
        name
        for name in MoEConfig.__dataclass_fields__
        if getattr(other, name) != getattr(chosen, name)
      ]
      raise ValueError(
        f"the MoE layers {first} and {layer} of this {hf.get('model_type')} checkpoint have "
        f"different configs ({', '.join(fields)}): pass layer= for one layer's config, and "
        "stack the layers that agree (load_stack's layers=)"
      )
  return chosen


_CHECKPOINT_DTYPES = ("bfloat16", "float16", "float32")


def _param_dtype(config: dict[str, Any]) -> dict[str, str]:
  """{"param_dtype": the checkpoint's dtype} where config.json states one ("torch.bfloat16"
  as some writers spell it, too), else {} ("auto", absent)."""
  stated = config.get("dtype", config.get("torch_dtype"))
  if stated is None or stated == "auto":
    return {}
  name = str(stated).removeprefix("torch.")
  if name not in _CHECKPOINT_DTYPES:
    raise ValueError(
      f"config.json's dtype {stated!r} is none of {_CHECKPOINT_DTYPES}: pass param_dtype= to "
      "choose the storage dtype"
    )
  return {"param_dtype": name}


def config_json(config: dict[str, Any] | str | Path) -> dict[str, Any]:
  """A model's config.json as a dict (a nested multimodal model's text model: Kimi-K2.5's
  `text_config`), from what `config_from_hf` takes."""
  return text_model(_config_dict(config))


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


def text_model(hf: dict) -> dict:
  """config.json's fields of the text model: a `NESTED_TEXT` model's nested ones (with the
  outer `quantization_config` where the text model has none, and the outer model_type, which
  names its family; its own fields where it has none, as Dots3-Note publishes), else `hf`
  itself."""
  nested = Read(NESTED_TEXT.get(hf.get("model_type"), "text_config"), None)(hf)
  if hf.get("model_type") not in NESTED_TEXT or not nested:
    return hf
  text = dict(nested)
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
    return nvfp4.modelopt_fields(quantization)
  raise NotImplementedError(
    f"quantization_config with quant_method={method!r} is not supported: moejax reads "
    "'fp8' with weight_block_size (fine-grained fp8), 'mxfp4', 'compressed-tensors' "
    "(pack-quantized INT4, nvfp4-pack-quantized) and 'modelopt' (NVFP4)"
  )


# compressed-tensors' formats moejax reads: weight quantization fields, field by field.
_COMPRESSED_TENSORS = {
  "pack-quantized": dict(num_bits=4, type="int", symmetric=True, strategy="group"),
  "nvfp4-pack-quantized": nvfp4.COMPRESSED_TENSORS_WEIGHTS,
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
  if size not in FORMATS["int4_group"].group_sizes:
    raise ValueError(
      f"{where}.config_groups.{name}.weights.group_size={size!r}, expected one of "
      f"{FORMATS['int4_group'].group_sizes}"
    )
  if group.get("input_activations") is not None:
    raise NotImplementedError(
      f"{where}.config_groups.{name}.input_activations: quantized activations are not read "
      "(moejax computes in float: W4A16)"
    )
  return dict(expert_quant="int4_group", quant_block_size=(int(size), 1))


def moe_layers(config: dict[str, Any] | str | Path) -> tuple[int, ...]:
  """The decoder layers of a model that are MoE layers, by its family's rule (`Family.moe_layer`:
  DeepSeek's `first_k_dense_replace`, Qwen's `decoder_sparse_step` and `mlp_only_layers`,
  Llama 4's `moe_layers` / `interleave_moe_layer_step`, ERNIE's start, end and interval,
  LFM2-MoE's `num_dense_layers`, Jamba's period and offset, `mlp_layer_types` where a family's
  config lists each layer's kind; every layer for the others), with
  transformers' defaults for absent keys.

  Args:
    config: as for `config_from_hf` (config.json as a dict, a transformers config, a path).

  >>> moe_layers({"model_type": "deepseek_v3", "num_hidden_layers": 5, "first_k_dense_replace": 3})
  (3, 4)
  """
  hf = config_json(config)
  family = family_of(hf.get("model_type"))
  layers = family.layers(hf)
  return tuple(layer for layer in range(layers) if family.moe_layer(hf, layer, layers))


def check_moe_layer(hf: dict, family: Family, layer: int) -> None:
  """Raises ValueError unless decoder layer `layer` is one of the model's MoE layers (where
  config.json gives its depth; without it the tensors' names decide)."""
  try:
    depth = family.layers(hf)
  except KeyError:
    return
  if 0 <= layer < depth and family.moe_layer(hf, layer, depth):
    return
  moe = [index for index in range(depth) if family.moe_layer(hf, index, depth)]
  listed = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in _runs(moe))
  what = "a dense layer" if 0 <= layer < depth else f"outside the model's {depth} layers"
  raise ValueError(
    f"layer {layer} is not an MoE layer of this {hf.get('model_type')} checkpoint ({what}); "
    f"its MoE layers are {listed or 'none'} (moejax.hf.moe_layers)"
  )


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
  """Sorted indices as (first, last) runs of consecutive ones: [1, 2, 3, 5] -> [(1, 3), (5, 5)]."""
  runs: list[tuple[int, int]] = []
  for index in indices:
    if runs and runs[-1][1] == index - 1:
      runs[-1] = (runs[-1][0], index)
    else:
      runs.append((index, index))
  return runs
