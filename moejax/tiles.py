"""The tile loop of the XLA expert path: one gated MLP per tile, with a hand-written backward.

Autodiff of a `lax.scan` that indexes the expert weights per tile (`w[expert]`) transposes
each index into a full-size zero tensor plus an add: O(El * D * F) memory traffic per tile,
which made the backward pass ~40x slower than the forward. The backward here instead
accumulates weight gradients in the scan carry with in-place dynamic-update-slices, touching
only the tile's expert, and skips unused tiles like the forward does.

Quantized expert weights (`BlockScaled`) are sliced per tile like float ones and dequantized
to the compute dtype inside the tile: no copy of all experts' float weights ever exists. They
are constants: the backward computes no gradient for them.

LoRA adapters (`ExpertWeights.lora`, s folded into B) add `(x @ A) @ B` to each projection of
a tile, and their gradients accumulate like the weights'; a base weight whose gradient nobody
asks for is dead code XLA removes (with adapters the caller usually asks for theirs only).

With a `compute_quant` recipe every base product of a tile, forward and backward, multiplies
operands quantized as the recipe says (`moejax.compute_quant.matmul`); adapters do not.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax import compute_quant
from moejax.activations import GatedActivation
from moejax.collectives import filled_like
from moejax.lora import ExpertLoRA, SharedLoRA
from moejax.params import ExpertWeights


def gated_mlp(
  x: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  activation: GatedActivation,
  b_gate_up: jax.Array | None = None,
  b_down: jax.Array | None = None,
  lora: ExpertLoRA | SharedLoRA | None = None,
  hidden_scale: jax.Array | None = None,
  recipe: str | None = None,
) -> jax.Array:
  """`combine(x @ W_gate + b_gate, x @ W_up + b_up) @ W_down + b_down`, accumulated in float32.

  Args:
    x: [M, D] rows, in the compute dtype.
    w_gate_up: [D, 2F]; gate is `[:, :F]`, up is `[:, F:]`.
    w_down: [F, D].
    activation: the gate/up combination.
    b_gate_up: [2F] bias, or None.
    b_down: [D] bias, or None.
    lora: one expert's adapters (A [in, r], B [r, out] with the scale folded in), or None:
      each projection then adds `(rows @ A) @ B`.
    hidden_scale: [M, F] float32 factors of the hidden layer before the down projection, or
      None.
    recipe: a `compute_quant` recipe for the two base products, or None.

  Returns:
    [M, D] float32.
  """
  gate_up = _projection(x, w_gate_up, _gate_up_pair(lora), recipe)  # [M, 2F]
  if b_gate_up is not None:
    gate_up = gate_up + b_gate_up.astype(jnp.float32)[None, :]
  hidden = activation(*jnp.split(gate_up, 2, axis=-1))  # [M, F]
  if hidden_scale is not None:
    hidden = hidden * hidden_scale
  hidden = hidden.astype(x.dtype)
  out = _projection(hidden, w_down, _down_pair(lora), recipe)
  return out if b_down is None else out + b_down.astype(jnp.float32)[None, :]


def _gate_up_pair(lora: ExpertLoRA | SharedLoRA | None) -> tuple | None:
  """(A, B) of the gate/up projection's adapter, or None."""
  return None if lora is None else (lora.gate_up_a, lora.gate_up_b)


def _down_pair(lora: ExpertLoRA | SharedLoRA | None) -> tuple | None:
  """(A, B) of the down projection's adapter, or None."""
  return None if lora is None else (lora.down_a, lora.down_b)


def _projection(
  x: jax.Array, w: jax.Array, adapter: tuple | None, recipe: str | None = None
) -> jax.Array:
  """`x @ w (+ (x @ a) @ b)` in float32 for an `adapter` (a, b), the rank-r product rounded
  to the compute dtype between its two matmuls; x @ w quantized by `recipe` (forward)."""
  out = compute_quant.matmul(x, w, recipe, "forward")
  if adapter is None:
    return out
  a, b = adapter
  low_rank = jnp.dot(x, a, preferred_element_type=jnp.float32).astype(x.dtype)
  return out + jnp.dot(low_rank, b, preferred_element_type=jnp.float32)


class Tiles(NamedTuple):
  """Which rows each tile of the tile loop runs, with what weights, through which expert.

  Attributes:
    rows: [tiles, B] int32 row of each tile slot (the zero row for empty slots).
    weights: [tiles, B] float32 weight of each slot's output (0 for empty slots).
    expert: [tiles] int32 expert of each tile.
    num_used: [] int32 tiles in use; the rest are skipped and give 0.
  """

  rows: jax.Array
  weights: jax.Array
  expert: jax.Array
  num_used: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def tile_mlp(x_padded, experts, tiles, grad_seeds, activation, recipe):
  """Runs each used tile's rows through its expert's gated MLP, scaled by their row weights.

  The row weights are applied here, not by the caller, so that the backward pass needs no
  output of the forward pass: their gradient comes from values the backward computes anyway
  (see `_tile_grads`), and a caller that recomputes the forward to differentiate it (the
  chunk loop's backward) has that recomputation removed as dead code.

  A tile past `tiles.num_used` reads nothing: its expert's weights are sliced inside the taken
  branch of its `lax.cond`, so a call's weight traffic follows the experts that have rows
  (at T=1, K=2 that is two experts' weights, not El).

  Args:
    x_padded: [N+1, D] rows in the compute dtype; row N is zero (empty tile slots point at it).
    experts: the local experts' `ExpertWeights` (no bias work at all without biases).
    tiles: the `Tiles`.
    grad_seeds: an `ExpertWeights` of gradient seeds (`moejax.chunking.ChunkStages`), each
      field shaped like its weight, or None: the backward pass accumulates each float
      weight's gradient onto its seed in place. Gets no gradient itself.
    activation: the `GatedActivation`.
    recipe: a `compute_quant` recipe of the base products, forward and backward, or None.

  Returns:
    [tiles, B, D] float32: slot (t, b) holds `tiles.weights[t, b] * mlp_e(x_padded[row])`,
    e = `tiles.expert[t]`, row = `tiles.rows[t, b]`.
  """
  tile_rows, dim = tiles.rows.shape[1], x_padded.shape[1]

  def used_tile(rows, row_weights, expert):
    one = experts.of_expert(expert, x_padded.dtype)
    out = gated_mlp(
      x_padded[rows], one.w_gate_up, one.w_down, activation, one.b_gate_up, one.b_down, one.lora,
      recipe=recipe,
    )  # fmt: skip
    return out * row_weights[:, None]

  def run_tile(_, tile):
    index, rows, row_weights, expert = tile
    out = jax.lax.cond(
      index < tiles.num_used,
      lambda: used_tile(rows, row_weights, expert),
      lambda: filled_like(x_padded, (tile_rows, dim), 0, jnp.float32),
    )
    return None, out

  steps = (jnp.arange(tiles.rows.shape[0]), tiles.rows, tiles.weights, tiles.expert)
  return jax.lax.scan(run_tile, None, steps)[1]


def _tile_mlp_fwd(x_padded, experts, tiles, grad_seeds, activation, recipe):
  residuals = (x_padded, experts, tiles, grad_seeds)
  return tile_mlp(*residuals, activation, recipe), residuals


def _tile_grads(x, one, row_weights, d_out, activation, weight_grads, recipe):
  """Gradients of one tile's weighted gated MLP `r * mlp(x)`; recomputes the pre-activation.

  The row weights' gradient <d_out, mlp(x)> needs no forward output: with g = d_out @ W_down^T
  it is sum(g * hidden) (+ d_out . b_down), and g times the row weight is d(hidden).

  Args: x [B, D]; `one`, the tile's expert (`ExpertWeights.of_expert`, compute dtype);
    row_weights [B] float32; d_out [B, D] float32; `weight_grads` False for constant
    (quantized) matrices; `recipe`, the base products' `compute_quant` recipe or None.
  Returns: (d_x [B, D], d_row_weights [B], an `ExpertWeights` of the expert's gradients),
    float32; None where there is no bias or adapter, and for the matrices without
    `weight_grads`.
  """
  f32 = jnp.float32
  dot = lambda a, b: jnp.dot(a, b, preferred_element_type=f32)
  dgrad = lambda g, w: compute_quant.matmul(g, w.T, recipe, "dgrad")  # g @ w^T
  wgrad = lambda a, g: compute_quant.matmul(a.T, g, recipe, "wgrad")  # a^T @ g
  biased, lora = one.b_gate_up is not None, one.lora
  gate_up = _projection(x, one.w_gate_up, _gate_up_pair(lora), recipe)
  if biased:
    gate_up = gate_up + one.b_gate_up.astype(f32)[None, :]
  hidden, combine_vjp = jax.vjp(activation, *jnp.split(gate_up, 2, axis=-1))
  hidden = hidden.astype(x.dtype)  # [B, F], as the forward pass rounded it
  d_out_c = d_out.astype(x.dtype)
  g = dgrad(d_out_c, one.w_down)  # [B, F]
  if lora is not None:  # the down adapter's share of d(hidden): (d_out @ B_d^T) @ A_d^T
    d_down_low = dot(d_out_c, lora.down_b.T)  # [B, r]
    g = g + dot(d_down_low.astype(x.dtype), lora.down_a.T)
  d_row_weights = jnp.sum(g * hidden.astype(f32), axis=-1)
  if biased:
    d_row_weights = d_row_weights + d_out @ one.b_down.astype(f32)
  d_mlp = d_out * row_weights[:, None]  # [B, D] cotangent of the unweighted MLP output
  d_gate_up = jnp.concatenate(combine_vjp(g * row_weights[:, None]), axis=-1)  # [B, 2F]
  d_biases = (jnp.sum(d_gate_up, axis=0), jnp.sum(d_mlp, axis=0)) if biased else (None, None)
  d_mlp = d_mlp.astype(x.dtype)
  d_w_down = wgrad(hidden, d_mlp) if weight_grads else None
  d_gate_up = d_gate_up.astype(x.dtype)
  d_w_gate_up = wgrad(x, d_gate_up) if weight_grads else None
  d_x = dgrad(d_gate_up, one.w_gate_up)  # [B, D]
  d_lora = None
  if lora is not None:
    x_low = dot(x, lora.gate_up_a).astype(x.dtype)  # [B, r], as the forward rounded them
    hidden_low = dot(hidden, lora.down_a).astype(x.dtype)
    d_down_low = (d_down_low * row_weights[:, None]).astype(x.dtype)  # of the weighted MLP
    d_gate_up_low = dot(d_gate_up, lora.gate_up_b.T)  # [B, r]
    d_x = d_x + dot(d_gate_up_low.astype(x.dtype), lora.gate_up_a.T)
    d_lora = ExpertLoRA(
      gate_up_a=dot(x.T, d_gate_up_low.astype(x.dtype)),
      gate_up_b=dot(x_low.T, d_gate_up),
      down_a=dot(hidden.T, d_down_low),
      down_b=dot(hidden_low.T, d_mlp),
    )
  return d_x, d_row_weights, ExpertWeights(d_w_gate_up, d_w_down, *d_biases, d_lora)


def _add_at(total, index: jax.Array, update):
  """total[index] += update for each leaf, as dynamic slices (in place inside a loop)."""

  def add(total, update):
    start = (index,) + (0,) * update.ndim
    current = jax.lax.dynamic_slice(total, start, (1, *update.shape))
    return jax.lax.dynamic_update_slice(total, current + update[None], start)

  return jax.tree.map(add, total, update)


def _accumulator(weight, seed, trained: bool):
  """Where a float32 gradient accumulation for `weight` (an array or adapters) starts: its
  seed, else zeros (None where nothing is accumulated: no such weight, or a constant one)."""
  if weight is None or not trained:
    return None
  if seed is None:
    return jax.tree.map(lambda w: jnp.zeros_like(w, jnp.float32), weight)
  return jax.tree.map(lambda s: s.astype(jnp.float32), seed)


def _tile_mlp_bwd(activation, recipe, residuals, d_tiles):
  x_padded, experts, tiles, grad_seeds = residuals
  trained = not experts.quantized  # quantized matrices are constants
  with_grads = ExpertWeights(trained, trained, True, True, True)  # biases, adapters: float
  seeds = grad_seeds or ExpertWeights(None, None)
  accumulators = zip(experts, seeds, with_grads, strict=True)
  init = (
    jnp.zeros_like(x_padded, jnp.float32),
    ExpertWeights(*(_accumulator(w, seed, on) for w, seed, on in accumulators)),
  )

  def tile_backward(carry, tile):
    index, rows, row_weights, expert, d_out = tile

    def accumulate(carry):
      d_x, d_experts = carry
      one = experts.of_expert(expert, x_padded.dtype)
      d_tile_x, d_row_weights, grads = _tile_grads(
        x_padded[rows], one, row_weights, d_out, activation, trained, recipe
      )
      d_experts = ExpertWeights(
        *(
          None if g is None else _add_at(total, expert, g)
          for total, g in zip(d_experts, grads, strict=True)
        )
      )
      return (d_x.at[rows].add(d_tile_x), d_experts), d_row_weights

    skip = lambda carry: (carry, jnp.zeros_like(row_weights))
    return jax.lax.cond(index < tiles.num_used, accumulate, skip, carry)

  steps = (jnp.arange(tiles.rows.shape[0]), tiles.rows, tiles.weights, tiles.expert, d_tiles)
  (d_x, d_experts), d_tile_weights = jax.lax.scan(tile_backward, init, steps)
  cast = lambda g, w: jax.tree.map(lambda g, w: g.astype(w.dtype), g, w)
  d_experts = ExpertWeights(
    *(None if g is None else cast(g, w) for g, w in zip(d_experts, experts, strict=True))
  )
  d_tiles = Tiles(None, d_tile_weights, None, None)
  return d_x.astype(x_padded.dtype), d_experts, d_tiles, None


tile_mlp.defvjp(_tile_mlp_fwd, _tile_mlp_bwd)
