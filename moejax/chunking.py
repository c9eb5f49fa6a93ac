"""The chunk loop: a `lax.scan` over fixed-size token chunks with static, padded, masked shapes.

This replaces host-side chunk index clamping (vLLM's ChunkingMoERunner, which broke on ranks
holding zero tokens): every device runs the same number of chunks of the same shape, padding
is masked rather than sliced off, and a chunk that holds no valid token on any device of its
collective group is skipped by a `lax.cond` whose predicate is the same on all of them, so the
group stays in lockstep and the cost follows the busiest device's real tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moejax.dispatch import any_over


def plan_chunks(num_tokens: int, num_devices: int, chunk_size: int) -> tuple[int, int]:
  """Static chunk geometry for T tokens split over `num_devices`.

  Args:
    num_tokens: T, tokens in the whole (global) batch.
    num_devices: devices the tokens are split over.
    chunk_size: the configured C.

  Returns:
    (chunk, local): the chunk actually used, C' = min(C, ceil(T / devices)) (no chunk is
    larger than a device's share), and the padded tokens per device, a multiple of C'.

  >>> plan_chunks(num_tokens=1000, num_devices=8, chunk_size=32)
  (32, 128)
  >>> plan_chunks(num_tokens=10, num_devices=8, chunk_size=256)
  (2, 2)
  """
  share = max(-(-num_tokens // num_devices), 1)
  chunk = min(chunk_size, share)
  return chunk, -(-share // chunk) * chunk


def chunk_scan(
  chunk_fn: Callable[[Any], jax.Array],
  inputs: Any,
  token_mask: jax.Array,
  *,
  chunk_size: int,
  lockstep_axis: str | None,
) -> tuple[jax.Array, jax.Array]:
  """Applies `chunk_fn` to consecutive chunks of C rows, skipping chunks with no valid row.

  Args:
    chunk_fn: maps a pytree of [C, ...] arrays (one chunk of `inputs`) to a [C, ...] array. It
      may run collectives over `lockstep_axis`.
    inputs: pytree of [L, ...] arrays, L a multiple of C.
    token_mask: [L] bool, True for valid rows.
    chunk_size: C.
    lockstep_axis: the mesh axis `chunk_fn`'s collectives span (None without a mesh): a chunk
      runs on all devices of the axis when any of them holds a valid row in it.

  Returns:
    (out, chunks_run): out [L, ...] holds `chunk_fn`'s output for the chunks that ran and zeros
    for the skipped ones; chunks_run [] int32 counts the chunks that ran.
  """
  num_chunks = token_mask.shape[0] // chunk_size
  chunked = jax.tree.map(lambda a: a.reshape(num_chunks, chunk_size, *a.shape[1:]), inputs)
  chunk_mask = token_mask.reshape(num_chunks, chunk_size)
  out_type = jax.eval_shape(chunk_fn, jax.tree.map(lambda a: a[0], chunked))

  def step(_, chunk):
    chunk_inputs, mask = chunk
    live = any_over(jnp.any(mask), lockstep_axis)
    # Zeros built from the mask, not jnp.zeros: inside shard_map they keep the per-device
    # (varying-axes) type of chunk_fn's output, which lax.cond requires.
    mask_zeros = jnp.zeros_like(mask, out_type.dtype).reshape(-1, *[1] * (out_type.ndim - 1))
    skip = lambda _: jnp.broadcast_to(mask_zeros, out_type.shape)
    out = jax.lax.cond(live, chunk_fn, skip, chunk_inputs)
    return None, (out, live)

  _, (out, live) = jax.lax.scan(step, None, (chunked, chunk_mask))
  return out.reshape(num_chunks * chunk_size, *out.shape[2:]), jnp.sum(live, dtype=jnp.int32)
