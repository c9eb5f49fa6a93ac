"""`FAMILIES`: one `Family` row per config.json `model_type`, saying where the MoE block's
tensors are, which config.json keys give the layer's sizes and options, how its experts are
stored and which decoder layers are MoE layers. Adding a family is adding a row."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from moejax.hf.layouts import Flat, Fused, Layout, Neurons, PerExpert, Stacked

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


def _listed_or(default: LayerRule) -> LayerRule:
  """`mlp_layer_types` ("sparse": an MoE layer) where config.json lists them (transformers
  writes the list its config class derived), else `default`."""

  def rule(hf: dict, layer: int, layers: int) -> bool:
    listed = Read("mlp_layer_types", None)(hf)
    return default(hf, layer, layers) if listed is None else listed[layer] == "sparse"

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


def _after_num_dense_layers(default: int) -> LayerRule:
  """LFM2-MoE's and AFMoE's: the layers from `num_dense_layers` on."""
  return lambda hf, layer, layers: layer >= Read("num_dense_layers", default)(hf)


def _with_experts(hf: dict, layer: int, layers: int) -> bool:
  """Granite hybrid's: every layer, unless `num_local_experts` is 0 (then none)."""
  return bool(Read("num_local_experts", 8)(hf))


def _when(flag: str) -> LayerRule:
  """Every layer where config.json's `flag` is true, else none (Gemma 4's `enable_moe_block`,
  Doge's `is_moe`)."""
  return lambda hf, layer, layers: bool(Read(flag, False)(hf))


_NEMOTRON_H_KINDS = Read(("layers_block_type", "hybrid_override_pattern"))


def _step_moe_layers(hf: dict, layer: int, layers: int) -> bool:
  """Step-3.5's: the layers `moe_layers_enum` lists ("3,4,..." or a list), else those from
  layer 3 on."""
  listed = Read("moe_layers_enum", None)(hf)
  if listed is None:
    return layer >= 3
  items = listed.split(",") if isinstance(listed, str) else listed
  return layer in {int(item) for item in items if str(item).strip()}


def _step_clamps(hf: dict, layer: int) -> dict:
  """Step-3.5's and Step-3.7's per-layer clamps: the routed experts' at `swiglu_limits[layer]`,
  the shared expert's at `swiglu_limits_shared[layer]`, each after the gate's activation; 0,
  null or no list: none (Step-3.7-Flash clamps layers 43 and 44 at 7)."""

  def limit(key: str) -> float | None:
    limits = Read(key, None)(hf)
    if limits and layer >= len(limits):
      raise ValueError(f"config.json's {key} has {len(limits)} entries, none for layer {layer}")
    return float(limits[layer]) if limits and limits[layer] else None

  options = {}
  for activation, limit_field, key in (
    ("activation", "swiglu_limit", "swiglu_limits"),
    ("shared_activation", "shared_swiglu_limit", "swiglu_limits_shared"),
  ):
    bound = limit(key)
    options[activation] = "silu" if bound is None else "swiglu_clamped_after"
    if bound is not None:
      options[limit_field] = bound
  return options


def _no_mlp_bias(hf: dict) -> dict:
  """The shared expert's biases (Step's and Doge's `mlp_bias`) are not read."""
  if Read("mlp_bias", False)(hf):
    raise NotImplementedError("mlp_bias=True: the shared expert's biases are not read")
  return {}


def _ernie_vl_part(block: int) -> Family:
  """ERNIE-4.5-VL-MoE's MoE layer of one token type (0 text, 1 vision): ERNIE-4.5's routing
  over its own experts (the `block`-th E of the stored ones, `moe_intermediate_size[block]`
  wide), its router weight (`gate.weight`, `gate.weight_1`, stored [D, E]) and its row of
  the selection bias; the block's shared experts (as wide as a text expert) in both."""
  width = Read("moe_intermediate_size", [1536, 512], lambda sizes: sizes[block])
  return Family(
    "model.layers.{layer}.mlp", ("gate.weight", "gate.weight_1")[block],
    dict(num_experts=Read("moe_num_experts", 64), top_k=Read("moe_k", 6),
         intermediate_size=width, renormalize=True, use_routing_bias=True),
    (PerExpert(expert_block=block),), shared="shared_experts",
    shared_sizes=Shared(Read("moe_num_shared_experts", 2),
                        Read("moe_intermediate_size", [1536, 512], lambda sizes: sizes[0])),
    selection_bias="moe_statics.e_score_correction_bias", selection_bias_row=block,
    router_input_major=True, moe_layer=_listed_or(_after_dense(1)),
    module="model.language_model.layers.{layer}.mlp",
  )  # fmt: skip


def _nemotron_h_moe(hf: dict, layer: int, layers: int) -> bool:
  """Nemotron-H's: the layers whose kind is "moe" (`layers_block_type`, or "E" in the older
  `hybrid_override_pattern`)."""
  return _NEMOTRON_H_KINDS(hf)[layer] in ("moe", "E")


def _squared_relu(hf: dict) -> dict:
  """Nemotron-H's experts are squared-ReLU MLPs without a gate: loaded as "relu" experts whose
  gate is their up projection (relu(u) * u = relu(u)**2); another `mlp_hidden_act` is not."""
  act = Read("mlp_hidden_act", "relu2")(hf)
  if act != "relu2":
    raise NotImplementedError(f"Nemotron-H mlp_hidden_act={act!r}: moejax reads 'relu2'")
  return dict(activation="relu")


def _product_keys_reach(experts: int) -> int:
  """Doge's n^2 experts its product keys reach, n = floor(sqrt(`num_experts`)): the others
  are never chosen and are not loaded."""
  return math.isqrt(experts) ** 2


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
    router: the router's [E (+ Z), D] weight, relative to the block; None where the layer
      holds no router (`external_router`: ZAYA's, `moejax.hf.zaya`).
    options: `MoEConfig` field -> a `Read` of config.json, or a fixed value (sizes first).
    experts: the layouts its experts may be stored in, tried in order (the last when none
      is found, so that its missing tensor is named).
    shared: the shared experts' key prefix (their `shared_names`), or None; a leading "../"
      climbs out of the block (Granite's shared MLP is beside it).
    shared_names: the shared experts' gate, up and down projections' names, or two: a fused
      gate-up projection [2Fs, D] (gate rows first) and the down one (Granite's).
    shared_sizes: how config.json gives them (`Shared`), or None.
    shared_stack: the shared experts stored as an expert stack ([S, ...] tensors, Inkling's),
      read with this layout, or None: linear layers (`shared`, `shared_names`).
    router_bias: the router's bias key, or None.
    selection_bias: the selection-only bias key (DeepSeek's `e_score_correction_bias`);
      a leading "../" climbs out of the block (Kolibri-1's is beside it).
    selection_bias_row: the row of a [parts, E] selection bias that is this part's
      (ERNIE-4.5-VL's), or None: the bias is [E] (or [1, E]).
    router_input_major: the router's weight is stored [D, E] (ERNIE-4.5-VL's), not [E, D].
    product_keys: the router's weight is [2 n, D] of product keys (Doge's `router_gate`):
      n logits x and n logits y, expert a n + b scored x_a + y_b; loaded as the kernel
      [D, E] of those sums (E = n^2), which routes each token by its own logits.
    shared_gate: the shared experts' [1, D] gate weight key, or None.
    output_bias: the block's output bias [D] key (JetMoE's `bias`), or None.
    latent: the latent projections' weight keys, [L, D] into the experts' width and [D, L]
      out of it (Nemotron-H's `fc1_latent_proj`, `fc2_latent_proj`), or None.
    latent_norm_scale: the key of the latent rows' norm weight w [L] (Muse Spark's
      `pre_expert_norm`, scaling by 1 + w after the norm), folded into every expert's gate
      and up projections' input rows as it loads (the layer's norm has no scale), or None.
    expert_norm_scale: the key of the experts' output norm weight w [W] (Muse Spark's
      `experts.post_expert_norm`, scaling by 1 + w before the norm), folded into every
      expert's down projection's output columns as it loads, or None.
    router_scale: a config.json value multiplying the router's logits (Muse Spark's
      `output_multiplier`), folded into the router's kernel as it loads, or None.
    expert_scale: each expert's output scale [E] key (Gemma 4's `router.per_expert_scale`),
      folded into its down projection as it loads, or None.
    output_scale: a [1] scale of every expert's weight, routed and shared (Inkling's
      `gate.global_scale`), folded into their down projections as it loads, or None.
    hash_routes: the [V, K] token id -> expert ids table of the layers that route by token
      id (DeepSeek-V4's first layers: `gate.tid2eid`), or None; such a layer has no
      selection bias (it is read as 0: the given ids choose, never the bias).
    derived: config.json -> further options no single key gives, or None.
    layer_options: (config.json, decoder layer) -> the options that differ by layer
      (Step-3.7's per-layer clamps), or None: every MoE layer has the same config.
    layers: the number of decoder layers.
    moe_layer: which decoder layers are MoE layers (`LayerRule`; the others are dense).
    module: the block's module path in transformers' loaded model, with `{layer}`, where
      transformers renames the checkpoint's `block` as it loads (Mixtral's
      `block_sparse_moe` is its `mlp`); None where they agree. PEFT names adapters after
      the loaded modules.
    parts: where each of the block's tokens goes to one of several MoE layers (ERNIE-4.5-VL's
      text and vision experts, chosen by token type): part name -> that MoE layer's
      `Family` (this row's layer rule holds for all); None: one MoE layer per block.
  """

  block: str
  router: str | None
  options: dict[str, Read | Any]
  experts: tuple[Layout, ...] = _FUSED_OR_PER_EXPERT
  shared: str | None = None
  shared_names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
  shared_sizes: Shared | None = None
  shared_stack: Layout | None = None
  router_bias: str | None = None
  selection_bias: str | None = None
  selection_bias_row: int | None = None
  router_input_major: bool = False
  product_keys: bool = False
  shared_gate: str | None = None
  output_bias: str | None = None
  expert_scale: str | None = None
  output_scale: str | None = None
  latent: tuple[str, str] | None = None
  latent_norm_scale: str | None = None
  expert_norm_scale: str | None = None
  router_scale: Read | None = None
  hash_routes: str | None = None
  derived: Callable[[dict], dict] | None = None
  layer_options: Callable[[dict, int], dict] | None = None
  layers: Read = Read(("num_hidden_layers", "n_layers"))
  moe_layer: LayerRule = _every_layer
  module: str | None = None
  parts: dict[str, Family] | None = None

  def part(self, name: str | None) -> Family:
    """The `Family` of the MoE layer `name` of a block with `parts` (None: the block's own,
    where it has none); ValueError naming the parts otherwise."""
    if self.parts is None and name is None:
      return self
    if self.parts is None:
      raise ValueError(f"part={name!r}: this family's MoE blocks have no parts")
    if name not in self.parts:
      raise ValueError(
        f"part={name!r}: this family's MoE blocks hold one MoE layer per token type, pass "
        f"part= one of {sorted(self.parts)}"
      )
    return self.parts[name]

  @property
  def shared_fused(self) -> bool:
    """Whether the shared experts' gate and up projections are stored as one."""
    return len(self.shared_names) == 2

  def loaded_block(self, layer: int) -> str:
    """The block's module path in transformers' loaded model (`module`, else `block`)."""
    return (self.module or self.block).format(layer=layer)

  def config_options(self, hf: dict) -> dict:
    """The `MoEConfig` keyword arguments of this family's config.json."""
    options = {name: v(hf) if isinstance(v, Read) else v for name, v in self.options.items()}
    options.update(self.shared_sizes.options(hf) if self.shared_sizes else {})
    return {**options, **(self.derived(hf) if self.derived else {})}


def beside(block: str, name: str) -> str:
  """A key from its name relative to a block's; each leading "../" climbs one level out of it
  (Kolibri-1's selection bias, Granite's shared MLP)."""
  while name.startswith("../"):
    block, name = block.rsplit(".", 1)[0], name[3:]
  return f"{block}.{name}"


def _sizes(experts: str | tuple[str, ...], top_k: str | tuple[str, ...], width: str) -> dict:
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


def _cohere2_moe_combination(hf: dict) -> dict:
  """Cohere2-MoE's scores (`expert_selection_fn`: a softmax over the top-k logits, or sigmoid
  renormalized as `norm_topk_prob` says) and its `shared_expert_combination_strategy` ("sum",
  or "average": both outputs halved)."""
  sigmoid = Read("expert_selection_fn", "softmax")(hf) == "sigmoid"
  options = dict(
    scoring="sigmoid" if sigmoid else "softmax",
    renormalize=Read("norm_topk_prob", False, bool)(hf) if sigmoid else True,
  )
  strategy = Read("shared_expert_combination_strategy", "average")(hf)
  if strategy not in ("sum", "average"):
    raise ValueError(
      f"config.json shared_expert_combination_strategy={strategy!r}; expected 'sum' or 'average'"
    )
  if strategy == "average" and Read("num_shared_experts", 0)(hf):
    options.update(routed_scaling_factor=0.5, shared_scaling_factor=0.5)
  return options


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
_DEEPSEEK_V2 = Family(
  "model.layers.{layer}.mlp", "gate.weight",
  dict(**_DEEPSEEK, scoring="softmax", use_routing_bias=False),
  shared="shared_experts", shared_sizes=_DEEPSEEK_SHARED, derived=_limited_groups,
  moe_layer=_after_dense(0),
)
_DEEPSEEK_V3 = Family(
  "model.layers.{layer}.mlp", "gate.weight",
  dict(**_DEEPSEEK, scoring="sigmoid", use_routing_bias=True,
       num_expert_groups=Read("n_group", 1), topk_groups=Read("topk_group", 1)),
  shared="shared_experts", shared_sizes=_DEEPSEEK_SHARED,
  selection_bias="gate.e_score_correction_bias", moe_layer=_after_dense(3),
)
_DOTS3_NOTE = dataclasses.replace(
  _DEEPSEEK_V3,
  shared_sizes=Shared(Read("n_shared_experts", 0), Read("shared_experts_intermediate_size")),
  moe_layer=_listed_or(_after_dense(1)),
)
_QWEN_WITH_SHARED = Family(
  "model.layers.{layer}.mlp", "gate.weight", _QWEN,
  shared="shared_expert", shared_gate="shared_expert_gate.weight",
  shared_sizes=Shared(1, Read("shared_expert_intermediate_size", 0), gate=True),
  moe_layer=_qwen_sparse_step,
)
# Qwen3.5-MoE: Qwen3-Next's block in every layer, its chosen weights always renormalized; the
# text model saved alone, or the released vision-language model (config in `text_config`,
# `model.language_model.` keys).
_QWEN3_5_MOE = dataclasses.replace(
  _QWEN_WITH_SHARED, options={**_QWEN, "renormalize": True}, moe_layer=_every_layer
)
# DeepSeek-V3's routing under Kimi-Linear's and Bailing's config.json names.
_DEEPSEEK_V3_RENAMED = Family(
  "model.layers.{layer}.mlp", "gate.weight",
  dict(**_sizes("num_experts", "num_experts_per_token", "moe_intermediate_size"),
       renormalize=Read("moe_renormalize", False, bool), routed_scaling_factor=_SCALING,
       scoring="sigmoid", use_routing_bias=True, num_expert_groups=Read("num_expert_group", 1),
       topk_groups=Read("topk_group", 1)),
  shared="shared_experts",
  shared_sizes=Shared(Read("num_shared_experts", 0), Read("moe_intermediate_size")),
)
# Hunyuan v4's experts: DeepSeek-V4's SwiGLU, clamped at `swiglu_limit`, in the routed experts only.
_CLAMPED_ROUTED = dict(
  activation="swiglu_clamped", swiglu_limit=Read("swiglu_limit", 10.0, float),
  shared_activation="silu",
)
# Hunyuan v4: DeepSeek-V3's MoE with those experts.
_HY_V4 = dataclasses.replace(
  _DEEPSEEK_V3,
  options={**_DEEPSEEK_V3.options, **_CLAMPED_ROUTED},
  shared_names=("linear_gate", "up_proj", "down_proj"),  # as Hunyuan saves them
  moe_layer=_listed_or(_after_dense(1)),
)
# GLM-5-Next: DeepSeek-V3's MoE, DeepSeek-V4's clamped SwiGLU in every expert, in a
# vision-language model (config in `text_config`, `model.language_model.` keys).
_GLM5_NEXT = dataclasses.replace(
  _DEEPSEEK_V3, block="model.language_model.layers.{layer}.mlp",
  options={**_DEEPSEEK_V3.options, "activation": "swiglu_clamped",
           "swiglu_limit": Read("swiglu_limit", 10.0, float)},
  moe_layer=_listed_or(_after_dense(1)),
)
_MISTRAL_LARGE4 = Family(
  "layers.{layer}", "gate.weight",
  dict(**{**_DEEPSEEK, "renormalize": True}, scoring="softmax",
       num_expert_groups=Read("n_group", 1), topk_groups=Read("topk_group", 1),
       group_score="top2_sum"),
  _W1_W3_W2, shared="shared_experts", shared_names=("w1", "w3", "w2"),
  shared_sizes=_DEEPSEEK_SHARED, moe_layer=_listed_or(_after_dense(1)),
  module="model.language_model.layers.{layer}.mlp",
)
_QWEN3_VL_MOE = Family(
  "model.language_model.layers.{layer}.mlp", "gate.weight", {**_QWEN, "renormalize": True},
  moe_layer=_qwen_sparse_step,
)
_BLOCK_SPARSE = "model.layers.{layer}.block_sparse_moe"
_MLP = "model.layers.{layer}.mlp"  # transformers 5's name of Mixtral's block_sparse_moe
# MiniMax-M3: MiniMax-M2's routing, scaled, GPT-OSS's SwiGLU with its own alpha in every
# expert, a shared expert; saved as its vision-language model's language model.
_MINIMAX_M3 = Family(
  "language_model.model.layers.{layer}.block_sparse_moe", "gate.weight",
  dict(**_MIXTRAL, scoring="sigmoid", use_routing_bias=True, routed_scaling_factor=_SCALING,
       activation="swiglu_oai", swiglu_limit=Read("swiglu_limit", 7.0, float),
       swiglu_alpha=Read("swiglu_alpha", 1.702, float)),
  _W1_W3_W2, shared="shared_experts",
  shared_sizes=Shared(1, Read("shared_intermediate_size", 0)),
  selection_bias="e_score_correction_bias", moe_layer=_listed_or(_every_layer),
  module="model.language_model.layers.{layer}.mlp",
)
_GRANITE = Family(  # Mixtral's config fields and routing
  _BLOCK_SPARSE, "router.layer.weight", _MIXTRAL,
  (Fused("input_linear.weight", "output_linear.weight"),),
)
_GEMMA4 = Family(
  "model.layers.{layer}", "router.proj.weight",
  dict(**_sizes("num_experts", "top_k_experts", "moe_intermediate_size"), renormalize=True),
  (Fused(),), expert_scale="router.per_expert_scale", moe_layer=_when("enable_moe_block"),
)
_INKLING2 = Family(
  "model.llm.layers.{layer}.mlp", "gate.weight",
  dict(**_sizes("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
       scoring=Read("scoring_func", "sigmoid"), use_routing_bias=True, renormalize=True,
       routed_scaling_factor=Read("route_scale", 8.0, float), activation="swiglu_softcapped",
       gate_softcap=Read("mlp_gate_softcap", 4.0, float),
       up_softcap=Read("mlp_up_softcap", 25.0, float)),
  (Fused("experts.w13_weight", "experts.w2_weight", interleaved=True),),
  selection_bias="gate.bias", module="model.layers.{layer}.mlp",
)
_INKLING = dict(
  **_sizes("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
  scoring="sigmoid", use_routing_bias=True, renormalize=True,
  routed_scaling_factor=Read("route_scale", 8.0, float), shared_expert_scores=True,
)
_INKLING_SHARED = Shared(Read("n_shared_experts", 2), Read("moe_intermediate_size", 3072))
# Muse Spark: sigmoid scores of logits times `output_multiplier`, a selection-only bias,
# renormalized and scaled; experts in a latent width between two RMS norms, the latent rows'
# and each expert output's (their scales, 1 + w, folded into the experts); no shared experts.
_MUSE_SPARK = Family(
  "model.language_model.layers.{layer}.mlp", "gate.weight",
  dict(**_sizes("num_local_experts", "num_experts_per_tok", "moe_intermediate_size"),
       scoring="sigmoid", use_routing_bias=True, renormalize=True,
       routed_scaling_factor=_SCALING, latent_size=Read("moe_hidden_size"),
       latent_norm_eps=Read("rms_norm_eps", 1e-5, float),
       expert_output_norm_eps=Read("post_norm_eps", 1e-8, float)),
  (Fused(),), selection_bias="gate.e_score_correction_bias",
  latent=("pre_expert_proj.weight", "post_expert_proj.weight"),
  latent_norm_scale="pre_expert_norm.weight", expert_norm_scale="experts.post_expert_norm.weight",
  router_scale=Read("output_multiplier", 0.1767766952966369, float),
  moe_layer=_listed_or(_every_layer),
)
_GRANITE_SHARED = dict(
  shared="../shared_mlp", shared_names=("input_linear", "output_linear"),
  shared_sizes=Shared(1, Read("shared_intermediate_size", 0)),
)

FAMILIES: dict[str, Family] = {
  "mixtral": Family(_BLOCK_SPARSE, "gate.weight", _MIXTRAL, _W1_W3_W2, module=_MLP),
  "minimax": Family(_BLOCK_SPARSE, "gate.weight", _MIXTRAL, _W1_W3_W2, module=_MLP),
  "phimoe": Family(
    _BLOCK_SPARSE, "gate.weight",
    dict(**_sizes("num_local_experts", "num_experts_per_tok", "intermediate_size"),
         scoring="sparsemixer", sparsemixer_eps=Read("router_jitter_noise", 0.01)),
    _W1_W3_W2, module=_MLP,
  ),
  "granitemoe": _GRANITE,
  "jetmoe": dataclasses.replace(  # Granite's block, with a bias on its output
    _GRANITE, block="model.layers.{layer}.mlp", options={**_MIXTRAL, "output_bias": True},
    output_bias="bias",
  ),
  # Granite's block and a shared MLP beside it in the decoder layer (fused gate-up, ungated);
  # the hybrid's layers are MoE where it has experts, SWA's experts stored as transformers'.
  "granitemoeshared": dataclasses.replace(_GRANITE, **_GRANITE_SHARED),
  "granitemoehybrid": dataclasses.replace(_GRANITE, **_GRANITE_SHARED, moe_layer=_with_experts),
  "granitemoe_swa": Family(_BLOCK_SPARSE, "router.weight", _MIXTRAL, **_GRANITE_SHARED),
  "qwen2_moe": _QWEN_WITH_SHARED,
  "qwen3_next": _QWEN_WITH_SHARED,
  "qwen3_5_moe_text": _QWEN3_5_MOE,
  "qwen3_5_moe": dataclasses.replace(_QWEN3_5_MOE, block="model.language_model.layers.{layer}.mlp"),
  # Qwen4-Exp: Qwen3.5-MoE's block beside hyper-connections and indexed attention.
  "qwen4_exp_text": _QWEN3_5_MOE,
  "qwen4_exp": dataclasses.replace(_QWEN3_5_MOE, block="model.language_model.layers.{layer}.mlp"),
  "qwen3_moe": Family(
    "model.layers.{layer}.mlp", "gate.weight", _QWEN, moe_layer=_qwen_sparse_step
  ),
  # Qwen3-VL-MoE: Qwen3-MoE's block, renormalized, in a vision-language model; its text model
  # saved alone (a base model: no `model.` prefix).
  "qwen3_vl_moe": _QWEN3_VL_MOE,
  "qwen3_vl_moe_text": dataclasses.replace(_QWEN3_VL_MOE, block="layers.{layer}.mlp"),
  # Qwen3-Omni-MoE: its thinker's text model, Qwen3-MoE's block (its talker is not read).
  "qwen3_omni_moe": Family(
    "thinker.model.layers.{layer}.mlp", "gate.weight", _QWEN, moe_layer=_qwen_sparse_step,
    module="thinker.model.language_model.layers.{layer}.mlp",
  ),
  "mellum": Family(  # Qwen3-MoE's block
    "model.layers.{layer}.mlp", "gate.weight", _QWEN, moe_layer=_listed_or(_every_layer)
  ),
  # Laguna: soft-capped logits, sigmoid scores, a selection-only bias, always renormalized,
  # scaled, an ungated shared expert.
  "laguna": Family(
    "model.layers.{layer}.mlp", "gate.weight",
    dict(**_sizes("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
         scoring="sigmoid", use_routing_bias=True, renormalize=True,
         routed_scaling_factor=Read("moe_routed_scaling_factor", 1.0, float),
         router_logit_softcap=Read("moe_router_logit_softcapping", 0.0, float)),
    shared="shared_expert", shared_sizes=Shared(1, Read("shared_expert_intermediate_size", 0)),
    selection_bias="experts.e_score_correction_bias", moe_layer=_listed_or(_after_dense(1)),
  ),
  "lara_mini": Family(  # Qwen's layout, softmax scores, an ungated shared expert, every layer
    "model.layers.{layer}.mlp", "gate.weight", _QWEN, shared="shared_expert",
    shared_sizes=Shared(1, Read("shared_expert_intermediate_size", 0)),
  ),
  "flint": Family(  # Qwen's layout, sigmoid scores, an ungated shared expert
    "model.layers.{layer}.mlp", "gate.weight", dict(**_QWEN, scoring="sigmoid"),
    shared="shared_expert", shared_sizes=Shared(1, Read("shared_expert_intermediate_size", 0)),
    moe_layer=_qwen_sparse_step,  # transformers writes its default mlp_only_layers, [0, 1]
  ),
  "olmoe": Family(
    "model.layers.{layer}.mlp", "gate.weight",
    {**_QWEN, "intermediate_size": Read("intermediate_size")},
  ),
  "flex_olmo": Family(  # OLMoE's block (its decoder normalizes after each block)
    "model.layers.{layer}.mlp", "gate.weight",
    {**_QWEN, "intermediate_size": Read("intermediate_size")},
  ),
  "deepseek_v2": _DEEPSEEK_V2,
  # DeepSeek-OCR-2 and Unlimited-OCR: DeepSeek-V2's MoE in a vision-language model, the text
  # model saved under its own keys, loaded by transformers under `model.language_model`.
  **dict.fromkeys(
    ("deepseek_ocr2", "unlimited_ocr"),
    dataclasses.replace(
      _DEEPSEEK_V2, moe_layer=_listed_or(_after_dense(0)),
      module="model.language_model.layers.{layer}.mlp",
    ),
  ),
  "deepseek_v3": _DEEPSEEK_V3,
  "glm4_moe": dataclasses.replace(_DEEPSEEK_V3, moe_layer=_after_dense(1)),
  # GLM-4.5V / 4.6V: GLM-4-MoE's text model, as released and saved alone.
  "glm4v_moe": dataclasses.replace(
    _DEEPSEEK_V3, block="model.language_model.layers.{layer}.mlp", moe_layer=_after_dense(1)
  ),
  "glm4v_moe_text": dataclasses.replace(
    _DEEPSEEK_V3, block="layers.{layer}.mlp", moe_layer=_after_dense(1)
  ),
  # DeepSeek-V3.2 and GLM-5: DeepSeek-V3's MoE beside sparse (indexed) attention.
  "deepseek_v32": dataclasses.replace(_DEEPSEEK_V3, moe_layer=_listed_or(_after_dense(3))),
  "glm_moe_dsa": dataclasses.replace(_DEEPSEEK_V3, moe_layer=_listed_or(_after_dense(3))),
  # DeepSeek-V3's MoE block under other decoders: every layer (Solar Open), the layers from
  # `first_k_dense_replace` on (dots1's default 0), or `mlp_layer_types`.
  "dots1": dataclasses.replace(_DEEPSEEK_V3, moe_layer=_after_dense(0)),
  "solar_open": dataclasses.replace(_DEEPSEEK_V3, moe_layer=_every_layer),
  "minicpm5_moe": dataclasses.replace(_DEEPSEEK_V3, moe_layer=_listed_or(_after_dense(1))),
  "glm4_moe_lite": dataclasses.replace(_DEEPSEEK_V3, moe_layer=_listed_or(_after_dense(1))),
  "mimo_v2_flash": dataclasses.replace(  # no shared experts
    _DEEPSEEK_V3, shared=None, shared_sizes=None, moe_layer=_listed_or(_after_dense(1))
  ),
  # A.X-K1: DeepSeek-V3's MoE; the RMS norm on its output is the decoder layer's
  # (`post_mlp_layernorm`, stored beside the block), the model's to apply after the layer.
  "axk1": dataclasses.replace(_DEEPSEEK_V3, moe_layer=_listed_or(_after_dense(1))),
  # A.X-K2: DeepSeek-V3's MoE, the dropped groups' experts scored 0 for the top-k.
  "axk2": dataclasses.replace(
    _DEEPSEEK_V3,
    options={**_DEEPSEEK_V3.options, "dropped_groups": "zeroed"},
    moe_layer=_listed_or(_after_dense(1)),
  ),
  "hy_v4": _HY_V4,
  # Its vision-language model: the text model saved under Hunyuan v4's keys, loaded by
  # transformers under `model.language_model`.
  "hy_v4_vl": dataclasses.replace(_HY_V4, module="model.language_model.layers.{layer}.mlp"),
  # Its text model saved alone (AutoModel: no "model." prefix).
  "hy_v4_vl_text": dataclasses.replace(
    _HY_V4, block="layers.{layer}.mlp", module="layers.{layer}.mlp"
  ),
  "glm5_next": _GLM5_NEXT,
  "glm5_next_text": dataclasses.replace(  # its text model saved alone (AutoModel)
    _GLM5_NEXT, block="layers.{layer}.mlp", module="layers.{layer}.mlp"
  ),
  # Dots3-Note: DeepSeek-V3's MoE, its shared experts' width its own key; the text model saved
  # alone, or its multimodal model (its text model's keys as the text model's; config.json's
  # text fields in `text_config` as transformers writes it, at the top level as published).
  "dots3_note_text": _DOTS3_NOTE,
  "dots3_note": dataclasses.replace(_DOTS3_NOTE, module="model.language_model.layers.{layer}.mlp"),
  # DeepSeek-V3's MoE beside linear attention, saved under Kimi's and Bailing's names.
  "kimi_linear": dataclasses.replace(
    _DEEPSEEK_V3_RENAMED, block=_BLOCK_SPARSE, module=_MLP, experts=_W1_W3_W2,
    selection_bias="gate.e_score_correction_bias", moe_layer=_listed_or(_after_dense(1)),
  ),
  "bailing_hybrid": dataclasses.replace(
    _DEEPSEEK_V3_RENAMED, selection_bias="gate.expert_bias", moe_layer=_listed_or(_after_dense(2))
  ),
  # Aria's text model: softmax over the top-k logits, experts stored input-major.
  "aria_text": Family(
    "model.layers.{layer}.mlp", "router.weight",
    dict(**_sizes("moe_num_experts", "moe_topk", "intermediate_size"), renormalize=True),
    (Fused("experts.fc1.weight", "experts.fc2.weight", input_major=True,
           marked_transposed=True),),
    shared="shared_experts",
    shared_sizes=Shared(Read("moe_num_shared_experts", 2), Read("intermediate_size")),
  ),
  # DeepSeek-V4: sqrt(softplus) scores (`scoring_func`), a selection-only bias, always
  # renormalized, scaled, SwiGLU clamped in every expert, one shared expert; its first layers
  # route by token id (`hf.load_hash_routes`). Saved in DeepSeek's own names.
  "deepseek_v4": Family(
    "model.layers.{layer}.ffn", "gate.weight",
    dict(**_sizes("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
         scoring=Read("scoring_func", "sqrtsoftplus"), use_routing_bias=True, renormalize=True,
         routed_scaling_factor=Read("routed_scaling_factor", 1.5, float),
         activation="swiglu_clamped", swiglu_limit=Read("swiglu_limit", 10.0, float)),
    _W1_W3_W2, shared="shared_experts", shared_names=("w1", "w3", "w2"),
    shared_sizes=Shared(1, Read("moe_intermediate_size")), selection_bias="gate.bias",
    hash_routes="gate.tid2eid", module="model.layers.{layer}.mlp",
  ),
  # Kolibri-1: sigmoid scores, top-k of the logits plus a selection-only bias, a shared expert.
  "kolibri1": Family(
    "model.layers.{layer}.mlp", "gate.weight",
    dict(**_QWEN, scoring="sigmoid", use_routing_bias=True, routing_bias_on="logits"),
    shared="shared_experts", shared_sizes=Shared(1, Read("shared_expert_intermediate_size", 0)),
    selection_bias="../moe.router.expert_bias",  # as released, beside the block
  ),
  "beam": dataclasses.replace(  # no shared experts
    _DEEPSEEK_V3,
    options={**_DEEPSEEK_V3.options, "num_experts": Read("num_experts")},
    shared=None, shared_sizes=None, moe_layer=_listed_or(_after_dense(3)),
  ),
  "exaone_moe": dataclasses.replace(
    _DEEPSEEK_V3,
    options={**_DEEPSEEK_V3.options, "num_experts": Read("num_experts")},
    shared_sizes=Shared(Read("num_shared_experts", 0), Read("moe_intermediate_size")),
    selection_bias="e_score_correction_bias",  # saved on the block
    moe_layer=_listed_or(_after_dense(1)),
  ),
  # DeepSeek-V3's block routed by softmax scores, groups ranked by their best two, no bias.
  "mistral4": Family(
    "model.layers.{layer}.mlp", "gate.weight",
    dict(**_DEEPSEEK, scoring="softmax", num_expert_groups=Read("n_group", 1),
         topk_groups=Read("topk_group", 1), group_score="top2_sum"),
    shared="shared_experts", shared_sizes=_DEEPSEEK_SHARED, moe_layer=_after_dense(0),
  ),
  "afmoe": Family(  # sigmoid scores, a selection-only bias, renormalized, times route_scale
    "model.layers.{layer}.mlp", "router.gate.weight",
    dict(**_sizes("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
         scoring="sigmoid", use_routing_bias=True, renormalize=True,
         routed_scaling_factor=Read("route_scale", 1.0, float)),
    shared="shared_experts",
    shared_sizes=Shared(Read("num_shared_experts", 0), Read("moe_intermediate_size")),
    selection_bias="expert_bias", moe_layer=_after_num_dense_layers(1),
  ),
  "cohere2_moe": Family(
    "model.layers.{layer}.mlp", "gate.weight",
    _sizes("num_experts", "num_experts_per_tok", "intermediate_size"),
    shared="shared_experts",
    shared_sizes=Shared(Read("num_shared_experts", 0), Read("intermediate_size")),
    derived=_cohere2_moe_combination, moe_layer=_listed_or(_every_layer),
  ),
  # Mistral 4's block, always renormalized, in a vision-language model saved in Mistral's own
  # layout (the block's tensors on the decoder layer, experts' w1, w3, w2).
  "mistral_large4": _MISTRAL_LARGE4,
  # Its text model saved alone (AutoModel): the same layout but for the shared experts' names.
  "mistral_large4_text": dataclasses.replace(
    _MISTRAL_LARGE4, shared_names=("gate_proj", "up_proj", "down_proj"), module="layers.{layer}.mlp"
  ),
  # Mixtral's block, routed as DeepSeek-V3 without groups: sigmoid scores, a selection-only
  # bias, the chosen scores renormalized.
  "minimax_m2": Family(
    _BLOCK_SPARSE, "gate.weight", dict(**_MIXTRAL, scoring="sigmoid", use_routing_bias=True),
    _W1_W3_W2, selection_bias="e_score_correction_bias", module=_MLP,
  ),
  # As MiniMax-M2, times `router_scaling_factor`, with shared experts.
  "hy_v3": Family(  # saved under Hunyuan's names
    "model.layers.{layer}.mlp", "router.gate.weight",
    dict(**_sizes("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
         renormalize=True, scoring="sigmoid", use_routing_bias=True,
         routed_scaling_factor=Read("router_scaling_factor", 1.0, float)),
    shared="shared_mlp",
    shared_sizes=Shared(Read("num_shared_experts", 0), Read("moe_intermediate_size")),
    selection_bias="expert_bias", moe_layer=_listed_or(_every_layer),
  ),
  "minimax_m3_vl": _MINIMAX_M3,
  # Its text model saved alone (AutoModelForCausalLM), in transformers' own names: fused
  # experts and shared expert, the selection bias on the gate.
  "minimax_m3_vl_text": dataclasses.replace(
    _MINIMAX_M3, block=_MLP, shared_names=("gate_up_proj", "down_proj"),
    selection_bias="gate.e_score_correction_bias", module=_MLP,
  ),
  # Inkling 2: DeepSeek-V4's router (`scoring_func` scores, a selection-only bias, always
  # renormalized, times `route_scale`), a soft-capped SwiGLU, no shared experts; saved in its
  # own names (`model.llm.`, fused `w13`/`w2`) as a text model or its multimodal model.
  # Inkling 2 Loop runs some of its layers more than once: their MoE layers are Inkling 2's.
  **dict.fromkeys(("inkling2_text", "inkling2_loop_text"), _INKLING2),
  **dict.fromkeys(
    ("inkling2", "inkling2_loop"),
    dataclasses.replace(_INKLING2, module="model.language_model.layers.{layer}.mlp"),
  ),
  # Nemotron-H: DeepSeek-V3's routing, squared-ReLU experts in a latent width (if
  # `moe_latent_size`) and a shared expert, saved under `backbone.`.
  "nemotron_h": Family(
    "backbone.layers.{layer}.mixer", "gate.weight",
    dict(**{**_DEEPSEEK, "renormalize": Read("norm_topk_prob", True, bool)}, scoring="sigmoid",
         use_routing_bias=True, num_expert_groups=Read("n_group", 1),
         topk_groups=Read("topk_group", 1), latent_size=Read("moe_latent_size", 0)),
    (PerExpert("up_proj", "up_proj", "down_proj"),), shared="shared_experts",
    shared_names=("up_proj", "up_proj", "down_proj"),
    shared_sizes=Shared(1, Read("moe_shared_expert_intermediate_size", 0)),
    selection_bias="gate.e_score_correction_bias",
    latent=("fc1_latent_proj.weight", "fc2_latent_proj.weight"), derived=_squared_relu,
    layers=Read(("layers_block_type", "hybrid_override_pattern"), convert=len),
    moe_layer=_nemotron_h_moe, module="model.layers.{layer}.mixer",
  ),
  # ERNIE-4.5-VL-MoE: text and vision experts in one block, chosen by token type: two MoE
  # layers ("text", "vision"), each with the block's shared experts.
  "ernie4_5_vl_moe": dataclasses.replace(
    _ernie_vl_part(0), parts={"text": _ernie_vl_part(0), "vision": _ernie_vl_part(1)}
  ),
  # Inkling: sigmoid scores with a selection-only bias, times `route_scale`; the router also
  # scores its shared experts, renormalized with the chosen ones (`shared_expert_scores`);
  # both stored as stacks; `global_scale` folded into every down projection. Saved as a
  # text model (transformers' names) or as its multimodal model (its own, under `model.llm.`).
  "inkling_text": Family(
    "model.layers.{layer}.mlp", "gate.weight", _INKLING,
    (Fused(),), shared_sizes=_INKLING_SHARED,
    shared_stack=Stacked("shared_experts.gate_proj", "shared_experts.up_proj",
                         "shared_experts.down_proj"),
    selection_bias="gate.e_score_correction_bias", output_scale="gate.global_scale",
    moe_layer=_listed_or(_every_layer),
  ),
  "inkling_mm_model": Family(
    "model.llm.layers.{layer}.mlp", "gate.weight", _INKLING,
    (Fused("experts.w13_weight", "experts.w2_weight", interleaved=True),),
    shared_sizes=_INKLING_SHARED,
    shared_stack=Fused("shared_experts.shared_w13_weight", "shared_experts.shared_w2_weight",
                       interleaved=True),
    selection_bias="gate.bias", output_scale="gate.global_scale",
    moe_layer=_listed_or(_every_layer), module="model.language_model.layers.{layer}.mlp",
  ),
  # Step-3.5 (text) and Step-3.7 (its vision-language model, the same keys): sigmoid scores
  # with a selection-only bias, renormalized and scaled; each projection of all experts one
  # tensor; a shared expert beside the block; SwiGLU clamped per layer, after the gate's
  # activation, at limits of the routed and the shared experts' own.
  **dict.fromkeys(("step3p5", "step3p7"), Family(
    "model.layers.{layer}.moe", "gate.weight",
    dict(**_sizes(("n_routed_experts", "moe_num_experts"), ("num_experts_per_tok", "moe_top_k"),
                  "moe_intermediate_size"),
         scoring="sigmoid", use_routing_bias=True, renormalize=True,
         routed_scaling_factor=Read("moe_router_scaling_factor", 1.0, float)),
    (Stacked(),), shared="../share_expert",
    shared_sizes=Shared(1, Read(("share_expert_dim", "share_expert_dims"))),
    selection_bias="router_bias", derived=_no_mlp_bias, layer_options=_step_clamps,
    moe_layer=_listed_or(_step_moe_layers), module="model.language_model.layers.{layer}.mlp",
  )),
  # Muse Spark's text model: as released (`muse_spark`, config in `text_config`) or saved
  # alone (a base model: no `model.` prefix).
  "muse_spark": _MUSE_SPARK,
  "muse_spark_text": dataclasses.replace(_MUSE_SPARK, block="layers.{layer}.mlp"),
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
  # Gemma 4: the decoder layer holds its router and experts (beside its dense MLP); softmax
  # scores, renormalized, each expert's output scaled. Its router reads the layer's input
  # through its own norm: pass that input's logits (`router_logits=`).
  "gemma4_text": _GEMMA4,
  "gemma4": dataclasses.replace(_GEMMA4, block="model.language_model.layers.{layer}"),
  # Doge: product-key retrieval (`product_keys`) of single-neuron experts (`Neurons`), a
  # softmax over the chosen logits, beside its gated MLP on the block itself (its shared
  # expert); every layer where `is_moe`.
  "doge": Family(
    "model.layers.{layer}.mlp", "router_gate.weight",
    dict(num_experts=Read("num_experts", 16384, _product_keys_reach),
         top_k=Read("num_experts_per_tok", 64), intermediate_size=1, renormalize=True,
         expert_bias=True),
    (Neurons(),), shared="../mlp", shared_sizes=Shared(1, Read("intermediate_size")),
    product_keys=True, derived=_no_mlp_bias, moe_layer=_when("is_moe"),
  ),
  # ZAYA: its router (an MLP fed by the previous layer's router state) is the model's
  # (`moejax.hf.zaya`); softmax scores over the experts and a skip class, which computes
  # nothing, chosen with a selection-only bias; the chosen scores as they are.
  "zaya": Family(
    "model.layers.{layer}.mlp", None,
    dict(**_sizes("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
         num_zero_experts=1, zero_expert_output="none", use_routing_bias=True,
         external_router=True),
    (Fused(),), selection_bias="gate.balancing_biases",
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
    selection_bias="expert_bias", moe_layer=_after_num_dense_layers(2),
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
# Multimodal model types whose text model's config.json fields are nested: the key holding
# them (dotted), `text_config` or Qwen3-Omni's thinker's.
_TEXT_CONFIG = (
  "kimi_k25",
  "qwen3_5_moe",
  "qwen3_vl_moe",
  "glm4v_moe",
  "mistral_large4",
  "gemma4",
  "qwen4_exp",
  "hy_v4_vl",
  "deepseek_ocr2",
  "unlimited_ocr",
  "minimax_m3_vl",
  "glm5_next",
  "dots3_note",
  "inkling2",
  "inkling2_loop",
  "step3p7",
  "ernie4_5_vl_moe",
  "inkling_mm_model",
  "muse_spark",
)
NESTED_TEXT = {
  **dict.fromkeys(_TEXT_CONFIG, "text_config"),
  "qwen3_omni_moe": "thinker_config.text_config",
}


def family_of(model_type: str | None) -> Family:
  """The `FAMILIES` row of a config.json `model_type`; ValueError listing them otherwise."""
  if model_type not in FAMILIES:
    raise ValueError(
      f"model_type={model_type!r} is not supported; moejax.hf reads {sorted(FAMILIES)}"
    )
  return FAMILIES[model_type]
