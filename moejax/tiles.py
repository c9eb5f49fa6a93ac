"""The tile loop of the XLA expert path: one gated MLP per tile, with a hand-written backward.

Autodiff of a `lax.scan` that indexes the expert weights per tile (`w[expert]`) transposes
each index into a full-size zero tensor plus an add: O(El * D * F) memory traffic per tile,
which made the backward pass ~40x slower than the forward. The backward here instead
accumulates weight gradients in the scan carry with in-place dynamic-update-slices, touching
only the tile's expert, and skips unused tiles like the forward does.

Quantized expert weights (`BlockScaled`) are sliced per tile like float ones and dequantized
to the compute dtype inside the tile: no copy of all experts' float weights ever exists. They
are constants: the backward computes no gradient for them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moejax.activations import GatedActivation
from moejax.collectives import filled_like
from moejax.params import ExpertWeights


def gated_mlp(
  x: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  activation: GatedActivation,
  b_gate_up: jax.Array | None = None,
  b_down: jax.Array | None = None,
) -> jax.Array:
  """`combine(x @ W_gate + b_gate, x @ W_up + b_up) @ W_down + b_down`, accumulated in float32.

  Args:
    x: [M, D] rows, in the compute dtype.
    w_gate_up: [D, 2F]; gate is `[:, :F]`, up is `[:, F:]`.
    w_down: [F, D].
    activation: the gate/up combination.
    b_gate_up: [2F] bias, or None.
    b_down: [D] bias, or None.

  Returns:
    [M, D] float32.
  """
  gate_up = jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32)  # [M, 2F]
  if b_gate_up is not None:
    gate_up = gate_up + b_gate_up.astype(jnp.float32)[None, :]
  hidden = activation(*jnp.split(gate_up, 2, axis=-1)).astype(x.dtype)  # [M, F]
  out = jnp.dot(hidden, w_down, preferred_element_type=jnp.float32)
  return out if b_down is None else out + b_down.astype(jnp.float32)[None, :]


class Tiles(NamedTuple):
  """Which rows each tile of the tile loop runs, with what weights, through which expert.

  Attributes:
    tokens: [tiles, B] int32 row of each tile slot (the zero row for empty slots).
    weights: [tiles, B] float32 weight of each slot's output (0 for empty slots).
    expert: [tiles] int32 expert of each tile.
    num_used: [] int32 tiles in use; the rest are skipped and give 0.
  """

  tokens: jax.Array
  weights: jax.Array
  expert: jax.Array
  num_used: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def tile_mlp(x_padded, experts, tiles, grad_seeds, activation):
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

  Returns:
    [tiles, B, D] float32: slot (t, b) holds `tiles.weights[t, b] * mlp_e(x_padded[row])`,
    e = `tiles.expert[t]`, row = `tiles.tokens[t, b]`.
  """
  tile_rows, dim = tiles.tokens.shape[1], x_padded.shape[1]

  def used_tile(tokens, row_weights, expert):
    one = experts.of_expert(expert, x_padded.dtype)
    out = gated_mlp(x_padded[tokens], one.w_gate_up, one.w_down, activation, *one[2:])
    return out * row_weights[:, None]

  def run_tile(_, tile):
    index, tokens, row_weights, expert = tile
    out = jax.lax.cond(
      index < tiles.num_used,
      lambda: used_tile(tokens, row_weights, expert),
      lambda: filled_like(x_padded, (tile_rows, dim), 0, jnp.float32),
    )
    return None, out

  steps = (jnp.arange(tiles.tokens.shape[0]), tiles.tokens, tiles.weights, tiles.expert)
  return jax.lax.scan(run_tile, None, steps)[1]


def _tile_mlp_fwd(x_padded, experts, tiles, grad_seeds, activation):
  residuals = (x_padded, experts, tiles, grad_seeds)
  return tile_mlp(*residuals, activation), residuals


def _tile_grads(x, one, row_weights, d_out, activation, weight_grads):
  """Gradients of one tile's weighted gated MLP `r * mlp(x)`; recomputes the pre-activation.

  The row weights' gradient <d_out, mlp(x)> needs no forward output: with g = d_out @ W_down^T
  it is sum(g * hidden) (+ d_out . b_down), and g times the row weight is d(hidden).

  Args: x [B, D]; `one`, the tile's expert (`ExpertWeights.of_expert`, compute dtype);
    row_weights [B] float32; d_out [B, D] float32; `weight_grads` False for constant
    (quantized) matrices.
  Returns: (d_x [B, D], d_row_weights [B], an `ExpertWeights` of the expert's gradients),
    float32; None where there is no bias, and for the matrices without `weight_grads`.
  """
  f32 = jnp.float32
  biased = one.b_gate_up is not None
  gate_up = jnp.dot(x, one.w_gate_up, preferred_element_type=f32)
  if biased:
    gate_up = gate_up + one.b_gate_up.astype(f32)[None, :]
  hidden, combine_vjp = jax.vjp(activation, *jnp.split(gate_up, 2, axis=-1))
  hidden = hidden.astype(x.dtype)  # [B, F], as the forward pass rounded it
  g = jnp.dot(d_out.astype(x.dtype), one.w_down.T, preferred_element_type=f32)  # [B, F]
  d_row_weights = jnp.sum(g * hidden.astype(f32), axis=-1)
  if biased:
    d_row_weights = d_row_weights + d_out @ one.b_down.astype(f32)
  d_mlp = d_out * row_weights[:, None]  # [B, D] cotangent of the unweighted MLP output
  d_gate_up = jnp.concatenate(combine_vjp(g * row_weights[:, None]), axis=-1)  # [B, 2F]
  d_biases = (jnp.sum(d_gate_up, axis=0), jnp.sum(d_mlp, axis=0)) if biased else (None, None)
  d_mlp = d_mlp.astype(x.dtype)
  d_w_down = jnp.dot(hidden.T, d_mlp, preferred_element_type=f32) if weight_grads else None
  d_gate_up = d_gate_up.astype(x.dtype)
  d_w_gate_up = jnp.dot(x.T, d_gate_up, preferred_element_type=f32) if weight_grads else None
  d_x = jnp.dot(d_gate_up, one.w_gate_up.T, preferred_element_type=f32)  # [B, D]
  return d_x, d_row_weights, ExpertWeights(d_w_gate_up, d_w_down, *d_biases)


def _add_at(total: jax.Array, index: jax.Array, update: jax.Array) -> jax.Array:
  """total[index] += update, as dynamic slices (in place inside a loop)."""
  start = (index,) + (0,) * update.ndim
  current = jax.lax.dynamic_slice(total, start, (1, *update.shape))
  return jax.lax.dynamic_update_slice(total, current + update[None], start)


def _accumulator(weight, seed: jax.Array | None, trained: bool) -> jax.Array | None:
  """Where a float32 gradient accumulation for `weight` starts: its seed, else zeros (None
  where nothing is accumulated: no such weight, or a constant one)."""
  if weight is None or not trained:
    return None
  return jnp.zeros_like(weight, jnp.float32) if seed is None else seed.astype(jnp.float32)


def _tile_mlp_bwd(activation, residuals, d_tiles):
  x_padded, experts, tiles, grad_seeds = residuals
  trained = not experts.quantized  # quantized matrices are constants
  with_grads = ExpertWeights(trained, trained, True, True)  # biases are always float
  seeds = grad_seeds or ExpertWeights(None, None)
  accumulators = zip(experts, seeds, with_grads, strict=True)
  init = (
    jnp.zeros_like(x_padded, jnp.float32),
    ExpertWeights(*(_accumulator(w, seed, on) for w, seed, on in accumulators)),
  )

  def tile_backward(carry, tile):
    index, tokens, row_weights, expert, d_out = tile

    def accumulate(carry):
      d_x, d_experts = carry
      one = experts.of_expert(expert, x_padded.dtype)
      d_tile_x, d_row_weights, grads = _tile_grads(
        x_padded[tokens], one, row_weights, d_out, activation, trained
      )
      d_experts = ExpertWeights(
        *(
          None if g is None else _add_at(total, expert, g)
          for total, g in zip(d_experts, grads, strict=True)
        )
      )
      return (d_x.at[tokens].add(d_tile_x), d_experts), d_row_weights

    skip = lambda carry: (carry, jnp.zeros_like(row_weights))
    return jax.lax.cond(index < tiles.num_used, accumulate, skip, carry)

  steps = (jnp.arange(tiles.tokens.shape[0]), tiles.tokens, tiles.weights, tiles.expert, d_tiles)
  (d_x, d_experts), d_tile_weights = jax.lax.scan(tile_backward, init, steps)
  d_experts = ExpertWeights(
    *(None if g is None else g.astype(w.dtype) for g, w in zip(d_experts, experts, strict=True))
  )
  d_tiles = Tiles(None, d_tile_weights, None, None)
  return d_x.astype(x_padded.dtype), d_experts, d_tiles, None


tile_mlp.defvjp(_tile_mlp_fwd, _tile_mlp_bwd)
