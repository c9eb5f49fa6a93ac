"""The tile loop of the XLA expert path: one gated MLP per tile, with a hand-written backward.

Autodiff of a `lax.scan` that indexes the expert weights per tile (`w[expert]`) transposes
each index into a full-size zero tensor plus an add: O(El * D * F) memory traffic per tile,
which made the backward pass ~40x slower than the forward. The backward here instead
accumulates weight gradients in the scan carry with in-place dynamic-update-slices, touching
only the tile's expert, and skips unused tiles like the forward does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def activation_fn(name: str):
  """The gate activation by name: "silu" or "gelu" (exact erf form)."""
  if name == "silu":
    return jax.nn.silu
  return lambda x: jax.nn.gelu(x, approximate=False)


def gated_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, activation: str) -> jax.Array:
  """`act(x @ W_gate) * (x @ W_up) @ W_down`, accumulated in float32.

  Args:
    x: [M, D] rows, in the compute dtype.
    w_gate_up: [D, 2F]; gate is `[:, :F]`, up is `[:, F:]`.
    w_down: [F, D].
    activation: "silu" or "gelu".

  Returns:
    [M, D] float32.
  """
  gate_up = jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32)  # [M, 2F]
  gate, up = jnp.split(gate_up, 2, axis=-1)
  hidden = (activation_fn(activation)(gate) * up).astype(x.dtype)  # [M, F]
  return jnp.dot(hidden, w_down, preferred_element_type=jnp.float32)


def _zeros_rows(like: jax.Array, rows: int, cols: int) -> jax.Array:
  # zeros_like of an input, not jnp.zeros: inside shard_map it keeps the input's varying-axes
  # type, which lax.cond requires both branches to share.
  return jnp.broadcast_to(jnp.zeros_like(like[:1, :1], jnp.float32), (rows, cols))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def tile_mlp(x_padded, w_gate_up, w_down, tile_tokens, tile_expert, num_used, activation):
  """Runs each used tile's rows through its expert's gated MLP.

  Args:
    x_padded: [N+1, D] rows in the compute dtype; row N is zero (empty tile slots point at it).
    w_gate_up: [El, D, 2F].
    w_down: [El, F, D].
    tile_tokens: [tiles, B] int32 row of each tile slot.
    tile_expert: [tiles] int32 expert of each tile.
    num_used: [] int32 tiles in use; the rest are skipped and give 0.
    activation: "silu" or "gelu".

  Returns:
    [tiles, B, D] float32.
  """
  tile_rows, dim = tile_tokens.shape[1], x_padded.shape[1]

  def run_tile(_, tile):
    index, tokens, expert = tile
    out = jax.lax.cond(
      index < num_used,
      lambda: gated_mlp(x_padded[tokens], w_gate_up[expert], w_down[expert], activation),
      lambda: _zeros_rows(x_padded, tile_rows, dim),
    )
    return None, out

  tiles = (jnp.arange(tile_tokens.shape[0]), tile_tokens, tile_expert)
  return jax.lax.scan(run_tile, None, tiles)[1]


def _tile_mlp_fwd(x_padded, w_gate_up, w_down, tile_tokens, tile_expert, num_used, activation):
  out = tile_mlp(x_padded, w_gate_up, w_down, tile_tokens, tile_expert, num_used, activation)
  return out, (x_padded, w_gate_up, w_down, tile_tokens, tile_expert, num_used)


def _tile_grads(x, w_gate_up, w_down, d_out, activation):
  """Gradients of one tile's gated MLP; recomputes the pre-activation.

  Args: x [B, D], w_gate_up [D, 2F], w_down [F, D] (compute dtype), d_out [B, D] float32.
  Returns: (d_x [B, D], d_w_gate_up [D, 2F], d_w_down [F, D]), float32.
  """
  f32 = jnp.float32
  gate, up = jnp.split(jnp.dot(x, w_gate_up, preferred_element_type=f32), 2, axis=-1)
  act, act_vjp = jax.vjp(activation_fn(activation), gate)
  hidden = (act * up).astype(x.dtype)  # [B, F], as the forward pass rounded it
  d_out = d_out.astype(x.dtype)
  d_hidden = jnp.dot(d_out, w_down.T, preferred_element_type=f32)  # [B, F]
  d_w_down = jnp.dot(hidden.T, d_out, preferred_element_type=f32)  # [F, D]
  d_gate_up = jnp.concatenate([act_vjp(d_hidden * up)[0], d_hidden * act], axis=-1)
  d_gate_up = d_gate_up.astype(x.dtype)  # [B, 2F]
  d_w_gate_up = jnp.dot(x.T, d_gate_up, preferred_element_type=f32)  # [D, 2F]
  d_x = jnp.dot(d_gate_up, w_gate_up.T, preferred_element_type=f32)  # [B, D]
  return d_x, d_w_gate_up, d_w_down


def _add_at(total: jax.Array, index: jax.Array, update: jax.Array) -> jax.Array:
  """total[index] += update, as dynamic slices (in place inside a loop)."""
  start = (index,) + (0,) * update.ndim
  current = jax.lax.dynamic_slice(total, start, (1, *update.shape))
  return jax.lax.dynamic_update_slice(total, current + update[None], start)


def _tile_mlp_bwd(activation, residuals, d_tiles):
  x_padded, w_gate_up, w_down, tile_tokens, tile_expert, num_used = residuals
  f32 = jnp.float32
  init = (
    jnp.zeros_like(x_padded, f32),
    jnp.zeros_like(w_gate_up, f32),
    jnp.zeros_like(w_down, f32),
  )

  def tile_backward(carry, tile):
    index, tokens, expert, d_out = tile

    def accumulate(carry):
      d_x, d_w_gate_up, d_w_down = carry
      grads = _tile_grads(x_padded[tokens], w_gate_up[expert], w_down[expert], d_out, activation)
      return (
        d_x.at[tokens].add(grads[0]),
        _add_at(d_w_gate_up, expert, grads[1]),
        _add_at(d_w_down, expert, grads[2]),
      )

    return jax.lax.cond(index < num_used, accumulate, lambda carry: carry, carry), None

  tiles = (jnp.arange(tile_tokens.shape[0]), tile_tokens, tile_expert, d_tiles)
  (d_x, d_w_gate_up, d_w_down), _ = jax.lax.scan(tile_backward, init, tiles)
  return (
    d_x.astype(x_padded.dtype),
    d_w_gate_up.astype(w_gate_up.dtype),
    d_w_down.astype(w_down.dtype),
    None,
    None,
    None,
  )


tile_mlp.defvjp(_tile_mlp_fwd, _tile_mlp_bwd)
