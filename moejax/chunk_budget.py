"""`chunk_size="auto"`: the chunk a memory budget allows, chosen at trace time from shapes.

The chunk exists to bound what one step of the chunk loop holds; every chunk also costs a
pass over the local experts' weights (docs/performance.md, "Chunk loop"), so the chunk
should be as large as the budget allows. What one chunk holds grows with the rows a device
receives for it, N = S·C (the gathered chunk of all_gather, the static receive buffers of
all_to_all), and `CHUNK_TERMS` lists it, per received row, with what XLA:GPU's ragged_dot
adds where the call takes it (`ragged_dot_bytes`). The expert path is an argument: the call
plan (`moejax.call_plan`) decides it, for each chunk size it asks about (`PathOf`). The sum
is an upper bound for both exchange schemes and for the gradient, which the chunk does not
know it will have (the backward pass recomputes each chunk and holds its cotangents),
checked against the compiled program's `memory_analysis()` on XLA:CPU
(tests/test_chunk_budget.py) and on compile-only H200s (tests/test_gpu_compile.py).
`outside_chunks` says what no chunk size bounds (the stated slack): the device's padded
inputs and outputs, and the gradient of its expert weights.

>>> config = MoEConfig(num_experts=32, top_k=2, hidden_size=256, intermediate_size=512,
...                    chunk_memory_bytes=64 << 20)
>>> tile_loop = lambda chunk: "tile_loop"  # the expert path at every chunk size
>>> auto_chunk(config, share=4096, axis_size=1, scheme="all_gather", path_of=tile_loop)
4096
>>> auto_chunk(config, share=32768, axis_size=1, scheme="all_gather", path_of=tile_loop)
4096
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kernels_pallas import fused_moe, platform
from moejax.capacity import received_rows
from moejax.config import ExpertPath, MoEConfig, Scheme
from moejax.experts import tile_rows_for

GRANULARITY = 8  # rows: a chunk of several is a multiple of the tile loop's smallest tile
CPU_BUDGET_BYTES = 256 << 20
GPU_BUDGET_FRACTION = 1 / 16
GPU_FALLBACK_BUDGET_BYTES = 1 << 30


class RowShape(NamedTuple):
  """What the bytes of one received row depend on."""

  dim: int  # D
  top_k: int  # K
  itemsize: int  # bytes of the compute dtype
  axis_size: int  # S
  all_to_all: bool  # the exchange scheme (`dispatch.scheme_of`)


F32 = 4
# The expert path ("tile_loop", "ragged_dot", "pallas") a call takes with chunks of C rows per
# device: the call plan's rule, handed to the budget.
PathOf = Callable[[int], ExpertPath]
# Bytes per received row, by what holds them: an upper bound. Measured on XLA:CPU in float32
# at K = 2, S = 4 (tests/test_chunk_budget.py checks the sum against memory_analysis()), one
# chunk adds 18-22·D bytes per received row forward and 28-39·D with the backward pass;
# these terms sum to 48·D (all_gather) and 52·D (all_to_all), and the tile loop's padding
# (`tile_padding_bytes`) comes on top.
PAIR_BUFFERS = "all_to_all's pair buffers: min(K, S) copies of each sent row, out and back"
CHUNK_TERMS: dict[str, Callable[[RowShape], float]] = {
  "received rows (the exchange's buffer)": lambda r: r.dim * r.itemsize,
  PAIR_BUFFERS: (
    lambda r: r.all_to_all * 2 * min(r.top_k, r.axis_size) / r.axis_size * r.dim * r.itemsize
  ),
  "the next chunk in flight (pipelined: S > 1)": lambda r: r.dim * r.itemsize * (r.axis_size > 1),
  "rows sorted and gathered into tiles": lambda r: 2 * r.dim * r.itemsize,
  "tile outputs, float32, one per (row, choice)": lambda r: r.top_k * r.dim * F32,
  "partial sums and the return exchange, float32": lambda r: 2 * r.dim * F32,
  "gradient: the tile outputs' and rows' cotangents, float32": (
    lambda r: (r.top_k + 2) * r.dim * F32
  ),
}


def tile_padding_bytes(config: MoEConfig, received: int, axis_size: int) -> int:
  """The tile loop's padding of one chunk of N = `received` rows: up to a tile of B rows per
  local expert, whose float32 outputs and cotangents are held like the rows'."""
  tile_rows = tile_rows_for(config, received * config.top_k)
  local_experts = config.num_physical_experts // axis_size
  return local_experts * tile_rows * config.expert_width * 2 * F32


def ragged_dot_bytes(config: MoEConfig, received: int, axis_size: int, path: ExpertPath) -> int:
  """What XLA:GPU's ragged_dot adds to a chunk of N = `received` rows on expert `path` (0 but
  for "ragged_dot"): its GPU
  lowering expands each grouped matmul densely over the El local experts, and the gradient
  holds, per received (row, choice) and local expert, up to (5·D + 10·F) times the compute
  dtype's bytes. Measured on compile-only H200 programs in bf16 (El 4 and 8, K 2 and 4, D
  1024 and 2048, F 512 and 1024: 146-578·D per received row, 6x the other terms; the
  forward stays within them); float32 scaled by its size, not measured."""
  if path != "ragged_dot":
    return 0
  local_experts = config.num_physical_experts // axis_size
  per_pair = (5 * config.expert_width + 10 * config.intermediate_size) * local_experts
  return received * config.top_k * per_pair * np.dtype(config.dtype).itemsize


def fused_bytes(config: MoEConfig, received: int, axis_size: int, path: ExpertPath) -> int:
  """What the fused path (`kernels_pallas.fused_moe`) adds to a chunk of N = `received` rows
  on expert `path` (0 but for "fused"): per (row, choice) aligned row, its hidden [F] and
  output [D] in the compute dtype, and for the gradient the kept gate|up [2F], their
  cotangent [2F], the recomputed hidden [F] and the rows' cotangent [D] in float32; under
  `compute_quant` the e4m3 copies of the products' operands (hidden, d(gate|up) twice, and
  the weight gradients' x, hidden and dout rows, one byte a value); with output norms the
  unweighted rows kept [D] and dout read onto the rows [D] in float32; plus a tile of padding
  per local expert."""
  if path != "fused":
    return 0
  itemsize = np.dtype(config.dtype).itemsize
  d, f = config.expert_width, config.intermediate_size
  local_experts = config.num_physical_experts // axis_size
  block_m = fused_moe.FP8_BLOCKS.block_m if config.compute_quant else 64  # else block_m <= 64
  aligned = received * config.top_k + local_experts * block_m
  fp8_copies = 2 * d + 6 * f if config.compute_quant else 0
  normed = 2 * d * F32 if config.expert_output_norm_eps is not None else 0
  return aligned * ((6 * f + d) * itemsize + d * F32 + fp8_copies + normed)


def chunk_bytes(
  config: MoEConfig, chunk: int, axis_size: int, scheme: Scheme, path: ExpertPath
) -> int:
  """What one chunk of `chunk` rows per device holds under the exchange `scheme`
  (`dispatch.scheme_of`) on expert `path`: the sum of `chunk_bytes_by_term`."""
  return sum(chunk_bytes_by_term(config, chunk, axis_size, scheme, path).values())


def chunk_bytes_by_term(
  config: MoEConfig, chunk: int, axis_size: int, scheme: Scheme, path: ExpertPath
) -> dict[str, int]:
  """`chunk_bytes`' terms: each of `CHUNK_TERMS` for the N rows the chunk receives (S·C, or
  all_to_all's receive capacity: `moejax.capacity`), the tile padding, ragged_dot's dense
  expansion on a GPU and the fused path's aligned rows (each 0 on the other paths)."""
  row = RowShape(
    config.expert_width,  # the rows sent: the tokens, or their latent projections
    config.top_k,
    np.dtype(config.dtype).itemsize,
    axis_size,
    all_to_all=scheme == "all_to_all",
  )
  received = received_rows(config, chunk, axis_size, scheme)
  # The pair buffers follow the rows sent (S·C of them's share), not the capacity.
  rows_of = lambda name: axis_size * chunk if name == PAIR_BUFFERS else received
  terms = {name: math.ceil(term(row) * rows_of(name)) for name, term in CHUNK_TERMS.items()}
  terms["the tile loop's padding (tile_padding_bytes)"] = tile_padding_bytes(
    config, received, axis_size
  )
  terms["ragged_dot's dense expansion on a GPU (ragged_dot_bytes)"] = ragged_dot_bytes(
    config, received, axis_size, path
  )
  terms["the fused path's aligned rows (fused_bytes)"] = fused_bytes(
    config, received, axis_size, path
  )
  return terms


def outside_chunks(config: MoEConfig, rows: int, local_experts: int) -> int:
  """What no chunk size bounds, on one device of `rows` padded token rows (L): three float32
  [L, D] buffers (the padded copies of the tokens and of the output where the layout pads,
  the rows' gradient), routing, and its experts' weights with their float32 gradient."""
  d, f = config.hidden_size, config.intermediate_size
  token_rows = rows * (3 * d * F32 + 4 * config.top_k * F32 + 64)
  weights = (
    local_experts * 3 * config.expert_width * f * (np.dtype(config.param_dtype).itemsize + 2 * F32)
  )
  return token_rows + weights + (1 << 20)


def budget_source(config: MoEConfig) -> str:
  """Where `budget_bytes` comes from, in words."""
  if config.chunk_memory_bytes is not None:
    return "config.chunk_memory_bytes"
  if platform.platform() != "gpu":
    return f"the {platform.platform()} default"
  return "1/16 of the GPU's memory" if platform.gpu_memory_bytes() else "the GPU fallback, 1 GiB"


def budget_bytes(config: MoEConfig) -> int:
  """`config.chunk_memory_bytes`, else the platform's default: on a GPU 1/16 of the memory
  JAX reports for the device (1 GiB where it reports none); elsewhere 256 MiB, past which a
  CPU's chunk step no longer gets faster (its caches hold far less, and every chunk streams
  the expert weights once: docs/performance.md, "Chunk loop")."""
  if config.chunk_memory_bytes is not None:
    return config.chunk_memory_bytes
  if platform.platform() != "gpu":
    return CPU_BUDGET_BYTES
  limit = platform.gpu_memory_bytes()
  return int(limit * GPU_BUDGET_FRACTION) if limit else GPU_FALLBACK_BUDGET_BYTES


def auto_chunk(
  config: MoEConfig, share: int, axis_size: int, scheme: Scheme, path_of: PathOf
) -> int:
  """The chunk of a device holding `share` tokens: all of them in one chunk if its
  `chunk_bytes` fit the budget; else, of the chunks that fit (multiples of `GRANULARITY`),
  the largest that divides the share (up to twice the fewest chunks), so that the layout
  pads nothing (a padded layout copies the tokens and the output: two [L, D] buffers);
  else even chunks, as many as the largest that fits needs. `scheme`: the call's exchange
  (`dispatch.scheme_of`); `path_of`: the expert path at each chunk size (the call plan's)."""
  budget = budget_bytes(config)
  fits = lambda chunk: chunk_bytes(config, chunk, axis_size, scheme, path_of(chunk)) <= budget
  if fits(share):
    return share
  largest = GRANULARITY  # the largest multiple that fits, by doubling and then bisecting
  while largest < share and fits(2 * largest):
    largest *= 2
  step = largest // 2
  while step >= GRANULARITY:
    if largest + step < share and fits(largest + step):
      largest += step
    step //= 2
  fewest = -(-share // largest)
  for chunks in range(fewest, 2 * fewest + 1):
    if share % chunks == 0 and (share // chunks) % GRANULARITY == 0:
      return share // chunks
  even = -(-share // fewest)
  return -(-even // GRANULARITY) * GRANULARITY
