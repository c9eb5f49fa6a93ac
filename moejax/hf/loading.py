"""Reading a checkpoint's MoE layers: one layer -> `MoEParams` (`load_layer`), every MoE
layer -> one stack [L, ...] (`load_stack`), onto a mesh as they load; the token id routing
tables of hash-routed layers (`load_hash_routes`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from kernels_pallas.quantized import is_block_scaled
from moejax.call_record import call_record
from moejax.config import MoEConfig
from moejax.hf.configs import check_moe_layer, config_from_hf, moe_layers, one_config, text_model
from moejax.hf.families import Family, beside, family_of
from moejax.hf.layouts import float_linear
from moejax.hf.safetensors_files import SafetensorsFiles
from moejax.inputs import check_mesh, check_params
from moejax.meshes import named_sharding
from moejax.params import MoEParams
from moejax.sharding import map_params
from moejax.stacking import stacked_sharding


def load_layer(
  path: str | Path,
  layer: int,
  config: MoEConfig | None = None,
  *,
  mesh: Mesh | None = None,
  dequantize: bool = False,
  part: str | None = None,
) -> MoEParams:
  """One MoE layer's weights from a local Hugging Face checkpoint folder.

  Args:
    path: the folder (config.json and safetensors files).
    layer: the decoder layer index; it must be an MoE layer of the model.
    config: the layer's `MoEConfig`; None reads it with `config_from_hf` (the parameters in
      the checkpoint's dtype).
    mesh: place each parameter on this mesh as `MoELayer` does (experts split over the expert
      axis): each device receives only its slice, though each tensor is read whole into host
      memory first; None gives host NumPy arrays.
    dequantize: with a quantized checkpoint (`config.expert_quant`), return float expert
      weights (for the config with `expert_quant=None`) instead of `BlockScaled` ones in the
      checkpoint's format. Quantized shared experts are always dequantized.
    part: the MoE layer of a block that holds one per token type (ERNIE-4.5-VL's "text" and
      "vision", each with the block's shared experts: run each on its tokens, `token_mask`,
      and add the outputs); None for the others.

  Returns:
    `MoEParams` in their `moejax.call_record.Expected.dtype` (the config's `param_dtype`; the
    router's float32; quantized experts kept as stored), without
    LoRA adapters whatever `config.lora_rank` (`load_lora` reads a PEFT adapter's).

  Raises:
    KeyError: a tensor the layer needs is missing (the message names the key).
    ValueError: `layer` is not an MoE layer of the model (the message lists those that
      are), a tensor has another shape than the config implies, or the family is unknown.
    NotImplementedError: a quantized layout moejax does not read (named).
  """
  path = Path(path)
  hf = text_model(json.loads((path / "config.json").read_text()))
  family = family_of(hf.get("model_type")).part(part)
  check_moe_layer(hf, family, layer)
  config = config_from_hf(hf, layer=layer, part=part) if config is None else config
  block = family.block.format(layer=layer)
  quantization = hf.get("quantization_config") or {}
  with SafetensorsFiles(path, quantization.get("weight_block_size")) as files:
    values = _read_layer(files, block, family, config, hf)
  if quantization.get("scale_fmt") == "ue8m0":
    _check_powers_of_two(values, block)
  dtype = np.dtype(config.param_dtype)
  dtypes = {name: e.dtype for name, e in call_record(config).params.items()}
  as_stored = lambda name, v: (
    v if is_block_scaled(v) or name not in dtypes else np.asarray(v, dtypes[name])
  )
  params = MoEParams(**{name: as_stored(name, value) for name, value in values.items()})
  if dequantize and config.expert_quant is not None:
    config = dataclasses.replace(config, expert_quant=None)
    params = params._replace(
      **{name: np.asarray(v.dequantize(dtype)) for name, v in values.items() if is_block_scaled(v)}
    )
  base = call_record(dataclasses.replace(config, lora_rank=0))
  try:  # the base weights only: adapters come from `load_lora` (or `moejax.lora.init_like`)
    check_params(params, base)
  except ValueError as error:
    raise ValueError(f"read from {block}: {error}") from None
  if mesh is None:
    return params
  check_mesh(call_record(config, mesh))
  place = lambda value, spec: jax.make_array_from_callback(
    value.shape, named_sharding(mesh, spec), value.__getitem__
  )  # each device gets only its slice
  return map_params(place, base.specs.params(params), params)


def load_stack(
  path: str | Path,
  config: MoEConfig | None = None,
  *,
  layers: Sequence[int] | None = None,
  mesh: Mesh | None = None,
  dequantize: bool = False,
  progress: bool = True,
  part: str | None = None,
) -> MoEParams:
  """Every MoE layer of a checkpoint, stacked for a scanned stack of layers: `load_layer` for
  each of `moe_layers(path)`, in order, each parameter with a leading layer axis [L, ...].

  Args:
    path, dequantize, part: as for `load_layer` (quantized experts stay quantized unless
      `dequantize`).
    config: the layers' `MoEConfig`; None reads the one they share (`one_config`: an error
      names two layers whose configs differ, as Step-3.7's clamped layers do from the others).
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
  config = one_config(path, layers, part=part) if config is None else config
  stack = None
  for position, layer in enumerate(tqdm(layers, desc="MoE layers", disable=not progress)):
    params = load_layer(path, layer, config, mesh=mesh, dequantize=dequantize, part=part)
    stack = _empty_stack(params, len(layers)) if stack is None else stack
    stack = jax.tree.map(functools.partial(_put_layer, position=position), stack, params)
  return stack


def load_hash_routes(path: str | Path) -> dict[int, np.ndarray]:
  """The token id -> expert ids tables of the MoE layers that route by token id
  (DeepSeek-V4's first layers: `Family.hash_routes`).

  Such a layer's router scores the experts, but which K experts a token reaches is its
  table's row: route with `moe_apply(..., expert_ids=table[input_ids])` (routing replay; the
  weights are the chosen experts' scores, renormalized and scaled). Its selection bias is
  absent and loads as 0.

  Args:
    path: the checkpoint folder.

  Returns:
    {decoder layer: [V, K] int32 expert ids, V the vocabulary}; empty for a model without
    hash-routed layers.
  """
  path = Path(path)
  hf = text_model(json.loads((path / "config.json").read_text()))
  family = family_of(hf.get("model_type"))
  if family.hash_routes is None:
    return {}
  tables = {}
  with SafetensorsFiles(path) as files:
    for layer in moe_layers(hf):
      key = f"{family.block.format(layer=layer)}.{family.hash_routes}"
      if key in files:
        tables[layer] = np.asarray(files.get_raw(key), np.int32)
  return tables


def _empty_stack(params: MoEParams, layers: int) -> MoEParams:
  """Room for `layers` layers like `params`: a leading layer axis on no mesh axis."""

  def empty(leaf):
    if not isinstance(leaf, jax.Array):
      return np.empty((layers, *leaf.shape), leaf.dtype)
    zeros = functools.partial(jax.numpy.zeros, (layers, *leaf.shape), leaf.dtype)
    return jax.jit(zeros, out_shardings=stacked_sharding(leaf.sharding))()

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


def _router(files: SafetensorsFiles, weight: str, family: Family, config: MoEConfig) -> dict:
  """The router's kernel [D, E + Z] from its stored weight ([E + Z, D], [D, E + Z] with
  `router_input_major`, or Doge's product keys); with `config.shared_expert_scores` the
  weight holds the S shared experts' rows last, which are `shared_router_kernel` [D, S]."""
  d, outputs = config.hidden_size, config.num_router_outputs
  rows = outputs + (config.num_shared_experts if config.shared_expert_scores else 0)
  if family.product_keys:  # expert a n + b: key a's logit plus key b's
    keys = math.isqrt(outputs)
    x_keys, y_keys = files.get(weight, (2 * keys, d)).reshape(2, keys, d)
    return {"router_kernel": (x_keys[:, None] + y_keys[None, :]).reshape(outputs, d).T}
  if family.router_input_major:
    kernel = files.get(weight, (d, rows))
  else:
    kernel = files.get(weight, (rows, d)).T
  if not config.shared_expert_scores:
    return {"router_kernel": kernel}
  return {"router_kernel": kernel[:, :outputs], "shared_router_kernel": kernel[:, outputs:]}


def _shared_stack(files: SafetensorsFiles, key, layout, config: MoEConfig) -> dict:
  """Shared experts stored as a stack of S experts ([S, D, 2w] and [S, w, D] as `layout`
  reads them, w = Fs / S) as moejax's one fused MLP: gate columns of expert s at [s w,
  (s+1) w), up columns after all gates, down rows likewise."""
  s, d = config.num_shared_experts, config.hidden_size
  width = config.shared_intermediate_size // s
  stack = layout.floats(files, key, s, d, width)
  fused = lambda half: half.transpose(1, 0, 2).reshape(d, s * width)  # [S, D, w] -> [D, S w]
  gate, up = stack["w_gate_up"][..., :width], stack["w_gate_up"][..., width:]
  return {
    "shared_w_gate_up": np.concatenate([fused(gate), fused(up)], axis=1),
    "shared_w_down": stack["w_down"].reshape(s * width, d),
  }


def _folded(weights, scale: np.ndarray) -> np.ndarray:
  """Expert weights times `scale` (broadcast): a scale folded into them as they load."""
  if is_block_scaled(weights):
    raise NotImplementedError(
      "scales folded into the experts (Gemma 4's per_expert_scale, Inkling's global_scale, "
      "Muse Spark's norms) need float experts: this checkpoint's experts are quantized"
    )
  return weights * scale


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


def _read_layer(
  files: SafetensorsFiles, block: str, family: Family, config: MoEConfig, hf: dict
) -> dict:
  """The layer's parameters as float32 NumPy arrays (or `BlockScaled`) in moejax's layout,
  with the scales the family folds into them (`hf`: its config.json)."""
  d, f, e = config.hidden_size, config.intermediate_size, config.num_experts
  w = config.expert_width  # the experts' rows: D, or a latent width
  outputs = config.num_router_outputs
  key = lambda name: beside(block, name)
  values = {} if family.router is None else _router(files, key(family.router), family, config)
  if family.router_scale:
    values["router_kernel"] = values["router_kernel"] * family.router_scale(hf)
  if family.router_bias and config.router_bias:
    values["router_bias"] = files.get(key(family.router_bias), (outputs,))
  hashed = family.hash_routes is not None and key(family.hash_routes) in files
  if family.selection_bias and config.use_routing_bias and hashed:
    values["routing_bias"] = np.zeros(outputs, np.float32)  # given ids choose, never the bias
  elif family.selection_bias and config.use_routing_bias:
    bias = files.get(key(family.selection_bias))  # ERNIE stores it as [1, E]
    if family.selection_bias_row is not None:  # ERNIE-4.5-VL's, [parts, E]
      bias = bias[family.selection_bias_row]
    if bias.size != outputs:
      raise ValueError(
        f"{key(family.selection_bias)} has shape {bias.shape}, expected {(outputs,)}"
      )
    values["routing_bias"] = bias.reshape(outputs)
  layout = next((lay for lay in family.experts if lay.present(files, key)), family.experts[-1])
  values.update(layout.read(files, key, config.expert_quant, e, w, f, config.quant_block))
  if family.expert_scale:
    scale = files.get(key(family.expert_scale), (e,))
    values["w_down"] = _folded(values["w_down"], scale[:, None, None])
  if family.latent_norm_scale:  # the norm's scale, 1 + w, on the experts' input rows
    scale = 1.0 + files.get(key(family.latent_norm_scale), (w,))
    values["w_gate_up"] = _folded(values["w_gate_up"], scale[None, :, None])
  if family.expert_norm_scale:  # 1 + w, on the experts' outputs before their norm
    scale = 1.0 + files.get(key(family.expert_norm_scale), (w,))
    values["w_down"] = _folded(values["w_down"], scale[None, None, :])
  if config.has_shared_experts and family.shared_stack:
    values.update(_shared_stack(files, key, family.shared_stack, config))
  elif config.has_shared_experts and family.shared:
    fs = config.shared_intermediate_size
    shapes = ((2 * fs, d), (d, fs)) if family.shared_fused else ((fs, d), (fs, d), (d, fs))
    *gate_up, down = (
      float_linear(files, key(f"{family.shared}.{name}.weight"), shape, config)
      for name, shape in zip(family.shared_names, shapes, strict=True)
    )
    values["shared_w_gate_up"] = np.concatenate([w.T for w in gate_up], axis=1)
    values["shared_w_down"] = down.T
  if family.output_scale:  # every expert's weight, routed and shared, by one scale
    scale = files.get(key(family.output_scale), (1,))
    values["w_down"] = _folded(values["w_down"], scale)
    if "shared_w_down" in values:
      values["shared_w_down"] = values["shared_w_down"] * scale
  if config.latent_size and family.latent:
    into, out_of = family.latent
    values["latent_in"] = files.get(key(into), (w, d)).T
    values["latent_out"] = files.get(key(out_of), (d, w)).T
  if config.output_bias and family.output_bias:
    values["output_bias"] = files.get(key(family.output_bias), (d,))
  if config.shared_expert_gate and family.shared_gate:
    values["shared_gate_kernel"] = files.get(key(family.shared_gate), (1, d)).T
  return values
