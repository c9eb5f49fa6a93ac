"""`MoEConfig`: every static choice of an MoE layer, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from kernels_pallas.formats import FORMATS
from moejax import axis_groups
from moejax.activations import GATED, GatedActivation
from moejax.axis_groups import AxisGroup
from moejax.compute_quant import GROUP, RECIPES, ComputeQuant, size_reason

Activation = Literal[
  "silu",
  "gelu",
  "gelu_tanh",
  "relu",
  "swiglu_oai",
  "swiglu_clamped",
  "swiglu_clamped_after",
  "swiglu_softcapped",
]
# A gated activation of the caller's own: (gate [..., F], up [..., F]) -> hidden [..., F],
# elementwise and differentiable (the XLA paths run it; no kernel epilogue has it).
ActivationFn = Callable[[jax.Array, jax.Array], jax.Array]
Scoring = Literal["softmax", "sigmoid", "sqrtsoftplus", "sparsemixer"]
GroupScore = Literal["max", "top2_sum"]
BiasTarget = Literal["scores", "logits"]
DroppedGroups = Literal["excluded", "zeroed"]
ZeroExpertOutput = Literal["input", "none"]
ExpertBackend = Literal["xla", "pallas", "fused", "auto"]
Dispatch = Literal["all_gather", "all_to_all", "auto"]
# The exchange schemes a call runs ("auto" resolved).
Scheme = Literal["all_gather", "all_to_all"]
# The paths a call's experts can take (`moejax.plan`).
ExpertPath = Literal["tile_loop", "ragged_dot", "pallas", "fused"]

_ACTIVATIONS = tuple(GATED)
_SCORINGS = get_args(Scoring)
_GROUP_SCORES = (*get_args(GroupScore), None)
_BIAS_TARGETS = get_args(BiasTarget)
_DROPPED_GROUPS = get_args(DroppedGroups)
_ZERO_EXPERT_OUTPUTS = get_args(ZeroExpertOutput)
BACKENDS = get_args(ExpertBackend)
DISPATCHES = get_args(Dispatch)


# What a field annotated `bool`, `int` or `float` takes, and how its error says so: Python's
# own scalars (hashable, and written as they are to JSON), a bool is no int here, an int is
# a float, and a float must be finite.
_FIELD_KINDS = {
  "bool": ("a bool", lambda v: isinstance(v, bool)),
  "int": ("an int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
  "float": (
    "a finite number",
    lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
  ),
}


def check_field_types(instance) -> None:
  """Raises ValueError naming the first field of a dataclass `instance` annotated `bool`,
  `int` or `float` that holds none (a string "False" is no bool, 2.0 no int, inf no float)."""
  for field in dataclasses.fields(instance):
    if field.type in _FIELD_KINDS:
      expected, holds = _FIELD_KINDS[field.type]
      value = getattr(instance, field.name)
      if not holds(value):
        raise ValueError(f"{field.name} must be {expected}, got {value!r}")


def _positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Static configuration of an `MoELayer`.

  Frozen and hashable, so it can be a static argument of `jax.jit`. Every field is checked in
  `__post_init__`; a bad value raises `ValueError` naming the field.

  Attributes:
    num_experts: E, routed experts in the layer.
    top_k: K, experts chosen per token.
    hidden_size: D, the model width.
    intermediate_size: F, each routed expert's hidden width (gate and up both have F columns).
    chunk_size: C, tokens per chunk per device (vLLM's VLLM_MOE_DP_CHUNK_SIZE), or "auto"
      (the default): the chunk whose buffers fit `chunk_memory_bytes`, one chunk when the
      whole call fits (`moejax.chunk_budget`). Bounds the collective buffers: each chunk
      sends at most C rows to each expert-axis device.
    chunk_memory_bytes: the budget of one chunk's buffers and temporaries for "auto", or
      None for the platform's default (`moejax.chunk_budget.budget_bytes`).
    activation: "silu", "gelu" (exact erf), "gelu_tanh" (tanh approximation) or "relu":
      experts compute `act(gate) * up` (squared-ReLU experts are "relu" with gate = up);
      or "swiglu_oai" (GPT-OSS's clamped SwiGLU): with g = min(gate, limit) and
      u = clip(up, -limit, limit), `(u + 1) * g * sigmoid(alpha g)`;
      or "swiglu_clamped" (DeepSeek-V4's, GLM-5-Next's, Hunyuan v4's): `silu(g) * u`; or
      "swiglu_clamped_after" (Step-3.5's and 3.7's): `min(silu(gate), limit) * u`; or
      "swiglu_softcapped" (Inkling 2's): `cap(gate, gate_softcap) * sigmoid(gate) *
      cap(up, up_softcap)`, cap(x, c) = c * tanh(x / c); or a function of your own,
      `(gate, up) -> hidden` elementwise (`ActivationFn`): the XLA paths run it (the tile
      loop; no kernel epilogue has it, and `moejax.tune` measures named ones only). The
      config holds the function itself: pass the same object each call (a new lambda is a
      new config, so a new compiled program).
    swiglu_limit: the limit of "swiglu_oai", "swiglu_clamped" and "swiglu_clamped_after".
    swiglu_alpha: the alpha of "swiglu_oai" (GPT-OSS's 1.702; MiniMax-M3 reads its own).
    gate_softcap, up_softcap: the caps of "swiglu_softcapped".
    shared_activation: the shared experts' activation, one of `activation`'s; None: the
      routed experts' (Hunyuan v4 clamps its routed experts only: "silu" here).
    shared_swiglu_limit: the shared experts' limit, or None: `swiglu_limit` (Step-3.7 clamps
      its shared expert at a limit of its own).
    scoring: "softmax", "sigmoid" or "sqrtsoftplus" (`sqrt(softplus(logits))`: DeepSeek-V4)
      of the router logits, or "sparsemixer" (PhiMoE's inference routing; needs top_k=2):
      each pick's weight is a softmax over the logits within a relative window of
      2 * sparsemixer_eps of it, read at the pick.
    sparsemixer_eps: PhiMoE's `router_jitter_noise`.
    router_logit_softcap: c > 0 caps the router logits to `c * tanh(logits / c)` before
      scoring and the router's statistics (Laguna); 0 leaves them as they are.
    renormalize: rescale the K chosen weights of a token to sum to 1.
    num_expert_groups: G, groups of experts for grouped (DeepSeek) top-k; 1 = plain top-k.
    topk_groups: groups kept per token before the top-k; at most `num_expert_groups`.
    group_score: how a group ranks: "max" (its best expert's selection score: DeepSeek-V2)
      or "top2_sum" (its best two's sum: DeepSeek-V3, Mistral 4); None: "top2_sum" with the
      routing bias, else "max".
    dropped_groups: what top-k sees of the experts outside a token's kept groups:
      "excluded" (never chosen: DeepSeek) or "zeroed" (their selection scores set to 0, so
      they can still beat kept experts whose biased score is negative: A.X-K2; ties among
      them go to the lowest id, where torch's top-k picks any).
    use_routing_bias: add the learned `routing_bias` [E + Z] to the scores for selection only
      (DeepSeek-V3's e_score_correction_bias); the bias never enters the weights.
    routing_bias_on: what the routing bias is added to for the selection: "scores" (the
      default) or the raw "logits" (Kolibri-1: top-k of logits + bias, weights the chosen
      experts' scores). Needs `use_routing_bias` for "logits".
    router_bias: the router has a bias `router_bias` [E + Z], added to its logits (GPT-OSS): it
      changes both the selection and the weights.
    external_router: the layer has no router kernel: every call passes its logits,
      `router_logits=` [..., E + Z] (ZAYA's router is an MLP fed by the previous layer's
      router state, which the model runs: `moejax.hf.zaya`). Not with `router_bias`.
    routed_scaling_factor: multiplies the final routing weights.
    expert_bias: experts have biases `b_gate_up` [E, 2F] and `b_down` [E, D] (GPT-OSS); the
      down bias is part of the expert's output, so the routing weight scales it.
    apply_router_weight_on_input: compute `expert(w * x)` instead of `w * expert(x)` (Llama 4;
      needs top_k=1).
    num_zero_experts: Z, LongCat-Flash's zero-computation experts: the router has E + Z
      outputs and choosing one of ids [E, E + Z) returns the token's input times its weight.
      They live on no device and cost no expert compute.
    zero_expert_output: what a zero-computation expert returns: "input" (the token's input
      times its weight, LongCat-Flash's) or "none" (nothing: ZAYA's skip class, a choice
      that only takes a slot of the top-k). "none" needs `num_zero_experts`.
    num_shared_experts: dense experts every token passes through (0 = none). They are stored
      fused as one MLP of width `shared_intermediate_size`.
    shared_intermediate_size: Fs, total hidden width of the shared experts.
    shared_expert_gate: scale the shared experts' output per token by
      `sigmoid(x @ shared_gate_kernel)`, a [D, 1] parameter (Qwen2-MoE, Qwen3-Next).
    shared_expert_scores: the router scores each shared expert too (Inkling): its
      `shared_router_kernel` [D, S] gives S logits per token, whose scores join the chosen
      experts' in the renormalization, and each shared expert's hidden layer is scaled by its
      own renormalized score, times `routed_scaling_factor` like the routed weights. Needs
      `renormalize` and an elementwise scoring ("sigmoid", "sqrtsoftplus"); the S experts
      are `shared_intermediate_size / num_shared_experts` wide each.
    shared_scaling_factor: multiplies the shared experts' output (Cohere2-MoE averages the
      routed and shared outputs: 0.5 here and in `routed_scaling_factor`).
    output_bias: the layer adds a learned bias `output_bias` [D] to every real token's output,
      after the routed and shared experts (JetMoE); padding tokens' outputs stay 0.
    latent_size: L > 0 runs the routed experts in a latent width (Nemotron-H's latent MoE):
      each token's row is projected to L by `latent_in` [D, L] before it is sent, the experts
      are [E, L, 2F] and [E, F, L], and what returns is projected back by `latent_out`
      [L, D] where the token lives; the router and the shared experts see the token itself.
      0: the experts work in D.
    latent_norm_eps: with `latent_size`, each token's latent row r is normalized before it
      is sent, `r * rsqrt(mean(r^2) + eps)` (an RMS norm without a scale: Muse Spark's
      `pre_expert_norm`, whose scale folds into the experts' gate and up projections as it
      loads); None: not normalized.
    expert_output_norm_eps: each routed expert's output y (E's [..., W] rows, W its width) is
      normalized before its routing weight scales it, `y * rsqrt(mean(y^2) + eps)` (Muse
      Spark's `post_expert_norm`, whose scale folds into the down projections as it loads);
      None: not normalized. Not with `apply_router_weight_on_input` (the norm would undo
      the weight); zero-computation experts return their rows unnormalized.
    dtype: compute dtype of the expert matmuls (the router always runs in float32).
    param_dtype: storage dtype of the parameters.
    data_axis: the mesh axis, or tuple of axes (`moejax.axis_groups`), over which tokens are
      split (data parallelism).
    expert_axis: the mesh axis, or tuple of axes, over which experts (and tokens) are split;
      the exchange runs over all of them, S = the product of their sizes. Every axis of the
      layer's mesh must be in exactly one of the two groups.
    expert_fsdp: store the routed experts' weights (biases, quantized values and scales,
      NVFP4's global scales) split over the data group too, along each one's dim 1 (a
      matrix's input axis; a global scale's columns): each device holds 1 / (S · data-group
      size) of them. A call gathers them over the data group once, before its chunk loop,
      and their gradients leave by a reduce-scatter.
    shared_fsdp: store the router's kernel and the shared experts' matrices (the weights
      every device uses whole) split along dim 0 over every device of the mesh, both groups:
      each holds 1 / devices of them, and of their gradients and optimizer state. A call
      gathers them once (the router's before routing, the shared experts' before the chunk
      loop) and their gradients leave by a reduce-scatter. Biases and adapters stay whole.
    expert_backend: "xla" (the better XLA path for the device: the tile loop, or
      ragged_dot for few local experts on a GPU), "pallas" (the fused `kernels_pallas`
      kernels of the device; in the interpreter on a CPU, for testing), "fused" (the whole
      expert MLP on rows read by index, `kernels_pallas.fused_moe`: no permuted copy, no
      argsort, no scatter; interpreted on a CPU) or "auto" (a kernel only where a recorded
      GPU run measured it faster, else "xla"). See `moejax.plan`.
    dispatch: how rows reach the devices of their experts: "all_gather" (every row to every
      expert-axis device, partial sums reduce-scattered back), "all_to_all" (dropless: each
      row only to the devices holding its chosen experts) or "auto": all_to_all only where a
      recorded multi-device run measured it faster on the platform at this expert-axis size
      (`moejax.dispatch.ALL_TO_ALL_FASTER_FROM_AXIS`; none is recorded yet, so all_gather
      everywhere), since fewer bytes alone do not make it faster. See `moejax.dispatch`.
    num_redundant_experts: R, spare physical expert slots holding replicas of busy experts
      (expert-parallel load balancing): the layer holds P = E + R physical experts, P
      divisible by the expert-axis size, and computes by a `moejax.eplb.Placement` passed as
      data (`moe_apply(..., placement=)`). Routing stays over the E logical experts.
    expert_quant: None (float expert weights), "fp8_block" (float8_e4m3fn values with a
      float32 scale per `quant_block_size` block, DeepSeek-V3's fine-grained fp8) or "mxfp4"
      (float4_e2m1fn values with a float8_e8m0fnu scale per 32 values along the input axis,
      OCP MX as GPT-OSS ships it) or "int4_group" (symmetric int4 values with a bfloat16 (or
      float32) scale per group of `quant_block_size[0]` inputs, compressed-tensors'
      pack-quantized as Kimi-K2-Thinking ships it) or "nvfp4" (float4_e2m1fn values with a
      float8_e4m3fn scale per 16 values along the input axis and a float32 global scale per
      matrix, NVIDIA's ModelOpt FP4): `w_gate_up` and `w_down` are then
      `kernels_pallas.quantized.BlockScaled` (`moejax.quant`). The formats and what each
      takes: `kernels_pallas.formats.FORMATS`.
    compute_quant: None (the expert matmuls multiply their operands as they are) or a recipe
      that quantizes both operands of every expert product to float8_e4m3fn on the fly, in
      training and inference, from the float master weights: "fp8_deepseek" (DeepSeek-V3's
      1x128 activation groups and 128x128 weight blocks; D and F multiples of 128),
      "fp8_rowwise" (a scale per row of activations, per output column of weights) or
      "mxfp8" (Blackwell's block-scaled format: power-of-two scales per 32 values along each
      product's contraction; D and F multiples of 32). The scales, product by product:
      `moejax.compute_quant`. Runs on the tile loop (emulated), "fp8_deepseek" with
      `expert_backend="pallas"` on Hopper's fp8 kernels (`moejax.plan.fp8_kernel_reason`)
      and with "fused" on the fused kernels' e4m3 products, with "auto" where a tuning file
      measured one of them fastest for the recipe; not with `expert_quant`.
    dispatch_quant: None, or "fp8": the rows the expert axis exchanges travel as
      float8_e4m3fn values with a float32 scale per 1x128 group (half bf16's bytes),
      dequantized on arrival; their cotangents return unquantized (`moejax.fp8_exchange`).
      The rows' width (D, or `latent_size`) must be a multiple of 128. On an expert axis of
      one device nothing is exchanged: the layer warns and sends nothing quantized.
    quant_block_size: (bi, bo), the fp8_block block over [in, out]; F must be a multiple of
      bo so that no block straddles gate and up. For int4_group, (group, 1) with group in
      its `group_sizes` (32, 64, 128; Kimi's: 32). None (the default): the format's own
      (`QuantFormat.block_for`: fp8_block's 128x128 with bo cut to divide F, int4_group's
      groups of 32); mxfp4 and nvfp4 have fixed blocks.
    lora_rank: r, the rank of LoRA adapters on every routed expert's two projections (and
      on the shared experts'), 0 for none (`moejax.lora`): expert e computes
      `x @ (W_gate_up[e] + s · A[e] @ B[e])`, and the same for down, s = `lora_scale`.
    lora_alpha: PEFT's `lora_alpha`: s = alpha / r.
    lora_rslora: PEFT's `use_rslora`: s = alpha / sqrt(r).
    save_dispatched_rows: in a gradient's forward pass, keep what each chunk's outbound
      exchange delivered (`moejax.remat.DISPATCHED_ROWS`, [chunks, ...] per device) for the
      backward pass, which then sends no chunk again: one exchange per chunk less, for the
      memory of all dispatched rows. Off: the backward pass sends each chunk again.
    batch_invariant: make each token's output, expert ids and weights bit-identical
      whatever else the call holds (other tokens, their number, its position, padding,
      `token_mask`, the chunk size): the router and the shared experts run in fixed row
      blocks and the experts take the tile loop at fixed tile rows, whatever the call's
      size (or the Pallas kernel with `expert_backend="pallas"`; never ragged_dot, whose
      lowering depends on the size). `moejax.invariance`; docs/design.md, "Batch
      invariance" gives the scope and the cost.
    receive_capacity_factor: None (the default: all_to_all's receive buffers hold the worst
      case, S·C rows per chunk), or f > 0: they hold f times the rows a device receives
      when routing is balanced, C·min(K, S) (rounded up to a multiple of 8; at least S,
      at most S·C), so that memory and bytes follow the expected load. Still dropless: a
      chunk for which any device of the expert group would receive more runs again as
      sub-chunks whose worst case fits (`moejax.capacity`); `MoEAux.overflowed_chunks`
      counts them. Needs dispatch="all_to_all".
    capacity_factor: None (the default: dropless, every assignment computed), or f > 0:
      each device computes at most max(El, ceil(f·C·K)) of the (row, choice) assignments
      that reach its El experts in a chunk of C rows per device, f times an even share of
      the S·C·K its expert group sends, and drops the rest (they add nothing to the output
      and get no gradient): Levanter grug's ring capacity, for users who want its
      semantics. Kept in order of local expert, then of the rows as they arrive (all_gather:
      the group's devices in order, each chunk's rows in order), then of choice.
      `MoEAux.dropped_assignments` counts the dropped ones. Depends on the chunk: set
      `chunk_size` to each device's share for one chunk (grug's). Not with
      `receive_capacity_factor` or `batch_invariant`.

  >>> MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128).chunk_size
  'auto'
  >>> MoEConfig(num_experts=8, top_k=9, hidden_size=64, intermediate_size=128)
  Traceback (most recent call last):
  ...
  ValueError: top_k=9 must be in [1, num_experts=8]
  """

  num_experts: int
  top_k: int
  hidden_size: int
  intermediate_size: int
  chunk_size: int | Literal["auto"] = "auto"
  chunk_memory_bytes: int | None = None
  activation: Activation | ActivationFn = "silu"
  swiglu_limit: float = 7.0
  swiglu_alpha: float = 1.702
  gate_softcap: float = 4.0
  up_softcap: float = 25.0
  shared_activation: Activation | None = None
  shared_swiglu_limit: float | None = None
  scoring: Scoring = "softmax"
  sparsemixer_eps: float = 0.01
  router_logit_softcap: float = 0.0
  renormalize: bool = False
  num_expert_groups: int = 1
  topk_groups: int = 1
  group_score: GroupScore | None = None
  dropped_groups: DroppedGroups = "excluded"
  use_routing_bias: bool = False
  routing_bias_on: BiasTarget = "scores"
  router_bias: bool = False
  external_router: bool = False
  routed_scaling_factor: float = 1.0
  expert_bias: bool = False
  apply_router_weight_on_input: bool = False
  num_zero_experts: int = 0
  zero_expert_output: ZeroExpertOutput = "input"
  num_shared_experts: int = 0
  shared_intermediate_size: int = 0
  shared_scaling_factor: float = 1.0
  shared_expert_gate: bool = False
  shared_expert_scores: bool = False
  output_bias: bool = False
  latent_size: int = 0
  latent_norm_eps: float | None = None
  expert_output_norm_eps: float | None = None
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  data_axis: AxisGroup = "data"
  expert_axis: AxisGroup = "expert"
  expert_fsdp: bool = False
  shared_fsdp: bool = False
  expert_backend: ExpertBackend = "auto"
  dispatch: Dispatch = "auto"
  num_redundant_experts: int = 0
  expert_quant: str | None = None  # a `kernels_pallas.formats.FORMATS` name
  compute_quant: ComputeQuant | None = None
  dispatch_quant: Literal["fp8"] | None = None
  quant_block_size: tuple[int, int] | None = None
  lora_rank: int = 0
  lora_alpha: float = 8.0
  lora_rslora: bool = False
  save_dispatched_rows: bool = False
  batch_invariant: bool = False
  receive_capacity_factor: float | None = None
  capacity_factor: float | None = None

  def __post_init__(self) -> None:
    check_field_types(self)
    self._check_sizes()
    self._check_choices()
    self._check_groups()
    self._check_shared()
    self._check_family_options()
    self._check_quant()
    self._check_compute_quant()
    self._check_dispatch_quant()
    self._check_lora()
    # Normalise dtypes so that equal configs hash equally (jnp.float32 vs np.dtype("float32")).
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
    if not jnp.issubdtype(self.dtype, jnp.floating):
      raise ValueError(f"dtype must be a floating dtype, got {self.dtype}")
    if not jnp.issubdtype(self.param_dtype, jnp.floating):
      raise ValueError(f"param_dtype must be a floating dtype, got {self.param_dtype}")
    self._check_axes()

  def _check_axes(self) -> None:
    axis_groups.check_group("data_axis", self.data_axis)
    axis_groups.check_group("expert_axis", self.expert_axis)
    both = [axis for axis in self.data_axes if axis in self.expert_axes]
    if both:
      raise ValueError(
        f"mesh axis {both[0]!r} is in both data_axis={self.data_axis!r} and "
        f"expert_axis={self.expert_axis!r}: each axis belongs to one group"
      )

  def _check_capacity_factor(self) -> None:
    factor = self.capacity_factor
    if factor is None:
      return
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
      raise ValueError(f"capacity_factor must be a number > 0 or None, got {factor!r}")
    for other, why in (
      ("receive_capacity_factor", "its sub-chunks would drop by another chunk"),
      ("batch_invariant", "which assignments drop depends on the other tokens"),
    ):
      if getattr(self, other):
        raise ValueError(f"capacity_factor={factor} cannot be used with {other}: {why}")

  def _check_sizes(self) -> None:
    for name in ("num_experts", "hidden_size", "intermediate_size"):
      if not _positive_int(getattr(self, name)):
        raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
    if self.chunk_size != "auto" and not _positive_int(self.chunk_size):
      raise ValueError(f'chunk_size must be a positive int or "auto", got {self.chunk_size!r}')
    budget = self.chunk_memory_bytes
    if budget is not None and not _positive_int(budget):
      raise ValueError(f"chunk_memory_bytes must be a positive int or None, got {budget!r}")
    capacity = self.receive_capacity_factor
    if capacity is not None and (
      isinstance(capacity, bool) or not isinstance(capacity, int | float) or not capacity > 0
    ):
      raise ValueError(f"receive_capacity_factor must be a number > 0 or None, got {capacity!r}")
    if capacity is not None and self.dispatch != "all_to_all":
      raise ValueError(
        "receive_capacity_factor sizes all_to_all's receive buffers, and dispatch="
        f"{self.dispatch!r} need not run all_to_all (all_gather gathers every row to every "
        "device): set dispatch='all_to_all'"
      )
    self._check_capacity_factor()
    redundant = self.num_redundant_experts
    if not isinstance(redundant, int) or isinstance(redundant, bool) or redundant < 0:
      raise ValueError(f"num_redundant_experts must be an int >= 0, got {redundant!r}")
    if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
    if not self.router_logit_softcap >= 0:
      raise ValueError(f"router_logit_softcap must be >= 0, got {self.router_logit_softcap}")
    if not self.routed_scaling_factor > 0:
      raise ValueError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")

  def _check_choices(self) -> None:
    for name, allowed in (
      ("activation", _ACTIVATIONS),
      ("shared_activation", (*_ACTIVATIONS, None)),
      ("scoring", _SCORINGS),
      ("group_score", _GROUP_SCORES),
      ("dropped_groups", _DROPPED_GROUPS),
      ("zero_expert_output", _ZERO_EXPERT_OUTPUTS),
      ("routing_bias_on", _BIAS_TARGETS),
      ("expert_backend", BACKENDS),
      ("dispatch", DISPATCHES),
    ):
      if name == "activation" and callable(self.activation):  # the caller's own function
        continue
      if getattr(self, name) not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

  def _check_groups(self) -> None:
    groups, kept = self.num_expert_groups, self.topk_groups
    if groups < 1 or self.num_experts % groups:
      raise ValueError(
        f"num_expert_groups={groups} must be >= 1 and divide num_experts={self.num_experts}"
      )
    if not 1 <= kept <= groups:
      raise ValueError(f"topk_groups={kept} must be in [1, num_expert_groups={groups}]")
    if self.top_k > kept * (self.num_experts // groups):
      raise ValueError(
        f"top_k={self.top_k} exceeds the {kept * (self.num_experts // groups)} experts in "
        f"topk_groups={kept} groups of {self.num_experts // groups}"
      )
    if self.sums_group_top2 and groups > 1 and self.num_experts // groups < 2:
      raise ValueError(
        "group_score 'top2_sum' (the default with the routing bias) sums a group's 2 best "
        f"experts: groups of {self.num_experts // groups} need >= 2"
      )

  @property
  def sums_group_top2(self) -> bool:
    """Whether a group ranks by the sum of its best two experts (`group_score`)."""
    if self.group_score is None:
      return self.use_routing_bias
    return self.group_score == "top2_sum"

  def _check_shared(self) -> None:
    if self.num_shared_experts < 0:
      raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
    if self.num_shared_experts and self.shared_intermediate_size < 1:
      raise ValueError(
        f"shared_intermediate_size must be >= 1 when num_shared_experts="
        f"{self.num_shared_experts}, got {self.shared_intermediate_size}"
      )
    if not self.num_shared_experts and self.shared_intermediate_size:
      raise ValueError("shared_intermediate_size is set but num_shared_experts is 0")
    if not self.shared_scaling_factor > 0:
      raise ValueError(f"shared_scaling_factor must be > 0, got {self.shared_scaling_factor}")

  def _check_family_options(self) -> None:
    for name in ("swiglu_limit", "gate_softcap", "up_softcap"):
      if not getattr(self, name) > 0:
        raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
    if self.shared_swiglu_limit is not None and not self.shared_swiglu_limit > 0:
      raise ValueError(f"shared_swiglu_limit must be > 0 or None, got {self.shared_swiglu_limit}")
    if self.routing_bias_on == "logits" and not self.use_routing_bias:
      raise ValueError("routing_bias_on='logits' needs use_routing_bias=True (the bias it places)")
    if self.scoring == "sparsemixer":
      if self.top_k != 2:
        raise ValueError(f"scoring='sparsemixer' needs top_k=2, got top_k={self.top_k}")
      if self.renormalize or self.num_expert_groups > 1:
        raise ValueError("scoring='sparsemixer' takes neither renormalize nor num_expert_groups")
      if not self.sparsemixer_eps >= 0:
        raise ValueError(f"sparsemixer_eps must be >= 0, got {self.sparsemixer_eps}")
    if self.apply_router_weight_on_input and self.top_k != 1:
      raise ValueError(
        f"apply_router_weight_on_input needs top_k=1 (expert(w * x) is linear in w only for "
        f"one expert), got top_k={self.top_k}"
      )
    if not isinstance(self.num_zero_experts, int) or self.num_zero_experts < 0:
      raise ValueError(f"num_zero_experts must be an int >= 0, got {self.num_zero_experts!r}")
    if self.num_zero_experts and self.num_expert_groups > 1:
      raise ValueError("num_zero_experts with num_expert_groups > 1 is not supported")
    if self.zero_expert_output == "none" and not self.num_zero_experts:
      raise ValueError("zero_expert_output='none' describes zero experts: num_zero_experts is 0")
    if self.external_router and self.router_bias:
      raise ValueError(
        "external_router: the logits come with each call, their bias included; router_bias "
        "is a bias of the layer's own router"
      )
    if self.latent_size < 0:
      raise ValueError(f"latent_size must be >= 0, got {self.latent_size}")
    if self.latent_size and (self.num_zero_experts or self.apply_router_weight_on_input):
      raise ValueError(
        "latent_size works with routed experts that compute: neither num_zero_experts nor "
        "apply_router_weight_on_input"
      )
    self._check_norms()
    if self.shared_expert_gate and not self.has_shared_experts:
      raise ValueError("shared_expert_gate needs shared experts (num_shared_experts >= 1)")
    if self.shared_expert_scores:
      self._check_shared_expert_scores()

  def _check_norms(self) -> None:
    for name in ("latent_norm_eps", "expert_output_norm_eps"):
      eps = getattr(self, name)
      if eps is not None and (not _FIELD_KINDS["float"][1](eps) or eps <= 0):
        raise ValueError(f"{name} must be None or a finite number > 0, got {eps!r}")
    if self.latent_norm_eps is not None and not self.latent_size:
      raise ValueError("latent_norm_eps normalizes the latent rows: it needs latent_size > 0")
    if self.expert_output_norm_eps is not None and self.apply_router_weight_on_input:
      raise ValueError(
        "expert_output_norm_eps with apply_router_weight_on_input: the norm of each expert's "
        "output would undo the weight applied to its input"
      )

  def _check_shared_expert_scores(self) -> None:
    if not self.has_shared_experts or self.shared_intermediate_size % self.num_shared_experts:
      raise ValueError(
        "shared_expert_scores needs shared experts whose shared_intermediate_size divides by "
        f"num_shared_experts, got {self.shared_intermediate_size} and {self.num_shared_experts}"
      )
    if not self.renormalize or self.scoring not in ("sigmoid", "sqrtsoftplus"):
      raise ValueError(
        "shared_expert_scores renormalizes each score on its own: it needs renormalize=True "
        f"and scoring 'sigmoid' or 'sqrtsoftplus', got {self.renormalize}, {self.scoring!r}"
      )
    if self.shared_expert_gate:
      raise ValueError("shared_expert_scores and shared_expert_gate both weigh the shared experts")

  def _check_compute_quant(self) -> None:
    recipe = self.compute_quant
    if recipe is None:
      return
    if recipe not in RECIPES:
      raise ValueError(f"compute_quant must be one of {(None, *RECIPES)}, got {recipe!r}")
    if self.expert_quant is not None:
      raise ValueError(
        f"compute_quant={recipe!r} quantizes float master weights on the fly; "
        f"expert_quant={self.expert_quant!r} stores them quantized: choose one"
      )
    width = "latent_size" if self.latent_size else "hidden_size"  # what the experts take
    reason = size_reason(
      recipe, **{width: self.expert_width, "intermediate_size": self.intermediate_size}
    )
    if reason is not None:
      raise ValueError(reason)

  def _check_dispatch_quant(self) -> None:
    if self.dispatch_quant is None:
      return
    if self.dispatch_quant != "fp8":
      raise ValueError(f"dispatch_quant must be None or 'fp8', got {self.dispatch_quant!r}")
    if self.expert_width % GROUP:
      raise ValueError(
        f"dispatch_quant='fp8' sends rows in groups of {GROUP}: their width "
        f"{self.expert_width} must be a multiple of {GROUP}"
      )

  def _check_quant(self) -> None:
    if self.expert_quant is None:
      return
    if self.expert_quant not in FORMATS:
      raise ValueError(f"expert_quant must be one of {(None, *FORMATS)}, got {self.expert_quant!r}")
    form = FORMATS[self.expert_quant]
    block = self.quant_block
    if (
      not isinstance(block, tuple)
      or len(block) != 2
      or not all(isinstance(b, int) and b >= 1 for b in block)
    ):
      raise ValueError(f"quant_block_size must be two positive ints (bi, bo), got {block!r}")
    if form.group_sizes and (block[1] != 1 or block[0] not in form.group_sizes):
      raise ValueError(
        f"quant_block_size must be (group, 1) with group in {form.group_sizes} with "
        f"expert_quant={self.expert_quant!r}, got {block}"
      )
    if self.intermediate_size % block[1]:
      raise ValueError(
        f"intermediate_size={self.intermediate_size} must be a multiple of quant_block_size[1]"
        f"={block[1]} with expert_quant={self.expert_quant!r} (no block may straddle gate and "
        "up)"
      )
    if form.whole_input_blocks:
      for name in ("hidden_size", "intermediate_size"):
        if getattr(self, name) % block[0]:
          raise ValueError(
            f"{name}={getattr(self, name)} must be a multiple of {block[0]} with "
            f"expert_quant={self.expert_quant!r} (one scale per {block[0]} values along each "
            "matrix's input axis)"
          )

  @property
  def data_axes(self) -> tuple[str, ...]:
    """The data group's mesh axes (`data_axis` as a tuple)."""
    return axis_groups.names(self.data_axis)

  @property
  def expert_axes(self) -> tuple[str, ...]:
    """The expert group's mesh axes (`expert_axis` as a tuple)."""
    return axis_groups.names(self.expert_axis)

  def _check_lora(self) -> None:
    rank = self.lora_rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
      raise ValueError(f"lora_rank must be an int >= 0 (0: no adapters), got {rank!r}")
    if not self.lora_alpha > 0:
      raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha!r}")

  @property
  def lora_scale(self) -> float:
    """s, the factor of each adapter's product A @ B: alpha / r (alpha / sqrt(r) with
    `lora_rslora`), as PEFT scales; 0 without adapters."""
    if not self.lora_rank:
      return 0.0
    return self.lora_alpha / (self.lora_rank**0.5 if self.lora_rslora else self.lora_rank)

  @property
  def gated_activation(self) -> GatedActivation:
    """How the experts combine gate and up (`activation`, `swiglu_limit`)."""
    return self._activation(self.activation)

  @property
  def shared_gated_activation(self) -> GatedActivation:
    """How the shared experts combine gate and up (`shared_activation`, else `activation`;
    `shared_swiglu_limit`, else `swiglu_limit`)."""
    return self._activation(self.shared_activation or self.activation, self.shared_swiglu_limit)

  def _activation(self, name: str, limit: float | None = None) -> GatedActivation:
    limit = self.swiglu_limit if limit is None else limit
    return GatedActivation(name, limit, self.swiglu_alpha, self.gate_softcap, self.up_softcap)

  @property
  def quant_block(self) -> tuple[int, int] | None:
    """(bi, bo) of the expert weights' scale blocks: `quant_block_size` (else the format's
    default for the layer's F) for fp8_block and int4_group, (32, 1) for mxfp4, (16, 1) for
    nvfp4, None without quantization."""
    if self.expert_quant is None:
      return None
    form = FORMATS[self.expert_quant]
    return form.block or self.quant_block_size or form.block_for(self.intermediate_size)

  @property
  def num_router_outputs(self) -> int:
    """E + Z: the router's outputs, the routed experts then the zero-computation experts."""
    return self.num_experts + self.num_zero_experts

  @property
  def num_physical_experts(self) -> int:
    """P = E + R: the expert slots holding weights (E without redundant experts)."""
    return self.num_experts + self.num_redundant_experts

  @property
  def expert_width(self) -> int:
    """The routed experts' input and output width: `latent_size`, else D."""
    return self.latent_size or self.hidden_size

  @property
  def has_shared_experts(self) -> bool:
    """Whether the layer holds shared-expert weights."""
    return self.num_shared_experts > 0
