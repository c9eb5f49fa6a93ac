"""`python -m moejax demo`: the layer on a mesh with uneven per-rank token counts.

One rank holds no token, one is full, the rest are random. The demo checks the output against
`moejax.reference_moe`, prints per-rank valid tokens and chunks run / skipped, and shows that
other token-count patterns reuse the same compiled executable.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.apps.cli_setup import layer_mesh, moe_config
from moejax.forward import chunk_layout, compiled_executables, moe_apply
from moejax.layer import MoELayer
from moejax.reference import reference_moe


def rank_mask(valid_per_rank: np.ndarray, rows_per_rank: int) -> jax.Array:
  """[ranks * L] bool: rank r (rows [r*L, (r+1)*L)) holds `valid_per_rank[r]` real tokens first."""
  rows = np.arange(rows_per_rank)
  return jnp.asarray((rows[None, :] < valid_per_rank[:, None]).reshape(-1))


def uneven_counts(ranks: int, rows_per_rank: int, rng: np.random.Generator) -> np.ndarray:
  """Per-rank valid counts: rank 0 empty, rank 1 full, the rest random.

  Ranks past the first half hold at most half their buffer, so that their expert groups have
  all-padding chunks to skip.
  """
  counts = rng.integers(0, rows_per_rank + 1, size=ranks)
  counts[ranks // 2 :] //= 2
  counts[0] = 0
  if ranks > 1:
    counts[1] = rows_per_rank
  return counts


def run(args: argparse.Namespace, mesh_shape: tuple[int, int]) -> None:
  """Builds the layer, runs it on three token-count patterns and prints the results."""
  ranks = mesh_shape[0] * mesh_shape[1]
  config = moe_config(args, dtype=jnp.dtype(args.dtype))
  mesh = layer_mesh(args, mesh_shape, config)
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(args.seed))
  rng = np.random.default_rng(args.seed)
  rows = args.tokens_per_rank
  x = jnp.asarray(rng.standard_normal((ranks * rows, args.hidden)), jnp.dtype(args.dtype))
  counts = uneven_counts(ranks, rows, rng)
  mask = rank_mask(counts, rows)

  start = time.perf_counter()
  y, aux = _apply(layer, x, mask)
  first_call = time.perf_counter() - start
  start = time.perf_counter()
  y, aux = _apply(layer, x, mask)
  second_call = time.perf_counter() - start
  error = float(jnp.max(jnp.abs(y - reference_moe(layer.moe_params(), x, config, mask))))

  layout = chunk_layout(config, ranks * rows, mesh)
  chunks = layout.local // layout.chunk
  print(
    f"moejax demo: mesh (data={mesh_shape[0]}, expert={mesh_shape[1]}), E={config.num_experts}"
    f" K={config.top_k} D={config.hidden_size} F={config.intermediate_size}"
    f" C={layout.chunk} (chunk_size={config.chunk_size!r}) {args.dtype}, {rows} buffer rows"
    f" per rank, {chunks} chunk{'s' * (chunks > 1)}"
  )
  print(f"{'rank':>4} {'(data,expert)':>13} {'valid tokens':>12} {'chunks run':>10} {'skipped':>7}")
  for rank, (valid, ran) in enumerate(zip(counts, np.asarray(aux.chunks_run), strict=True)):
    position = f"({rank // mesh_shape[1]},{rank % mesh_shape[1]})"
    print(f"{rank:>4} {position:>13} {valid:>12} {ran:>10} {chunks - ran:>7}")
  print("(a chunk runs on every rank of an expert group when any of them holds a token in it)")
  print(f"max |y - reference| = {error:.3g}   padding rows all zero: {_padding_zero(y, mask)}")
  print(
    f"time: first call {first_call * 1e3:.0f} ms (with compile), second {second_call * 1e3:.1f} ms"
  )

  for name, pattern in (("all empty", np.zeros(ranks, int)), ("all full", np.full(ranks, rows))):
    y, aux = _apply(layer, x, rank_mask(pattern, rows))
    print(f"pattern {name!r}: chunks run {np.asarray(aux.chunks_run).tolist()}")
  print(f"compiled executables for the 3 token-count patterns: {compiled_executables()}")


def _apply(layer: MoELayer, x: jax.Array, mask: jax.Array):
  out = moe_apply(layer.moe_params(), x, config=layer.config, mesh=layer.mesh, token_mask=mask)
  return jax.block_until_ready(out)


def _padding_zero(y: jax.Array, mask: jax.Array) -> bool:
  return bool(jnp.all(jnp.where(mask[:, None], 0, y) == 0))
