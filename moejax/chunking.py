"""The chunk loop: a `lax.scan` over fixed-size token chunks with static, padded, masked shapes.

This replaces host-side chunk index clamping (vLLM's ChunkingMoERunner, which broke on ranks
holding zero tokens): every device runs the same number of chunks of the same shape, padding
is masked rather than sliced off, and a chunk that holds no valid token on any device of its
collective group is skipped by a `lax.cond` whose predicate is the same on all of them, so the
group stays in lockstep and the cost follows the busiest device's real tokens. The predicates
of all chunks come from one collective before the loop.

Where an exchange crosses devices the loop is pipelined in two stages: step i finishes chunk
i (`finish`: experts and the return exchange) and sends chunk i+1 (`send`: the outbound
exchange), which does not depend on chunk i's results, so a GPU can overlap that
communication with the compute. On one device (or an expert axis of one) there is nothing to
overlap, and each step runs both stages under one cond.

    before the loop:  send(0)
    step 0:           finish(0) | send(1)
    step 1:           finish(1) | send(2)
    ...
    step n-1:         finish(n-1)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from moejax.axis_groups import AxisGroup, names
from moejax.collectives import filled_like, sum_over


@dataclasses.dataclass(frozen=True)
class TokenLayout:
  """Static geometry of T tokens split evenly over devices and padded to whole chunks.

  Device i holds tokens [i*share, (i+1)*share) (share = ceil(T / devices)) followed by
  padding up to L rows, a multiple of the chunk C = min(chunk_size, share). Padding each
  device's share in place, rather than the end of the batch, keeps tokens on the device that
  already holds them.

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


class ChunkStages(NamedTuple):
  """The two stages of one chunk; `finish(w, c, send(w, c), None)` is the chunk's whole output,
  `w = prepare(weights)`.

  `prepare` turns the weights as given into the form the chunks compute with (cast, marked
  per-device) once per pass, inside the loop's VJP: the backward pass saves only the weights
  as given (under a scan over layers, the layer's own slice of the stacked parameters, not a
  prepared copy per layer) and differentiates `prepare` once, outside every chunk's cond.

  The prepared weights are a pair `(seeded, rest)` of pytrees. Gradient seeds: the
  backward pass sums the weights' gradients over chunks. `finish` receives the running sum
  of `seeded`'s gradient as `grad_seeds` (a pytree like `seeded`) and promises that its
  gradient with respect to `seeded` is that seed plus the chunk's own, so that a stage which
  accumulates gradients in place (the tile loop) starts from the running sum instead of
  adding a fresh weight-sized gradient per chunk (`seed_gradient` keeps the promise for any
  other use). `rest`'s gradients are summed over chunks. In the forward pass `grad_seeds` is
  None.

  Attributes:
    prepare: weights -> the pair `(seeded, rest)` every chunk computes with.
    send: (weights, chunk) -> in-flight pytree: the outbound exchange.
    finish: (weights, chunk, in-flight, grad_seeds) -> [C, ...]: compute and the return
      exchange.
  """

  prepare: Callable[[Any], tuple[Any, Any]]
  send: Callable[[tuple[Any, Any], Any], Any]
  finish: Callable[[tuple[Any, Any], Any, Any, Any], jax.Array]

  def whole(self, weights: tuple[Any, Any], chunk: Any, grad_seeds: Any = None) -> jax.Array:
    """Both stages of one chunk, unpipelined (`weights` prepared)."""
    return self.finish(weights, chunk, self.send(weights, chunk), grad_seeds)


@jax.custom_vjp
def seed_gradient(value: jax.Array, seed: jax.Array) -> jax.Array:
  """`value`, whose gradient gets `seed` added (and `seed` none): keeps `ChunkStages`'s
  promise for a weight that no in-place accumulation consumes.

  >>> jax.grad(lambda w: seed_gradient(w, jnp.float32(5.0)) * 3.0)(jnp.float32(1.0)).item()
  8.0
  """
  del seed
  return value


def _seed_gradient_fwd(value, seed):
  return value, seed


def _seed_gradient_bwd(seed, cotangent):
  return cotangent + seed.astype(cotangent.dtype), None


seed_gradient.defvjp(_seed_gradient_fwd, _seed_gradient_bwd)


def chunk_scan(
  stages: ChunkStages,
  weights: Any,
  inputs: Any,
  token_mask: jax.Array,
  *,
  chunk_size: int,
  lockstep_axis: AxisGroup | None,
  pipelined: bool,
  saved_in_flight: str | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Applies `stages` to chunks of C rows, valid rows first, skipping all-padding chunks.

  Differentiable in `weights` and the floating leaves of `inputs`, with a hand-written
  backward (see `_chunk_scan_bwd`).

  Args:
    stages: the chunk's `ChunkStages`. They may run collectives over `lockstep_axis`, and
      must close over no traced value (pass those in `weights`).
    weights: the pytree `stages.prepare` takes.
    inputs: pytree of [L, ...] arrays, L a multiple of C.
    token_mask: [L] bool, True for valid rows.
    chunk_size: C.
    lockstep_axis: the mesh axis (or group) the stages' collectives span (None without a
      mesh): a chunk runs on all its devices when any of them holds a valid row in it.
    pipelined: send chunk i+1 while chunk i computes (worth it only where an exchange crosses
      devices); else each step runs both stages of its chunk under one cond.
    saved_in_flight: None, or a `checkpoint_name`: then the forward pass of a gradient keeps
      every chunk's in-flight value (what `send` returned, [chunks, ...]) under that name,
      and the backward pass reuses it instead of sending each chunk again (memory for one
      exchange per chunk; a remat policy may still drop it, and then the forward reruns).

  Returns:
    (out, chunks_run): out [L, ...] holds the chunks' outputs and zeros for the skipped ones;
    chunks_run [] int32 counts the chunks that ran.
  """
  return _chunk_scan(
    stages, chunk_size, lockstep_axis, pipelined, saved_in_flight, weights, inputs, token_mask
  )


def chunk_order(token_mask: jax.Array, chunk_size: int) -> jax.Array:
  """[chunks, C] row indices, valid rows first in a stable order: which rows chunk i holds.

  With padding scattered through a buffer, the chunks past this device's valid count are then
  all padding and get skipped, so the cost follows the busiest device's tokens.
  """
  return jnp.argsort(~token_mask, stable=True).reshape(-1, chunk_size)


def _live_chunks(
  token_mask: jax.Array, order: jax.Array, lockstep_axis: AxisGroup | None
) -> jax.Array:
  """[chunks] bool: whether any device along the axis holds a valid row in each chunk.

  One collective for the whole loop: the per-chunk valid counts, summed over the axis.
  """
  counts = jnp.sum(token_mask[order], axis=1, dtype=jnp.int32)  # [chunks]
  return sum_over(counts, () if lockstep_axis is None else names(lockstep_axis)) > 0


def _zeros_of(token_mask: jax.Array, like: Any) -> Any:
  """Zeros shaped like the pytree of `jax.ShapeDtypeStruct`s `like`, per-device like the mask
  (what `lax.cond` requires of both branches)."""
  return jax.tree.map(lambda t: filled_like(token_mask, t.shape, 0, t.dtype), like)


def _rows_of(tree: Any, rows: jax.Array) -> Any:
  """The chunk's rows of every leaf: [L, ...] -> [C, ...], a gather of C rows (no copy of
  the whole buffer, so the loop's temporaries stay O(C) however many tokens there are)."""
  return jax.tree.map(lambda a: a[rows], tree)


def _put_rows(total: jax.Array, rows: jax.Array, update: jax.Array) -> jax.Array:
  """total[rows] = update, in place in the loop carry (rows distinct: a chunk's own)."""
  return total.at[rows].set(update, unique_indices=True, indices_are_sorted=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _chunk_scan(stages, chunk_size, lockstep_axis, pipelined, saved, weights, inputs, token_mask):
  args = (stages, chunk_size, lockstep_axis, pipelined, False, weights, inputs, token_mask)
  return _forward(*args)[0]


def _forward(stages, chunk_size, lockstep_axis, pipelined, keep, weights, inputs, token_mask):
  """The loop: ((out, chunks_run), the in-flight values): with `keep`, [chunks, ...] each
  chunk's (zeros for skipped chunks), else None."""
  weights = stages.prepare(weights)
  order = chunk_order(token_mask, chunk_size)  # [chunks, C]
  live = _live_chunks(token_mask, order, lockstep_axis)  # [chunks]
  take = lambda i: _rows_of(inputs, order[i])
  out_type = jax.eval_shape(stages.whole, weights, take(0))
  out_rows = jax.ShapeDtypeStruct((token_mask.shape[0], *out_type.shape[1:]), out_type.dtype)
  out = _zeros_of(token_mask, out_rows)  # the output, filled in place chunk by chunk
  in_flight_type = jax.eval_shape(stages.send, weights, take(0))
  if pipelined:
    out, in_flights = _pipelined_steps(
      stages, weights, take, order, live, token_mask, out, out_type, in_flight_type, keep
    )
  else:

    def both_stages(i):
      in_flight = stages.send(weights, take(i))
      return stages.finish(weights, take(i), in_flight, None), in_flight

    def step(out, i):
      run = (lambda: both_stages(i)) if keep else lambda: (stages.whole(weights, take(i)), None)
      skipped = (out_type, in_flight_type if keep else None)
      chunk_out, in_flight = jax.lax.cond(live[i], run, lambda: _zeros_of(token_mask, skipped))
      return _put_rows(out, order[i], chunk_out), in_flight

    out, in_flights = jax.lax.scan(step, out, jnp.arange(order.shape[0]))
  return (out, jnp.sum(live, dtype=jnp.int32)), in_flights


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _unsplit_forward(stages, chunk_size, lockstep_axis, pipelined, keep, weights, inputs, mask):
  """`_forward`, kept whole by partial evaluation: what the gradient's forward pass runs.

  Under `jax.grad`, a layer inside a `lax.scan` over layers (a model's stack) is split by
  JAX's partial evaluation of that scan, which hoists out of the loop whatever depends only
  on its constants (the token mask). Split inline, the chunk loop would become a loop over
  the mask-only values (each chunk's order, its skip predicate, the zeros of a skipped
  chunk's exchange buffers) that stores them for every chunk: O(chunks · S·C · D) bytes per
  layer, 128 GiB per device for DeepSeek-V3 at S = 256 (docs/performance.md, "Memory at
  scale"). A `custom_vjp` call is partially evaluated whole, so nothing of it is stored.
  Its own gradient (only ever asked for in a derivative of a gradient) differentiates
  `_forward` again from the inputs.
  """
  return _forward(stages, chunk_size, lockstep_axis, pipelined, keep, weights, inputs, mask)


def _unsplit_forward_fwd(stages, chunk_size, lockstep_axis, pipelined, keep, *arrays):
  return _forward(stages, chunk_size, lockstep_axis, pipelined, keep, *arrays), arrays


def _unsplit_forward_bwd(stages, chunk_size, lockstep_axis, pipelined, keep, arrays, cotangents):
  forward = functools.partial(_forward, stages, chunk_size, lockstep_axis, pipelined, keep)
  return jax.vjp(forward, *arrays)[1](cotangents)


_unsplit_forward.defvjp(_unsplit_forward_fwd, _unsplit_forward_bwd)


def _pipelined_steps(
  stages, weights, take, order, live, token_mask, out, out_type, in_flight_type, keep
):
  """The loop in which step i finishes chunk i and sends chunk i+1; returns `out` filled and
  each chunk's in-flight value."""
  chunks = live.shape[0]
  send_or_skip = lambda run, i: jax.lax.cond(
    run, lambda: stages.send(weights, take(i)), lambda: _zeros_of(token_mask, in_flight_type)
  )
  next_live = jnp.append(live[1:], False)  # the last step sends nothing

  def step(carry, i):
    out, in_flight = carry
    chunk_out = jax.lax.cond(
      live[i],
      lambda: stages.finish(weights, take(i), in_flight, None),
      lambda: _zeros_of(token_mask, out_type),
    )
    # The next chunk's exchange reads only inputs: it can overlap this chunk's compute.
    next_in_flight = send_or_skip(next_live[i], jnp.minimum(i + 1, chunks - 1))
    return (_put_rows(out, order[i], chunk_out), next_in_flight), in_flight if keep else None

  (out, _), in_flights = jax.lax.scan(step, (out, send_or_skip(live[0], 0)), jnp.arange(chunks))
  return out, in_flights


def _chunk_scan_fwd(stages, chunk_size, lockstep_axis, pipelined, saved, weights, inputs, mask):
  keep = saved is not None
  args = (stages, chunk_size, lockstep_axis, pipelined, keep, weights, inputs, mask)
  out, in_flights = _unsplit_forward(*args)
  kept = checkpoint_name(in_flights, saved) if keep else None
  return out, (weights, inputs, mask, kept)


def _chunk_scan_bwd(stages, chunk_size, lockstep_axis, pipelined, saved, residuals, cotangents):
  """Recomputes each live chunk under `jax.vjp` and accumulates gradients in the scan carry.

  Left to autodiff, the scan would stack per-chunk residuals (copies of the weights among
  them, through the cond) and add full-size weight cotangents per chunk. Here the only saved
  values are the inputs; each live chunk is differentiated again (what its backward pass
  needs of the forward pass is recomputed, unpipelined), the collectives' transposes run
  inside the same lockstep cond as the forward pass, and the seeded weights' gradients
  accumulate in place across chunks. `prepare` runs once, and its transpose (the psum of a
  per-device mark, a cast back) once after the loop. With the in-flight values kept
  (`saved_in_flight`), a chunk's `finish` is differentiated at its kept value and `send` is
  only transposed: the outbound exchange does not run again. A loop of one chunk has no sum
  to keep: its gradients are the chunk's own (no weight-sized zeros to start from).
  """
  del pipelined, saved
  given, inputs, token_mask, in_flights = residuals
  weights, unprepare = jax.vjp(stages.prepare, given)
  d_out = cotangents[0]
  is_float = lambda a: jnp.issubdtype(a.dtype, jnp.inexact)
  float_inputs = [a for a in jax.tree.leaves(inputs) if is_float(a)]
  order = chunk_order(token_mask, chunk_size)
  live = _live_chunks(token_mask, order, lockstep_axis)

  def chunk_grads(i, d_seeded):
    """Chunk i's ((seeded, rest) weight gradients, its float inputs' [C, ...] gradients), the
    seeded ones on top of `d_seeded` (None: the chunk's own)."""
    rows = order[i]
    chunk = _rows_of(inputs, rows)
    if in_flights is None:
      whole = lambda weights, chunk: stages.whole(weights, chunk, d_seeded)
      _, vjp = jax.vjp(whole, weights, chunk)
      d_weights, chunk_d_inputs = vjp(d_out[rows])
    else:
      in_flight = jax.tree.map(lambda a: a[i], in_flights)
      finish = lambda weights, chunk, sent: stages.finish(weights, chunk, sent, d_seeded)
      _, vjp = jax.vjp(finish, weights, chunk, in_flight)
      d_weights, d_direct, d_sent = vjp(d_out[rows])
      (d_via_send,) = jax.vjp(lambda chunk: stages.send(weights, chunk), chunk)[1](d_sent)
      chunk_d_inputs = jax.tree.map(_add_tangents, d_direct, d_via_send)
    # An integer weight (int4 values, fp8 bits) has no gradient: the carry holds None for it.
    d_weights = jax.tree.map(_carried, weights, d_weights)
    chunk_d_inputs = [
      c
      for c, a in zip(jax.tree.leaves(chunk_d_inputs), jax.tree.leaves(inputs), strict=True)
      if is_float(a)
    ]
    return d_weights, chunk_d_inputs

  def put(d_inputs, i, chunk_d_inputs):
    return [_put_rows(d, order[i], c) for d, c in zip(d_inputs, chunk_d_inputs, strict=True)]

  def step(carry, i):
    def accumulate(carry):
      (d_seeded, d_rest), d_inputs = carry
      (chunk_d_seeded, chunk_d_rest), chunk_d_inputs = chunk_grads(i, d_seeded)
      d_rest = jax.tree.map(jnp.add, d_rest, chunk_d_rest)
      return (chunk_d_seeded, d_rest), put(d_inputs, i, chunk_d_inputs)  # seeded: the total

    return jax.lax.cond(live[i], accumulate, lambda carry: carry, carry), None

  no_input_grads = lambda: [jnp.zeros_like(a) for a in float_inputs]

  def no_grads():
    zeros = lambda w: jnp.zeros_like(w) if is_float(w) else None
    return jax.tree.map(zeros, weights), no_input_grads()

  if order.shape[0] == 1:  # one chunk: its gradients are the sums (no zeros to add them to)

    def only_chunk():
      d_weights, chunk_d_inputs = chunk_grads(0, None)
      return d_weights, put(no_input_grads(), 0, chunk_d_inputs)

    d_weights, d_float_inputs = jax.lax.cond(live[0], only_chunk, no_grads)
  else:
    (d_weights, d_float_inputs), _ = jax.lax.scan(step, no_grads(), jnp.arange(order.shape[0]))
  (d_given,) = unprepare(jax.tree.map(_tangent_of, d_weights, weights, is_leaf=_is_none))
  d_float_inputs = iter(d_float_inputs)
  d_inputs = jax.tree.map(
    lambda a: next(d_float_inputs) if is_float(a) else np.zeros(a.shape, jax.dtypes.float0),
    inputs,
  )
  return d_given, d_inputs, np.zeros(token_mask.shape, jax.dtypes.float0)


def _carried(primal: jax.Array, cotangent: jax.Array) -> jax.Array | None:
  """`cotangent` as the backward loop carries it: None for an integer primal (no gradient, and
  no weight-sized zeros written per chunk)."""
  return cotangent if jnp.issubdtype(primal.dtype, jnp.inexact) else None


def _add_tangents(a: jax.Array, b: jax.Array) -> jax.Array:
  """a + b, for float0 (integer inputs') tangents too."""
  return a if a.dtype == jax.dtypes.float0 else a + b


def _is_none(value) -> bool:
  return value is None


def _tangent_of(carried: jax.Array | None, primal: jax.Array | None) -> jax.Array | None:
  """A `carried` cotangent as `jax.vjp` takes it for `primal`: float0 zeros for an integer
  array (None in the carry); None where there is no weight."""
  if carried is None and primal is not None:
    return np.zeros(primal.shape, jax.dtypes.float0)
  return carried


_chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)
