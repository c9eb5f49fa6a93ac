"""Expert compute: the gated MLP of each local expert on the rows routed to it.

`routed_mlp` is the entry; it runs the path of the call's `moejax.plan.ExpertPlan`:

- "tile_loop" (`tile_loop_mlp`): sorts the (row, choice) assignments by expert, pads each
  expert's rows to whole tiles (`kernels_pallas.metadata.aligned_rows`, the layout the Mosaic
  kernels use) and runs one dense [B, D] x [D, 2F] x [F, D] MLP per tile in a `lax.scan`,
  skipping unused tiles with `lax.cond`.
- "ragged_dot" and "pallas" (`grouped_matmul_mlp`): `kernels_pallas.moe_mlp` on the plan's backend
  (XLA's two `jax.lax.ragged_dot`s, or the fused kernels); with LoRA adapters, unfused
  `kernels_pallas.gmm`s on that backend (`adapted_mlp`); with `compute_quant="fp8_deepseek"`,
  the Hopper fp8 kernels' products (`kernels_pallas.gmm_fp8_vjp`, `_fp8_mlp`), on matrices
  quantized once per pass (`with_fp8_blocks`, from the chunk loop's `prepare`).

The tile loop and the grouped matmul paths sort the assignments with
`moejax.sorted_rows.sort_by_expert` (the fused path lays them out by counting); every path
takes the experts' weights as one `moejax.params.ExpertWeights`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import kernels_pallas
from kernels_pallas import fused_moe
from kernels_pallas.gmm_fp8 import Fp8Blocks, fp8_weight, gmm_fp8_vjp
from kernels_pallas.metadata import aligned_rows
from kernels_pallas.quantized import is_block_scaled
from moejax import compute_quant, id_spaces, invariance, tokamax_experts
from moejax.activations import GatedActivation
from moejax.chunking import seed_gradient
from moejax.config import MoEConfig
from moejax.params import ExpertWeights, SharedWeights
from moejax.plan import ExpertPlan
from moejax.sorted_rows import moved_rows, rows_in_expert_order, sort_by_expert, summed_choices
from moejax.tiles import Tiles, gated_mlp, tile_mlp
from moejax.tokamax_experts import TOKAMAX

_MIN_TILE_ROWS = 8
_MAX_TILE_ROWS = 512
_SPREAD_MARGIN = 1.5  # tile rows cover the mean plus this many standard deviations


def default_tile_rows(num_rows: int, num_experts: int) -> int:
  """Rows per tile: most experts' rows in one tile; a multiple of 8 in [8, 512].

  Routed evenly at random, an expert's row count is about Binomial(N, 1/E): mean m = N/E,
  spread about sqrt(m). Tiles of m + 1.5 sqrt(m) rows hold nearly every expert's rows whole,
  so most experts run one matmul of nearly full rows, where tiles of m rows would give about
  half of them a second, mostly padding tile. On one CPU device (E=32, K=2, T=4096) this ran
  1 chunk 15% and 8 or 32 chunks 13-19% faster than power-of-two tiles at most 128
  (docs/performance.md, "Chunk loop"). Static: it depends on shapes only.

  >>> default_tile_rows(1024, 32), default_tile_rows(8192, 32), default_tile_rows(2, 32)
  (40, 280, 8)
  """
  mean = num_rows / num_experts
  rows = _MIN_TILE_ROWS * round((mean + _SPREAD_MARGIN * mean**0.5) / _MIN_TILE_ROWS)
  return min(max(rows, _MIN_TILE_ROWS), _MAX_TILE_ROWS)


def tile_rows_for(config: MoEConfig, num_rows: int) -> int:
  """The tile loop's rows per tile for `num_rows` (row, choice) assignments: fixed with
  `config.batch_invariant` (`moejax.invariance.TILE_ROWS`), else `default_tile_rows`."""
  if config.batch_invariant:
    return invariance.TILE_ROWS
  rows = default_tile_rows(num_rows, config.num_physical_experts)
  group = compute_quant.token_group(config.compute_quant)
  if group is not None and rows > group:
    return -(-rows // group) * group  # whole wgrad groups
  return rows


def tile_loop_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  experts: ExpertWeights,
  *,
  activation: GatedActivation,
  tile_rows: int,
  grad_seeds: ExpertWeights | None = None,
  output_norm_eps: float | None = None,
  recipe: str | None = None,
) -> jax.Array:
  """Weighted sum of each row's chosen local experts: y[n] = sum_k w[n,k] * mlp_{e[n,k]}(x[n])
  (with `output_norm_eps`, each mlp's output RMS-normalized first: `rms_normalized`).

  Args:
    x: [N, D] rows in the compute dtype; rows that route nowhere may hold anything finite.
    expert_ids: [N, K] int32 local expert ids; ids outside [0, El) are experts held elsewhere
      (or padding) and contribute nothing.
    weights: [N, K] float32 combine weights.
    experts: the El local experts' `ExpertWeights` in the compute dtype (no bias work
      without biases).
    activation: the gate/up combination.
    tile_rows: B, rows per tile (see `default_tile_rows`).
    grad_seeds: an `ExpertWeights` of gradient seeds (see `moejax.chunking.ChunkStages`), or
      None.
    output_norm_eps: normalize each expert's output before its weight (`MoEConfig.
      expert_output_norm_eps`): the tiles then return unweighted outputs, normalized and
      weighted here; None: the tiles weigh them.
    recipe: `MoEConfig.compute_quant`: how the tiles' products quantize their operands.

  Returns:
    [N, D] float32.
  """
  rows, top_k = expert_ids.shape
  dim, local_experts = x.shape[-1], experts.w_gate_up.shape[0]
  order, position, group_sizes = sort_by_expert(expert_ids, local_experts)
  layout = aligned_rows(group_sizes, expert_ids.size, tile_rows)
  # Aligned row r holds assignment order[row_source[r]]; its row of x is that // K (row N, the
  # zero row, for empty slots).
  tile_weights = weights.reshape(-1) if output_norm_eps is None else jnp.ones(weights.size)
  assignment = order[jnp.minimum(layout.row_source, expert_ids.size - 1)]
  filled = layout.row_source < expert_ids.size
  row_of = jnp.where(filled, assignment // top_k, rows)
  tile_expert = jnp.searchsorted(
    layout.tile_ends, jnp.arange(row_of.size // tile_rows), "right", method="compare_all"
  )
  tiles = Tiles(
    rows=row_of.reshape(-1, tile_rows),  # [tiles, B]
    weights=jnp.where(filled, tile_weights[assignment], 0.0).reshape(-1, tile_rows),
    expert=jnp.minimum(tile_expert, local_experts - 1).astype(jnp.int32),
    num_used=layout.tile_ends[-1],
  )
  x_padded = jnp.concatenate([x, jnp.zeros((1, dim), x.dtype)])  # row N is the empty row
  tiled_out = tile_mlp(x_padded, experts, tiles, grad_seeds, activation, recipe)  # [tiles, B, D]
  slot_assignment = jnp.where(filled, assignment, expert_ids.size)  # [tiles * B]; N*K: empty
  outputs = moved_rows(tiled_out.reshape(-1, dim), layout.source_row[position], slot_assignment)
  outputs = outputs.reshape(rows, top_k, dim)  # 0 for the experts held elsewhere
  if output_norm_eps is not None:  # unweighted so far (0 for experts held elsewhere)
    outputs = rms_normalized(outputs, output_norm_eps) * weights[..., None]
  return jnp.sum(outputs, axis=1)


def grouped_matmul_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  experts: ExpertWeights,
  *,
  activation: GatedActivation,
  backend: str,
  interpret: bool = False,
  blocks=None,
  output_norm_eps: float | None = None,
  recipe: str | None = None,
) -> jax.Array:
  """`tile_loop_mlp`'s contract on `kernels_pallas.moe_mlp` (fused kernels, or XLA ragged_dot).

  Sorts the N*K assignments by local expert (the others last, past the groups' sum, where
  `moe_mlp` writes 0), runs the MLP with the routing weights in its epilogue (`adapted_mlp`
  with adapters; with `output_norm_eps`, weights of 1 there, the outputs normalized and
  weighted after it), and sums each row's K results. The rows go into expert order and back
  by gathers, forward and backward (`moejax.sorted_rows`).

  Args and returns: as `tile_loop_mlp` (without biases, `tile_rows` and seeds; `activation`
  silu or gelu), plus `backend`, a `kernels_pallas` backend name, `interpret`, to run a
  kernel in its interpreter, `blocks`, the forward kernels' block sizes (None: the
  backend's choice), and `recipe`, "fp8_deepseek" to run every product on the Hopper fp8
  kernels (`kernels_pallas.gmm_fp8_vjp`; the activation between them in XLA).
  """
  top_k = expert_ids.shape[1]
  sorted_ = sort_by_expert(expert_ids, experts.w_gate_up.shape[0])
  group_sizes = sorted_.group_sizes
  x_sorted = rows_in_expert_order(x, sorted_, top_k)  # [N*K, D]
  row_weights = moved_rows(weights.reshape(-1), sorted_.order, sorted_.position)  # [N*K]
  if output_norm_eps is not None:  # weighed after the norm, below
    row_weights, weights_after = jnp.ones_like(row_weights), row_weights
  if backend == TOKAMAX:
    gmm = functools.partial(tokamax_experts.ragged_dot, group_sizes=group_sizes)
    out_sorted = adapted_mlp(x_sorted, experts, row_weights, activation, gmm)
  elif recipe is not None:  # products in float32
    out_sorted = _fp8_mlp(x_sorted, experts, row_weights, activation, group_sizes, interpret)
  elif experts.lora is None:
    out_sorted = kernels_pallas.moe_mlp(
      x_sorted,
      experts.w_gate_up,
      experts.w_down,
      group_sizes,
      row_weights=row_weights.astype(x.dtype),
      activation=activation.name,
      implementation=backend,
      config=blocks,
      interpret=interpret,
    )  # [N*K, D]
  else:
    gmm = functools.partial(
      kernels_pallas.gmm,
      group_sizes=group_sizes,
      implementation=backend,
      config=blocks,
      interpret=interpret,
    )
    out_sorted = adapted_mlp(x_sorted, experts, row_weights, activation, gmm)
  if output_norm_eps is not None:  # rows past the groups' sum are 0, and stay 0
    out_sorted = rms_normalized(out_sorted, output_norm_eps) * weights_after[:, None]
  return summed_choices(out_sorted, sorted_, top_k)


def fused_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  experts: ExpertWeights,
  *,
  activation: GatedActivation,
  interpret: bool = False,
  blocks=None,
  recipe: str | None = None,
  output_norm_eps: float | None = None,
  grad_seeds: ExpertWeights | None = None,
) -> jax.Array:
  """`tile_loop_mlp`'s contract on `kernels_pallas.fused_moe_mlp`: rows read by index, the
  activation, the biases and the routing weight in the kernels' epilogues, the adapters'
  products in the same kernels, each row's K results gathered and summed (with
  `output_norm_eps`, normalized and weighed in XLA first).

  Args and returns: as `tile_loop_mlp` (without `tile_rows`), plus `interpret`, to run the
  kernels in their interpreter, and `blocks`, the kernels' `TritonBlocks` (None: their
  choice by the call's size); `recipe`, the `compute_quant` of the base products
  ("fp8_deepseek") or None, whose matrices `experts.fp8` may hold quantized once per pass
  (`with_fp8_blocks`). The float matrices' gradients accumulate onto their seeds in the
  weight-gradient kernels, in place; the biases' and adapters' get theirs added
  (`with_seeds`).
  """
  matrix_seeds = None
  if grad_seeds is not None:
    experts = with_seeds(experts, grad_seeds._replace(w_gate_up=None, w_down=None))
    if not is_block_scaled(experts.w_gate_up):
      matrix_seeds = (grad_seeds.w_gate_up, grad_seeds.w_down)
  return fused_moe.fused_moe_mlp(
    x,
    expert_ids,
    weights,
    experts.w_gate_up,
    experts.w_down,
    experts.b_gate_up,
    experts.b_down,
    experts.lora,
    activation=activation.in_kernel,
    blocks=blocks,
    interpret=interpret,
    compute_quant=recipe,
    fp8_matrices=experts.fp8,
    output_norm=None if output_norm_eps is None else RowNorm(output_norm_eps),
    grad_seeds=matrix_seeds,
  )


def adapted_mlp(
  x_sorted: jax.Array,
  experts: ExpertWeights,
  row_weights: jax.Array,
  activation: GatedActivation,
  gmm,
) -> jax.Array:
  """`kernels_pallas.moe_mlp` as grouped matmuls of its own, with the experts' adapters if
  they have any: each projection is `gmm(rows, W)`, plus `gmm(gmm(rows, A), B)` with
  adapters, the gated activation between them in XLA.

  Unfused: the [M, 2F] pre-activation goes to memory, and the rank-r products are grouped
  matmuls of their own (r columns, padded to the kernel's blocks).

  Args:
    x_sorted: [M, D] rows grouped by local expert in order, in the compute dtype.
    experts: the local `ExpertWeights`, with or without `lora`.
    row_weights: [M] float32 routing weight of each row.
    activation: the gate/up combination.
    gmm: `kernels_pallas.gmm` bound to the groups and the backend: (lhs, rhs) -> [M, N];
      rows past the groups' sum give 0.

  Returns:
    [M, D] float32.
  """

  def project(rows, w, a=None, b=None):
    full = gmm(rows, w, preferred_element_type=jnp.float32)
    if a is None:
      return full
    low_rank = gmm(rows, a, preferred_element_type=jnp.float32).astype(rows.dtype)  # [M, r]
    return full + gmm(low_rank, b, preferred_element_type=jnp.float32)

  lora = experts.lora
  gate_up_adapter = () if lora is None else (lora.gate_up_a, lora.gate_up_b)
  down_adapter = () if lora is None else (lora.down_a, lora.down_b)
  gate_up = project(x_sorted, experts.w_gate_up, *gate_up_adapter)  # [M, 2F]
  hidden = activation(*jnp.split(gate_up, 2, axis=-1)).astype(x_sorted.dtype)  # [M, F]
  return project(hidden, experts.w_down, *down_adapter) * row_weights[:, None]


def _fp8_mlp(
  x_sorted: jax.Array,
  experts: ExpertWeights,
  row_weights: jax.Array,
  activation: GatedActivation,
  group_sizes: jax.Array,
  interpret: bool,
) -> jax.Array:
  """`adapted_mlp` (without adapters) on the Hopper fp8 kernels: each product by
  `gmm_fp8_vjp`, on the matrices' fp8 blocks where `experts.fp8` holds them (quantized once
  per pass, `with_fp8_blocks`), else quantizing the matrices here."""
  gate_up_fp8, down_fp8 = experts.fp8 or (None, None)
  product = lambda rows, w, w_fp8: gmm_fp8_vjp(rows, w, group_sizes, w_fp8, Fp8Blocks(), interpret)
  gate_up = product(x_sorted, experts.w_gate_up, gate_up_fp8)  # [M, 2F] float32
  hidden = activation(*jnp.split(gate_up, 2, axis=-1)).astype(x_sorted.dtype)  # [M, F]
  return product(hidden, experts.w_down, down_fp8) * row_weights[:, None]


def runs_fp8_kernels(config: MoEConfig, plan: ExpertPlan) -> bool:
  """Whether the plan's expert path multiplies on fp8 kernels (`compute_quant` on
  `grouped_matmul_mlp`'s own kernels, which `moejax.plan.fp8_kernel_reason` chose, or on the
  fused path)."""
  grouped = plan.path in ("pallas", "ragged_dot") and plan.backend != TOKAMAX
  return (grouped or plan.path == "fused") and config.compute_quant is not None


def with_fp8_blocks(experts: ExpertWeights, *, plan: ExpertPlan) -> ExpertWeights:
  """`experts` holding their matrices' fp8 blocks (`ExpertWeights.fp8`), for a pass whose
  every chunk multiplies by them on the plan's fp8 kernels (the Hopper kernels' layouts,
  `gmm_fp8.fp8_weight`, or the fused path's `fused_moe.fp8_matrix`): quantized here, once, not
  per chunk and product. Constants for autodiff: the kernels' VJP gives the float matrices
  their gradients."""
  if plan.path == "fused":
    blocks = fused_moe.fp8_matrix
  else:
    blocks = lambda w: fp8_weight(jax.lax.stop_gradient(w), interpret=plan.interpret)
  return experts._replace(fp8=(blocks(experts.w_gate_up), blocks(experts.w_down)))


def routed_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  experts: ExpertWeights,
  *,
  config: MoEConfig,
  plan: ExpertPlan,
  grad_seeds: ExpertWeights | None = None,
) -> jax.Array:
  """The local experts' weighted output on rows routed to them, by the plan's path.

  With `config.apply_router_weight_on_input` (K=1) each row is scaled by its weight before
  its expert, and the output is not weighted.

  Args and returns: as `tile_loop_mlp` (without `tile_rows` and `activation`), plus the call's
  `plan` (`moejax.plan.plan_experts`). The tile loop accumulates onto `grad_seeds` in place;
  the fused path's kernels sum the matrices' gradients onto theirs in place; the grouped
  matmul paths add them (`moejax.chunking.seed_gradient`).
  """
  if config.apply_router_weight_on_input:
    local_experts = experts.w_gate_up.shape[0]
    local = id_spaces.is_local(expert_ids, local_experts)
    x = (x.astype(jnp.float32) * jnp.sum(weights, axis=-1, keepdims=True)).astype(x.dtype)
    weights = local.astype(jnp.float32)
  if plan.path == "tile_loop":
    return tile_loop_mlp(
      x,
      expert_ids,
      weights,
      experts,
      activation=config.gated_activation,
      tile_rows=tile_rows_for(config, expert_ids.size),
      grad_seeds=grad_seeds,
      output_norm_eps=config.expert_output_norm_eps,
      recipe=config.compute_quant,
    )
  if plan.path == "fused":
    return fused_mlp(
      x, expert_ids, weights, experts, activation=config.gated_activation,
      interpret=plan.interpret, blocks=plan.blocks, recipe=config.compute_quant,
      output_norm_eps=config.expert_output_norm_eps, grad_seeds=grad_seeds,
    )  # fmt: skip
  if grad_seeds is not None:
    experts = with_seeds(experts, grad_seeds)
  return grouped_matmul_mlp(
    x,
    expert_ids,
    weights,
    experts,
    activation=config.gated_activation,
    backend=plan.backend,
    interpret=plan.interpret,
    blocks=plan.blocks,
    output_norm_eps=config.expert_output_norm_eps,
    recipe=config.compute_quant,
  )


def rms_normalized(rows: jax.Array, eps: float) -> jax.Array:
  """[..., W] rows over their last axis, `r * rsqrt(mean(r^2) + eps)`, in float32 (an RMS
  norm without a scale; a row of zeros stays zeros).

  >>> rms_normalized(jnp.array([[2.0, -2.0], [0.0, 0.0]]), 1e-6).round(3).tolist()
  [[1.0, -1.0], [0.0, 0.0]]
  """
  rows = rows.astype(jnp.float32)
  return rows * jax.lax.rsqrt(jnp.mean(jnp.square(rows), axis=-1, keepdims=True) + eps)


@dataclasses.dataclass(frozen=True)
class RowNorm:
  """`rms_normalized` at `eps` as a function of the rows alone, equal by value (a fused
  kernel setting: `kernels_pallas.fused_moe_mlp`'s `output_norm`)."""

  eps: float

  def __call__(self, rows: jax.Array) -> jax.Array:
    return rms_normalized(rows, self.eps)


def with_seeds(experts: ExpertWeights, grad_seeds: ExpertWeights) -> ExpertWeights:
  """`experts` whose gradient gets `grad_seeds` added (`moejax.chunking.seed_gradient`): the
  `ChunkStages` promise, for a path that does not accumulate in place."""
  seeds = grad_seeds._replace(fp8=None)  # the fp8 blocks are constants
  return ExpertWeights(*map(_seeded, experts, seeds))


def _seeded(weight, seed):
  """`weight` (an array or adapters) with `seed` added to its gradient; a constant
  (quantized) matrix, or one without a seed, as it is."""
  if seed is None or is_block_scaled(weight):
    return weight
  return jax.tree.map(seed_gradient, weight, seed)


def zero_experts(
  rows: jax.Array, expert_ids: jax.Array, weights: jax.Array, *, config: MoEConfig
) -> jax.Array:
  """What a row's zero-computation experts return: the row itself times their weights.

  Computed where the row lives, never sent (LongCat-Flash's "zero experts").

  Args:
    rows: [C, D] in the compute dtype.
    expert_ids: [C, K] physical ids; zero experts are [P, P + Z) (`moejax.id_spaces`).
    weights: [C, K] float32.
    config: the layer's config.

  Returns:
    [C, D] float32.
  """
  zero = id_spaces.is_zero_expert(expert_ids, config)
  zero_weight = jnp.sum(jnp.where(zero, weights, 0.0), axis=-1, keepdims=True)
  return zero_weight * rows.astype(jnp.float32)


def latent_projection(rows: jax.Array, matrix: jax.Array, *, config: MoEConfig) -> jax.Array:
  """Rows [C, A] times a latent projection [A, B] (`latent_in` or `latent_out`), in fixed
  blocks of rows with `config.batch_invariant`.

  Returns:
    [C, B] in the compute dtype.
  """

  def project(block: jax.Array) -> jax.Array:
    out = jnp.dot(block.astype(config.dtype), matrix, preferred_element_type=jnp.float32)
    return out.astype(config.dtype)

  return invariance.in_row_blocks(project, rows, invariance.block_rows(config))


def shared_mlp(
  x: jax.Array,
  shared: SharedWeights,
  weights: jax.Array | None = None,
  *,
  config: MoEConfig,
) -> jax.Array:
  """The shared experts (fused into one MLP of width Fs) on every row.

  Args:
    x: [C, D] rows in the compute dtype (in fixed blocks with `config.batch_invariant`).
    shared: the `SharedWeights`; with a `gate_kernel` ([D, 1], `config.shared_expert_gate`)
      the output is scaled per row by `sigmoid(x @ gate_kernel)`; with adapters each
      projection adds theirs.
    weights: [C, S] float32 each row's weight of each of the S shared experts
      (`config.shared_expert_scores`): expert s's hidden layer, columns [s Fs/S, (s+1) Fs/S),
      is scaled by it; or None.
    config: the layer's config (its shared experts' activation, `shared_scaling_factor`).

  Returns:
    [C, D] float32.
  """

  def shared_rows(rows_and_weights: tuple[jax.Array, jax.Array | None]) -> jax.Array:
    rows, row_weights = rows_and_weights
    hidden_scale = None
    if row_weights is not None:  # each shared expert's hidden columns by its weight
      width = shared.w_down.shape[0] // row_weights.shape[-1]
      hidden_scale = jnp.repeat(row_weights, width, axis=-1)
    out = gated_mlp(
      rows,
      shared.w_gate_up,
      shared.w_down,
      config.shared_gated_activation,
      lora=shared.lora,
      hidden_scale=hidden_scale,
    )
    if config.shared_scaling_factor != 1.0:
      out = out * config.shared_scaling_factor
    if shared.gate_kernel is None:
      return out
    gate = jnp.dot(
      rows.astype(jnp.float32),
      shared.gate_kernel.astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST,
    )
    return out * jax.nn.sigmoid(gate)

  return invariance.in_row_blocks(shared_rows, (x, weights), invariance.block_rows(config))
