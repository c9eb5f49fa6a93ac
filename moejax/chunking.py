"""The chunk loop: a `lax.scan` over fixed-size token chunks with static, padded, masked shapes.

This replaces host-side chunk index clamping (vLLM's ChunkingMoERunner, which broke on ranks
holding zero tokens): every device runs the same number of chunks of the same shape, padding
is masked rather than sliced off, and a chunk that holds no valid token on any device of its
collective group is skipped by a `lax.cond` whose predicate is the same on all of them, so the
group stays in lockstep and the cost follows the busiest device's real tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from moejax.dispatch import any_over


@dataclasses.dataclass(frozen=True)
class TokenLayout:
  """Static geometry of T tokens split evenly over devices and padded to whole chunks.

  Device i holds tokens [i*S, (i+1)*S) (S = ceil(T / devices), the share) followed by padding
  up to L rows, a multiple of the chunk C' = min(C, S). Padding each device's share in place,
  rather than the end of the batch, keeps tokens on the device that already holds them.

  >>> layout = TokenLayout.plan(num_tokens=10, devices=4, chunk_size=2)
  >>> layout.share, layout.chunk, layout.local
  (3, 2, 4)
  >>> layout.pad(jnp.arange(10), fill=-1).tolist()
  [0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, -1, -1, -1]
  >>> layout.unpad(layout.pad(jnp.arange(10), fill=-1)).tolist()
  [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
  """

  num_tokens: int
  devices: int
  share: int
  chunk: int
  local: int

  @classmethod
  def plan(cls, num_tokens: int, devices: int, chunk_size: int) -> TokenLayout:
    share = max(-(-num_tokens // devices), 1)
    chunk = min(chunk_size, share)
    return cls(num_tokens, devices, share, chunk, -(-share // chunk) * chunk)

  def pad(self, a: jax.Array, fill) -> jax.Array:
    """[T, ...] -> [devices * L, ...], padding filled with `fill`."""
    tail = [(0, 0)] * (a.ndim - 1)
    a = jnp.pad(a, [(0, self.devices * self.share - self.num_tokens), *tail], constant_values=fill)
    a = a.reshape(self.devices, self.share, *a.shape[1:])
    a = jnp.pad(a, [(0, 0), (0, self.local - self.share), *tail], constant_values=fill)
    return a.reshape(self.devices * self.local, *a.shape[2:])

  def unpad(self, a: jax.Array) -> jax.Array:
    """[devices * L, ...] -> [T, ...], the inverse of `pad`."""
    a = a.reshape(self.devices, self.local, *a.shape[1:])[:, : self.share]
    return a.reshape(self.devices * self.share, *a.shape[2:])[: self.num_tokens]


def chunk_scan(
  chunk_fn: Callable[[Any], jax.Array],
  inputs: Any,
  token_mask: jax.Array,
  *,
  chunk_size: int,
  lockstep_axis: str | None,
) -> tuple[jax.Array, jax.Array]:
  """Applies `chunk_fn` to chunks of C rows, valid rows first, skipping all-padding chunks.

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
  # Chunks take the valid rows first (a stable local order), so the chunks past this device's
  # valid count are all padding and the cost follows the busiest device's tokens even when
  # padding is scattered. Only the [L] order is permuted: each chunk gathers its C rows and
  # writes its output rows in place, so no permuted copy of the [L, D] buffer is made.
  order = jnp.argsort(~token_mask, stable=True).reshape(num_chunks, chunk_size)  # [chunks, C]
  out_type = jax.eval_shape(chunk_fn, jax.tree.map(lambda a: a[order[0]], inputs))
  # Zeros built from the mask, not jnp.zeros: inside shard_map they keep the per-device
  # (varying-axes) type of chunk_fn's output, which lax.cond requires.
  mask_zeros = jnp.zeros_like(token_mask, out_type.dtype).reshape(-1, *[1] * (out_type.ndim - 1))

  def step(out, rows):
    mask = token_mask[rows]  # [C]
    live = any_over(jnp.any(mask), lockstep_axis)
    skip = lambda _: jnp.broadcast_to(mask_zeros[:chunk_size], out_type.shape)
    chunk_out = jax.lax.cond(live, chunk_fn, skip, jax.tree.map(lambda a: a[rows], inputs))
    return out.at[rows].set(chunk_out, unique_indices=True), live

  init = jnp.broadcast_to(mask_zeros, (token_mask.shape[0], *out_type.shape[1:]))
  out, live = jax.lax.scan(step, init, order)
  return out, jnp.sum(live, dtype=jnp.int32)
