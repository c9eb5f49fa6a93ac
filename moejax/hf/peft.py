"""PEFT LoRA adapters of a Hugging Face MoE layer: read into `ExpertLoRA`, written back.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, keys
`base_model.model.{module}.lora_A.weight` / `.lora_B.weight`. PEFT 0.21 writes the experts of
transformers' MoE blocks in one of two layouts (`layout=`):

- "fused": `target_parameters` on transformers 5's 3-D expert parameters (PEFT's
  `ParamWrapper`): per parameter lora_A [r·E, in] and lora_B [out, r·E]; expert e's adapter is
  A.reshape(E, r, in)[e] and B.reshape(out, r, E)[:, :, e]. Two parameters of one module nest
  (`experts.base_layer.lora_A` is the first target, `experts.lora_A` the second). Keys name
  the modules of transformers' loaded model, where some families' blocks are renamed
  (Mixtral's, PhiMoE's and MiniMax's `block_sparse_moe` is `mlp`: `hf.Family.module`). PEFT reads
  a parameter as [E, out, in] unless the module is marked `is_transposed` (GPT-OSS); Llama 4
  stores [E, in, out] unmarked, so its A and B act the other way round (`Fused.marked_transposed`).
- "per_expert": `target_modules` on one linear layer per expert and projection
  (transformers 4's modules; PEFT converts such files for transformers 5's fused experts):
  lora_A [r, in], lora_B [out, r], at the checkpoint's module names.

moejax has one rank for both projections and fuses gate and up: a per-expert gate and up
adapter of ranks r1, r2 become one of rank r1 + r2 (A's columns side by side, B
block-diagonal, gate's first), a smaller rank is padded with zeros, and where a module's PEFT
scale (alpha / r, rsLoRA alpha / sqrt(r), per `alpha_pattern`) differs from the config's, the
ratio is folded into its B: the adapted weights are exactly PEFT's. Shared experts' adapters
are per-linear-layer in both layouts.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from moejax import files
from moejax.call_record import call_record
from moejax.config import MoEConfig
from moejax.hf.families import beside, family_of
from moejax.hf.layouts import Fused, PerExpert, halves
from moejax.hf.safetensors_files import SafetensorsFiles
from moejax.inputs import check_adapters, check_mesh
from moejax.lora import ExpertLoRA, SharedLoRA
from moejax.meshes import named_sharding
from moejax.params import MoEParams
from moejax.sharding import map_params

PREFIX = "base_model.model."
LAYOUTS = ("fused", "per_expert")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # the shared experts' linear layers


class LoadedAdapters(NamedTuple):
  """A layer's adapters as read from a PEFT directory.

  Attributes:
    config: the layer's config with the adapters' rank and scale (`lora_rank`, `lora_alpha`,
      `lora_rslora`): pair it with these adapters.
    lora: the `ExpertLoRA` [E, ...] of the logical experts, float32 (on the mesh if given).
    shared_lora: the `SharedLoRA`, or None without shared experts (zeros where the file has
      none for them).
  """

  config: MoEConfig
  lora: ExpertLoRA
  shared_lora: SharedLoRA | None


@dataclasses.dataclass(frozen=True)
class _Pair:
  """One PEFT LoRA module as moejax's (a [..., in, r], b [..., r, out]) with PEFT's scale."""

  a: np.ndarray
  b: np.ndarray
  scale: float

  @property
  def rank(self) -> int:
    return self.a.shape[-1]


def _peft_scale(adapter_config: dict, module: str, rank: int) -> float:
  """PEFT's scale of `module`: alpha / r (rsLoRA alpha / sqrt r), alpha from `alpha_pattern`
  where a pattern matches the module's name as PEFT matches it, else `lora_alpha`."""
  alpha = adapter_config.get("lora_alpha", 8)
  for pattern, value in (adapter_config.get("alpha_pattern") or {}).items():
    if re.match(rf"(.*\.)?({pattern})$", module):
      alpha = value
      break
  return alpha / (rank**0.5 if adapter_config.get("use_rslora") else rank)


def _read_config(path: Path) -> dict:
  adapter_config = json.loads((path / "adapter_config.json").read_text())
  if adapter_config.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{path}: peft_type={adapter_config['peft_type']!r}, expected 'LORA'")
  for option in ("use_dora", "lora_bias", "fan_in_fan_out"):
    if adapter_config.get(option):
      raise NotImplementedError(f"{path}: {option}=True adapters are not read (plain LoRA only)")
  return adapter_config


def _checked(value: np.ndarray, key: str, shape: tuple[int, ...], what: str) -> np.ndarray:
  if value.shape != shape:
    raise ValueError(f"adapter tensor {key!r} has shape {value.shape}, expected {shape} ({what})")
  return value


def _linear_pair(files, adapter_config, module: str, d_in: int, d_out: int) -> _Pair:
  """A linear layer's adapter (A [r, in], B [out, r]) as moejax's pair."""
  key = f"{PREFIX}{module}"
  a, b = (np.asarray(files.get(f"{key}.lora_{x}.weight"), np.float32) for x in "AB")
  rank = a.shape[0]
  _checked(a, f"{key}.lora_A.weight", (rank, d_in), f"[r, in={d_in}]")
  _checked(b, f"{key}.lora_B.weight", (d_out, rank), f"[out={d_out}, r={rank}]")
  return _Pair(a.T, b.T, _peft_scale(adapter_config, module, rank))


def _stack(pairs: list[_Pair]) -> _Pair:
  if len({(p.rank, p.scale) for p in pairs}) != 1:
    raise ValueError("per-expert adapters of one projection must share a rank and an alpha")
  return _Pair(np.stack([p.a for p in pairs]), np.stack([p.b for p in pairs]), pairs[0].scale)


def _fused_gate_up(gate: _Pair, up: _Pair) -> _Pair:
  """Gate's and up's adapters as one of rank r1 + r2 on [gate | up] (B block-diagonal), the
  scales folded relative to gate's."""
  lead, r1, r2 = gate.a.shape[:-2], gate.rank, up.rank
  f_gate, f_up = gate.b.shape[-1], up.b.shape[-1]
  b = np.zeros((*lead, r1 + r2, f_gate + f_up), np.float32)
  b[..., :r1, :f_gate] = gate.b
  b[..., r1:, f_gate:] = up.b * (up.scale / gate.scale)
  return _Pair(np.concatenate([gate.a, up.a], axis=-1), b, gate.scale)


def _per_expert_pairs(files, adapter_config, block: str, layout, config) -> tuple[_Pair, _Pair]:
  e, d, f = config.num_experts, config.hidden_size, config.intermediate_size
  linear = lambda name, d_in, d_out: _stack(
    [
      _linear_pair(files, adapter_config, f"{block}.experts.{i}.{name}", d_in, d_out)
      for i in range(e)
    ]
  )
  gate_up = _fused_gate_up(linear(layout.gate, d, f), linear(layout.up, d, f))
  return gate_up, linear(layout.down, f, d)


def _wrapped_pairs(files, module: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
  """The (module key, A, B) of each `ParamWrapper` on `module`, outermost first."""
  pattern = re.compile(rf"{re.escape(PREFIX + module)}((?:\.base_layer)*)\.lora_A\.weight")
  found = sorted((m.group(1) for key in files.files if (m := pattern.fullmatch(key))), key=len)
  return [
    (
      f"{module}{nesting}",
      np.asarray(files.get(f"{PREFIX}{module}{nesting}.lora_A.weight"), np.float32),
      np.asarray(files.get(f"{PREFIX}{module}{nesting}.lora_B.weight"), np.float32),
    )
    for nesting in found
  ]


def _fused_pairs(files, adapter_config, block: str, layout, config) -> tuple[_Pair, _Pair]:
  """The experts' two adapters from `ParamWrapper`s, each told apart by its (in, out) as PEFT
  sees the parameter (never the same for both: they would need F = 0)."""
  e, d, f = config.num_experts, config.hidden_size, config.intermediate_size
  swapped = layout.input_major and not layout.marked_transposed  # PEFT's in is moejax's out
  sides = {"gate_up": (d, 2 * f), "down": (f, d)}
  if swapped:
    sides = {name: (d_out, d_in) for name, (d_in, d_out) in sides.items()}
  modules = {name: f"{block}.{param.rsplit('.', 1)[0]}" for name, param in
             (("gate_up", layout.gate_up), ("down", layout.down))}  # fmt: skip
  wrapped = {key: (a, b) for m in set(modules.values()) for key, a, b in _wrapped_pairs(files, m)}
  pairs = {}
  for key, (a, b) in wrapped.items():
    name = next(
      (n for n, (d_in, d_out) in sides.items() if (a.shape[1], b.shape[0]) == (d_in, d_out)), None
    )
    if name is None or a.shape[0] % e or b.shape[1] != a.shape[0]:
      expected = " or ".join(f"{n}: A [r*{e}, {i}], B [{o}, r*{e}]" for n, (i, o) in sides.items())
      raise ValueError(
        f"adapter tensors {PREFIX}{key}.lora_A/B.weight have shapes {a.shape} / {b.shape}, "
        f"expected {expected}"
      )
    rank = a.shape[0] // e
    a3 = a.reshape(e, rank, a.shape[1])  # [E, r, in] as PEFT sees it
    b3 = b.reshape(b.shape[0], rank, e).transpose(2, 1, 0)  # [E, r, out]
    moejax_a, moejax_b = (b3.transpose(0, 2, 1), a3) if swapped else (a3.transpose(0, 2, 1), b3)
    if name == "gate_up":
      moejax_b = halves(moejax_b, layout.interleaved)
    parameter = f"{block}.{getattr(layout, name)}"  # PEFT matches alpha_pattern against it
    pairs[name] = _Pair(moejax_a, moejax_b, _peft_scale(adapter_config, parameter, rank))
  if "gate_up" not in pairs and "down" not in pairs:
    raise KeyError(
      f"no LoRA adapters for the experts of {block} in the adapter file (looked for "
      f"{PREFIX}{modules['gate_up']}[.base_layer].lora_A.weight)"
    )
  zeros = lambda d_in, d_out: _Pair(np.zeros((e, d_in, 1)), np.zeros((e, 1, d_out)), 1.0)
  return pairs.get("gate_up", zeros(d, 2 * f)), pairs.get("down", zeros(f, d))


def _shared_projections(family) -> tuple[str, ...]:
  """The loaded model's names of the shared experts' linear layers: gate, up and down, or a
  fused gate-up and down (Granite's, named as stored)."""
  return family.shared_names if family.shared_fused else _PROJECTIONS


def _shared_pairs(files, adapter_config, family, block: str, config) -> tuple[_Pair, _Pair]:
  d, fs = config.hidden_size, config.shared_intermediate_size
  names = _shared_projections(family)
  module = lambda name: beside(block, f"{family.shared}.{name}")
  if f"{PREFIX}{module(names[0])}.lora_A.weight" not in files:
    zeros = lambda d_in, d_out: _Pair(np.zeros((d_in, 1)), np.zeros((1, d_out)), 1.0)
    return zeros(d, 2 * fs), zeros(fs, d)
  sizes = ((d, 2 * fs), (fs, d)) if family.shared_fused else ((d, fs), (d, fs), (fs, d))
  *gate_up, down = (
    _linear_pair(files, adapter_config, module(name), d_in, d_out)
    for name, (d_in, d_out) in zip(names, sizes, strict=True)
  )
  return (gate_up[0] if family.shared_fused else _fused_gate_up(*gate_up)), down


def _at_rank(pair: _Pair, rank: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
  """(a, b) padded with zeros to `rank`, b times the ratio of its scale to `scale`."""
  pad = rank - pair.rank
  a = np.pad(pair.a, [(0, 0)] * (pair.a.ndim - 1) + [(0, pad)])
  b = np.pad(pair.b * (pair.scale / scale), [(0, 0)] * (pair.b.ndim - 2) + [(0, pad), (0, 0)])
  return a.astype(np.float32), b.astype(np.float32)


def load_lora(
  path: str | Path,
  layer: int,
  config: MoEConfig,
  *,
  model_type: str,
  mesh: Mesh | None = None,
) -> LoadedAdapters:
  """One MoE layer's LoRA adapters from a PEFT adapter directory, in either layout.

  Args:
    path: the directory (`adapter_config.json`, `adapter_model.safetensors`).
    layer: the decoder layer index, as for `moejax.hf.load_layer`.
    config: the layer's `MoEConfig` (its `lora_*` fields are replaced by the file's).
    model_type: the base model's config.json `model_type` (the family: where the block is,
      how its experts are stored).
    mesh: place the adapters as `MoELayer` does (over the expert group), or None for host
      NumPy arrays.

  Returns:
    `LoadedAdapters`: the config with the adapters' rank and scale, and the adapters.

  Raises:
    KeyError: the file holds no adapters for this layer's experts (another model or layer).
    ValueError: an adapter tensor's shape does not fit the config (named, with the expected).
    NotImplementedError: a family whose experts PEFT has no layout for (DBRX), or DoRA-style
      options.
  """
  path = Path(path)
  family = family_of(model_type).part(None)  # PEFT's names of a block with parts: not read
  adapter_config = _read_config(path)
  with SafetensorsFiles(path, stem="adapter_model") as files:
    fused, per_expert = _layouts(family, model_type)
    block = family.block.format(layer=layer)  # transformers 4's modules: the checkpoint's names
    per_expert_key = (
      f"{PREFIX}{block}.experts.0.{per_expert.gate}.lora_A.weight" if per_expert else None
    )
    if per_expert_key is not None and per_expert_key in files:
      experts = _per_expert_pairs(files, adapter_config, block, per_expert, config)
    elif fused is not None:
      block = family.loaded_block(layer)
      experts = _fused_pairs(files, adapter_config, block, fused, config)
    else:
      experts = _per_expert_pairs(files, adapter_config, block, per_expert, config)  # names the key
    shared = (
      _shared_pairs(files, adapter_config, family, block, config)
      if config.has_shared_experts and family.shared
      else ()
    )
  pairs = (*experts, *shared)
  rank, scale = max(p.rank for p in pairs), experts[0].scale
  config = dataclasses.replace(config, lora_rank=rank, lora_alpha=scale * rank, lora_rslora=False)
  lora = ExpertLoRA(*_at_rank(experts[0], rank, scale), *_at_rank(experts[1], rank, scale))
  shared_lora = (
    SharedLoRA(*_at_rank(shared[0], rank, scale), *_at_rank(shared[1], rank, scale))
    if shared
    else None
  )
  if mesh is not None:
    record = call_record(config, mesh)
    check_mesh(record)
    params = MoEParams(*[None] * len(MoEParams._fields))._replace(
      lora=lora, shared_lora=shared_lora
    )
    specs = record.specs.params(params)
    params = map_params(
      lambda leaf, spec: jax.device_put(leaf, named_sharding(mesh, spec)), specs, params
    )
    lora, shared_lora = params.lora, params.shared_lora
  return LoadedAdapters(config, lora, shared_lora)


def _layouts(family, model_type: str):
  """(the family's fused layout or None, its per-expert one or None); raises for a family
  with neither (DBRX's flat experts)."""
  fused = next((lay for lay in family.experts if isinstance(lay, Fused)), None)
  if fused is not None:  # PEFT names the modules in memory: transformers 5's, for every
    # family with fused experts (granitemoe's checkpoint keys `input_linear` are renamed)
    fused = dataclasses.replace(fused, gate_up=Fused.gate_up, down=Fused.down)
  per_expert = next((lay for lay in family.experts if isinstance(lay, PerExpert)), None)
  if fused is None and per_expert is None:
    raise NotImplementedError(
      f"model_type={model_type!r}: PEFT defines no adapter layout for its experts "
      f"({family.experts[0]}); moejax reads and writes {LAYOUTS}"
    )
  return fused, per_expert


def save_lora(
  path: str | Path,
  adapters: Mapping[int, MoEParams],
  config: MoEConfig,
  *,
  model_type: str,
  layout: str = "fused",
  overwrite: bool = False,
) -> None:
  """Writes layers' adapters as a PEFT adapter directory that `PeftModel.from_pretrained`
  loads onto the transformers model of `model_type`. Each file is written whole or not at
  all (a temporary name, then a rename).

  Args:
    path: the directory to write (created).
    adapters: decoder layer index -> that layer's `MoEParams` (its `lora`, `shared_lora`;
      logical experts, E of them).
    config: the layers' `MoEConfig` (with `lora_rank`).
    model_type: the base model's config.json `model_type`.
    layout: "fused" (`target_parameters` on the 3-D expert parameters, what PEFT 0.21 writes
      for transformers 5) or "per_expert" (one adapter per expert and projection, each of
      rank r: gate's and up's share the fused A; exact for any fused adapter).
    overwrite: replace an adapter already in `path` (else an error, before writing).

  Raises:
    FileExistsError: `path` holds an adapter's files and not `overwrite`.
    ValueError: a layer without adapters, adapters that do not fit the config, or an unknown
      layout.
    NotImplementedError: the family has no such layout.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  family = family_of(model_type).part(None)
  fused, per_expert = _layouts(family, model_type)
  chosen = fused if layout == "fused" else per_expert
  if chosen is None:
    raise NotImplementedError(
      f"model_type={model_type!r} stores its experts as {family.experts[0]}: no {layout!r} "
      f"adapter layout; use layout={'per_expert' if layout == 'fused' else 'fused'!r}"
    )
  if config.num_redundant_experts:
    raise ValueError("save_lora takes logical experts: config.num_redundant_experts must be 0")
  tensors, modules, parameters = {}, [], []
  for layer, params in adapters.items():
    check_adapters("lora", params.lora, call_record(config).lora)
    # Fused: the loaded model's module names; per expert: transformers 4's, the checkpoint's.
    block = family.loaded_block(layer) if layout == "fused" else family.block.format(layer=layer)
    lora = ExpertLoRA(*(np.asarray(a, np.float32) for a in params.lora))
    if layout == "fused":
      parameters += _write_fused(tensors, block, fused, lora)
    else:
      modules += _write_per_expert(tensors, block, per_expert, lora)
    if params.shared_lora is not None and family.shared:
      shared = SharedLoRA(*(np.asarray(a, np.float32) for a in params.shared_lora))
      modules += _write_linear_gate_up_down(
        tensors, beside(block, family.shared), shared, _shared_projections(family)
      )
  if layout == "per_expert":  # as transformers 4's adapters name them, the form PEFT converts
    modules = sorted({module.rsplit(".", 1)[-1] for module in modules})
  adapter_config = {
    "peft_type": "LORA",
    "r": config.lora_rank,
    "lora_alpha": config.lora_alpha,
    "use_rslora": config.lora_rslora,
    "target_modules": modules,
    "target_parameters": parameters or None,
    "lora_dropout": 0.0,
    "bias": "none",
    "fan_in_fan_out": False,
    "init_lora_weights": True,
    "inference_mode": True,
  }
  from safetensors.numpy import save

  written = {
    "adapter_model.safetensors": save(tensors),
    "adapter_config.json": json.dumps(adapter_config, indent=2),
  }
  if not overwrite:
    files.refuse_existing([Path(path) / name for name in written])
  for name, data in written.items():
    files.write_atomically(Path(path) / name, data, overwrite=True)


def _put(tensors: dict, module: str, a: np.ndarray, b: np.ndarray) -> None:
  tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
  tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)


def _write_fused(tensors: dict, block: str, layout, lora: ExpertLoRA) -> list[str]:
  """The two `ParamWrapper`s' tensors; returns their target parameters, gate_up first (PEFT
  wraps the first target innermost, as `base_layer`)."""
  swapped = layout.input_major and not layout.marked_transposed
  gate_up_b = _interleaved(lora.gate_up_b) if layout.interleaved else lora.gate_up_b
  targets = [f"{block}.{layout.gate_up}", f"{block}.{layout.down}"]
  module_of = lambda target: target.rsplit(".", 1)[0]
  same_module = module_of(targets[0]) == module_of(targets[1])
  for target, a, b in zip(
    targets, (lora.gate_up_a, lora.down_a), (gate_up_b, lora.down_b), strict=True
  ):
    e, rank = a.shape[0], a.shape[-1]
    peft_a, peft_b = (
      (b, a.transpose(0, 2, 1)) if swapped else (a.transpose(0, 2, 1), b)
    )  # [E, r, in], [E, r, out]
    module = module_of(target) + (".base_layer" if same_module and target == targets[0] else "")
    _put(
      tensors,
      module,
      peft_a.reshape(e * rank, peft_a.shape[-1]),
      peft_b.transpose(2, 1, 0).reshape(peft_b.shape[-1], rank * e),
    )
  return targets


def _interleaved(gate_up: np.ndarray) -> np.ndarray:
  """[..., 2F] gate then up -> alternating columns (the inverse of `halves`)."""
  f = gate_up.shape[-1] // 2
  out = np.empty_like(gate_up)
  out[..., 0::2], out[..., 1::2] = gate_up[..., :f], gate_up[..., f:]
  return out


def _write_linear_gate_up_down(tensors: dict, prefix: str, adapters, names) -> list[str]:
  """gate, up and down linear layers' adapters at the fused rank (gate's and up's with the
  fused A: their products are exactly the fused adapter's), or, with two names, the fused
  gate-up layer's and down's; returns the modules."""
  f = adapters.gate_up_b.shape[-1] // 2
  gate_up = (
    ((adapters.gate_up_a, adapters.gate_up_b),)
    if len(names) == 2
    else (
      (adapters.gate_up_a, adapters.gate_up_b[..., :f]),
      (adapters.gate_up_a, adapters.gate_up_b[..., f:]),
    )
  )
  parts = (*gate_up, (adapters.down_a, adapters.down_b))
  modules = [f"{prefix}.{name}" for name in names]
  for module, (a, b) in zip(modules, parts, strict=True):
    _put(tensors, module, a.T, b.T)
  return modules


def _write_per_expert(tensors: dict, block: str, layout, lora: ExpertLoRA) -> list[str]:
  names = (layout.gate, layout.up, layout.down)
  return [
    module
    for e in range(lora.gate_up_a.shape[0])
    for module in _write_linear_gate_up_down(
      tensors, f"{block}.experts.{e}", ExpertLoRA(*(x[e] for x in lora)), names
    )
  ]
