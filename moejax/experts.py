"""Expert compute: the gated MLP of each local expert on the rows routed to it.

`routed_mlp` is the entry; `expert_path` picks one of three paths, by a rule measured on an
H200 (docs/performance.md, "GPU"):

- "tile_loop" (`grouped_mlp`): sorts the (row, choice) assignments by expert, pads each
  expert's rows to whole tiles (`kernels_pallas.metadata.aligned_rows`, the layout the Mosaic
  kernels use) and runs one dense [B, D] x [D, 2F] x [F, D] MLP per tile in a `lax.scan`,
  skipping unused tiles with `lax.cond`. On a CPU it runs near the dense-matmul rate, where
  `jax.lax.ragged_dot` is an order of magnitude slower.
- "ragged_dot" (`sorted_mlp` with XLA): two `jax.lax.ragged_dot`s. XLA's GPU lowering expands
  them densely over the groups, so it wins only with few local experts (El <= 8 on the H200:
  2.2x the tile loop's forward at El=8, 0.26x its forward+backward at El=32).
- "pallas" (`sorted_mlp` with a kernel): the fused `kernels_pallas.moe_mlp` kernels.

`expert_backend="xla"` takes the better XLA path; "pallas" the device's kernel (Mosaic on
Hopper, Triton elsewhere or for what Mosaic lacks; interpreted on a CPU, for testing); "auto"
a kernel only where `kernels_pallas.api.best_implementation` has a measurement showing it
faster, else the XLA path. Every path sorts the assignments with `sort_by_expert`.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

import kernels_pallas
from kernels_pallas.metadata import aligned_rows
from kernels_pallas.platform import on_cpu
from moejax import routing
from moejax.chunking import seed_gradient
from moejax.config import MoEConfig
from moejax.params import EXPERT_PARAMS
from moejax.tiles import GatedActivation, Tiles, gated_mlp, tile_mlp

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


def sort_by_expert(expert_ids: jax.Array, local_experts: int) -> tuple[jax.Array, jax.Array]:
  """The N*K (row, choice) assignments sorted by local expert, those held elsewhere last.

  Args:
    expert_ids: [N, K] int32 local expert ids; ids outside [0, El) belong to no local expert.
    local_experts: El.

  Returns:
    (order [N*K] assignment indices in sorted order, group_sizes [El] int32).

  >>> order, sizes = sort_by_expert(jnp.array([[1, 0], [1, 7]]), local_experts=2)
  >>> order.tolist(), sizes.tolist()
  ([1, 0, 2, 3], [1, 2])
  """
  flat = expert_ids.reshape(-1)
  key = jnp.where((flat >= 0) & (flat < local_experts), flat, local_experts)
  order = jnp.argsort(key, stable=True)
  group_sizes = jnp.zeros(local_experts + 1, jnp.int32).at[key].add(1)[:local_experts]
  return order, group_sizes


def grouped_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  b_gate_up: jax.Array | None,
  b_down: jax.Array | None,
  *,
  activation: GatedActivation,
  tile_rows: int,
  grad_seeds: dict[str, jax.Array] | None = None,
) -> jax.Array:
  """Weighted sum of each row's chosen local experts: y[n] = sum_k w[n,k] * mlp_{e[n,k]}(x[n]).

  Args:
    x: [N, D] rows in the compute dtype; rows that route nowhere may hold anything finite.
    expert_ids: [N, K] int32 local expert ids; ids outside [0, El) are experts held elsewhere
      (or padding) and contribute nothing.
    weights: [N, K] float32 combine weights.
    w_gate_up: [El, D, 2F] local experts' gate/up weights, in the compute dtype.
    w_down: [El, F, D] local experts' down weights, in the compute dtype.
    b_gate_up: [El, 2F] local experts' biases, or None (no bias work).
    b_down: [El, D], or None.
    activation: the gate/up combination.
    tile_rows: B, rows per tile (see `default_tile_rows`).
    grad_seeds: gradient seeds by parameter name ("w_gate_up", "w_down", "b_gate_up",
      "b_down"; see `moejax.chunking.ChunkStages`), or None.

  Returns:
    [N, D] float32.
  """
  rows, top_k = expert_ids.shape
  dim, local_experts = x.shape[-1], w_gate_up.shape[0]
  order, group_sizes = sort_by_expert(expert_ids, local_experts)
  layout = aligned_rows(group_sizes, expert_ids.size, tile_rows)
  # Aligned row r holds assignment order[row_source[r]]; its row of x is that // K (row N, the
  # zero row, for empty slots).
  assignment = order[jnp.minimum(layout.row_source, expert_ids.size - 1)]
  filled = layout.row_source < expert_ids.size
  row_of = jnp.where(filled, assignment // top_k, rows)
  tile_expert = jnp.searchsorted(layout.tile_ends, jnp.arange(row_of.size // tile_rows), "right")
  tiles = Tiles(
    tokens=row_of.reshape(-1, tile_rows),  # [tiles, B]
    weights=jnp.where(filled, weights.reshape(-1)[assignment], 0.0).reshape(-1, tile_rows),
    expert=jnp.minimum(tile_expert, local_experts - 1).astype(jnp.int32),
    num_used=layout.tile_ends[-1],
  )
  x_padded = jnp.concatenate([x, jnp.zeros((1, dim), x.dtype)])  # row N is the empty row

  tiled_out = tile_mlp(
    x_padded,
    w_gate_up,
    w_down,
    b_gate_up,
    b_down,
    tiles,
    tuple((grad_seeds or {}).get(name) for name in EXPERT_PARAMS),
    activation,
  )  # [tiles, B, D], weighted
  tiled_out = jnp.concatenate([tiled_out.reshape(-1, dim), jnp.zeros((1, dim), jnp.float32)])
  assignment_row = jnp.zeros_like(order).at[order].set(layout.source_row)  # [N*K]
  return jnp.sum(tiled_out[assignment_row].reshape(rows, top_k, dim), axis=1)


def sorted_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  *,
  activation: str,
  implementation: str,
) -> jax.Array:
  """`grouped_mlp`'s contract on `kernels_pallas.moe_mlp` (fused kernels, or XLA ragged_dot).

  Sorts the N*K assignments by local expert (the others last, past the groups' sum, where
  `moe_mlp` writes 0), runs the MLP with the routing weights in its epilogue, and sums each
  row's K results. On a CPU the kernels run in their interpreter: for testing only.

  Args and returns: as `grouped_mlp` (without biases, `tile_rows`, and with `activation`
  "silu" or "gelu"), plus `implementation`, a `kernels_pallas` backend name.
  """
  rows, top_k = expert_ids.shape
  order, group_sizes = sort_by_expert(expert_ids, w_gate_up.shape[0])  # [N*K], [El]
  interpret = on_cpu() and implementation != "xla"
  if interpret:
    warnings.warn(
      "expert_backend='pallas' on a CPU runs the Pallas kernels in the interpreter: slow, for "
      "testing only",
      stacklevel=2,
    )
  out_sorted = kernels_pallas.moe_mlp(
    x[order // top_k],
    w_gate_up,
    w_down,
    group_sizes,
    row_weights=weights.reshape(-1)[order].astype(x.dtype),
    activation=activation,
    implementation=implementation,
    interpret=interpret,
  )  # [N*K, D]
  out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)  # back to assignment order
  return jnp.sum(out.reshape(rows, top_k, -1).astype(jnp.float32), axis=1)


# Most local experts for which XLA's ragged_dot beats the tile loop on a GPU (H200, bf16).
RAGGED_DOT_MAX_LOCAL_EXPERTS = 8


def kernel_for(config: MoEConfig) -> str | None:
  """The Pallas kernel that can run the config's experts here, or None (`kernels_pallas`
  decides: its registry knows each kernel's dtypes, activations and epilogues)."""
  return kernels_pallas.api.kernel_for(
    config.dtype, config.activation, biases=config.expert_bias, rhs_format=config.expert_quant
  )


def _why_not(implementation: str, config: MoEConfig) -> str | None:
  """Why `kernels_pallas.moe_mlp` on `implementation` cannot run the config's experts."""
  return kernels_pallas.api.moe_mlp_unsupported_reason(
    implementation,
    config.dtype,
    config.activation,
    biases=config.expert_bias,
    rhs_format=config.expert_quant,
  )


def decode_sized(num_rows: int, local_experts: int) -> bool:
  """Whether a call has no more (row, choice) assignments than local experts.

  Then some experts surely have no rows, and the weights a call must read are those of the
  experts it uses (at most `num_rows` of El). The tile loop and the kernels read only those;
  XLA's ragged_dot on a GPU is rewritten into a dense dot that reads every expert
  (openxla/xla#46002), up to El / num_rows times the bytes. docs/performance.md, "Decode".
  """
  return num_rows <= local_experts


def expert_path(config: MoEConfig, num_rows: int, local_experts: int) -> str:
  """The path of a call on `num_rows` rows: "pallas", "ragged_dot" or "tile_loop" (static).

  A config no kernel can run takes the tile loop, with a warning if it asked for them.

  >>> config = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128)
  >>> expert_path(config, num_rows=512, local_experts=8)  # on a CPU
  'tile_loop'
  """
  kernel = kernel_for(config)
  if config.expert_backend == "pallas":
    if kernel is not None:
      return "pallas"
    warnings.warn(
      "expert_backend='pallas' falls back to the XLA tile loop: no kernel runs it "
      f"({_why_not('triton', config)})",
      stacklevel=2,
    )
    return "tile_loop"
  if config.expert_backend == "auto" and kernel is not None:
    measured = kernels_pallas.api.best_implementation(config.dtype, config.activation, num_rows)
    if measured == kernel:
      return "pallas"
  if (
    _why_not("xla", config) is None
    and not on_cpu()
    and local_experts <= RAGGED_DOT_MAX_LOCAL_EXPERTS
    and not decode_sized(num_rows, local_experts)
  ):
    return "ragged_dot"
  return "tile_loop"


def routed_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  b_gate_up: jax.Array | None,
  b_down: jax.Array | None,
  *,
  config: MoEConfig,
  grad_seeds: dict[str, jax.Array] | None = None,
) -> jax.Array:
  """The local experts' weighted output on rows routed to them, by `expert_path`'s choice.

  With `config.apply_router_weight_on_input` (K=1) each row is scaled by its weight before
  its expert, and the output is not weighted.

  Args and returns: as `grouped_mlp` (without `tile_rows` and `activation`); the biases are
  None without `config.expert_bias`. The tile loop accumulates onto `grad_seeds` in place;
  the other paths add them (`moejax.chunking.seed_gradient`).
  """
  local_experts = w_gate_up.shape[0]
  if config.apply_router_weight_on_input:
    local = (expert_ids >= 0) & (expert_ids < local_experts)
    x = (x.astype(jnp.float32) * jnp.sum(weights, axis=-1, keepdims=True)).astype(x.dtype)
    weights = local.astype(jnp.float32)
  path = expert_path(config, expert_ids.size, local_experts)
  if path == "tile_loop":
    return grouped_mlp(
      x,
      expert_ids,
      weights,
      w_gate_up,
      w_down,
      b_gate_up,
      b_down,
      activation=GatedActivation.of(config),
      tile_rows=default_tile_rows(expert_ids.size, config.num_physical_experts),
      grad_seeds=grad_seeds,
    )
  if b_gate_up is not None or set(grad_seeds or ()) - {"w_gate_up", "w_down"}:
    # `expert_path` sends biases to the tile loop only: here they would be dropped silently.
    raise NotImplementedError(f"the {path} expert path takes no expert biases")
  if grad_seeds:
    w_gate_up, w_down = (
      seed_gradient(w, grad_seeds[name]) if name in grad_seeds else w
      for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down))
    )
  implementation = kernel_for(config) if path == "pallas" else "xla"
  return sorted_mlp(
    x,
    expert_ids,
    weights,
    w_gate_up,
    w_down,
    activation=config.activation,
    implementation=implementation,
  )


def zero_experts(
  rows: jax.Array, expert_ids: jax.Array, weights: jax.Array, *, config: MoEConfig
) -> jax.Array:
  """What a row's zero-computation experts return: the row itself times their weights.

  Computed where the row lives, never sent (LongCat-Flash's "zero experts").

  Args:
    rows: [C, D] in the compute dtype.
    expert_ids: [C, K] dispatched ids; zero experts are [P, P + Z) (`routing.is_zero_expert`).
    weights: [C, K] float32.
    config: the layer's config.

  Returns:
    [C, D] float32.
  """
  zero = routing.is_zero_expert(expert_ids, config)
  zero_weight = jnp.sum(jnp.where(zero, weights, 0.0), axis=-1, keepdims=True)
  return zero_weight * rows.astype(jnp.float32)


def shared_mlp(
  x: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  gate_kernel: jax.Array | None,
  *,
  config: MoEConfig,
) -> jax.Array:
  """The shared experts (fused into one MLP of width Fs) on every row.

  Args:
    x: [C, D] rows in the compute dtype.
    w_gate_up: [D, 2Fs].
    w_down: [Fs, D].
    gate_kernel: [D, 1] with `config.shared_expert_gate`: the output is scaled per row by
      `sigmoid(x @ gate_kernel)`; else None.
    config: the layer's config (its activation).

  Returns:
    [C, D] float32.
  """
  out = gated_mlp(x, w_gate_up, w_down, GatedActivation.of(config))
  if gate_kernel is None:
    return out
  gate = jnp.dot(
    x.astype(jnp.float32),
    gate_kernel.astype(jnp.float32),
    precision=jax.lax.Precision.HIGHEST,
  )
  return out * jax.nn.sigmoid(gate)


def runs_interpreted_kernels(config: MoEConfig) -> bool:
  """Whether the layer runs Pallas kernels in an interpreter (on a CPU): the path it takes
  is the kernels' (`expert_path`), not the tile loop it falls back to."""
  return on_cpu() and config.expert_backend == "pallas" and kernel_for(config) is not None
