"""Hugging Face checkpoints: a model's `config.json` -> `MoEConfig`, one MoE layer -> `MoEParams`,
every MoE layer -> a stack, and PEFT adapters both ways. NumPy reads the files (no torch).

- `families`: `FAMILIES`, one `Family` row per `model_type` (where the MoE block's tensors
  are, which config.json keys give its options, which decoder layers are MoE layers).
- `layouts`: how a family stores its experts (`PerExpert`, `Fused`, `Flat`, `Stacked`,
  `Neurons`), float or quantized, and the readers of each format's tensors (`nvfp4` holds
  NVFP4's).
- `configs`: `config_from_hf`, `one_config` (of layers that may differ), `config_json`,
  `moe_layers`.
- `loading`: `load_layer`, `load_stack`, `load_hash_routes`.
- `peft`: `load_lora`, `save_lora` (PEFT adapter folders).
- `zaya`: `load_zaya_router`, `zaya_router_logits` (ZAYA's router, which the model runs).
- `safetensors_files`: `SafetensorsFiles`, the files of a checkpoint folder.

>>> len(FAMILIES), sorted(FAMILIES)[:3]
(89, ['afmoe', 'aria_text', 'axk1'])
"""

from moejax.hf.configs import config_from_hf, config_json, moe_layers, one_config
from moejax.hf.families import FAMILIES, NESTED_TEXT, Family, Read, Shared, family_of
from moejax.hf.layouts import (
  Flat,
  Fused,
  Neurons,
  PerExpert,
  Stacked,
  halves,
  unpack_int4,
  unpack_mxfp4,
)
from moejax.hf.loading import load_hash_routes, load_layer, load_stack
from moejax.hf.peft import LoadedAdapters, load_lora, save_lora
from moejax.hf.zaya import ZayaRouter, load_zaya_router, zaya_router_logits

__all__ = [
  "FAMILIES",
  "NESTED_TEXT",
  "Family",
  "Flat",
  "Fused",
  "LoadedAdapters",
  "Neurons",
  "PerExpert",
  "Read",
  "Shared",
  "Stacked",
  "ZayaRouter",
  "config_from_hf",
  "config_json",
  "family_of",
  "halves",
  "load_hash_routes",
  "load_layer",
  "load_lora",
  "load_stack",
  "load_zaya_router",
  "moe_layers",
  "one_config",
  "save_lora",
  "unpack_int4",
  "unpack_mxfp4",
  "zaya_router_logits",
]
