"""Expert compute: the gated MLP of each local expert on the rows routed to it.

The XLA backend (`grouped_mlp`) sorts the (row, choice) assignments by expert, pads each
expert's rows to whole tiles (`moejax.grouping`) and runs one dense [B, D] x [D, 2F] x [F, D]
MLP per tile in a `lax.scan`. Tiles past the used ones are skipped with `lax.cond`, so the
cost follows the rows actually routed here, not the static worst case. On a CPU this runs
near the dense-matmul rate, where `jax.lax.ragged_dot` is an order of magnitude slower (see
docs/performance.md). The Pallas backend (`sorted_pallas_mlp`) runs the fused kernels of
`kernels_pallas`.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

import kernels_pallas
from moejax.config import MoEConfig
from moejax.grouping import tile_layout
from moejax.tiles import tile_mlp

_MIN_TILE_ROWS = 8
_MAX_TILE_ROWS = 128


def default_tile_rows(num_rows: int, num_experts: int) -> int:
  """Rows per tile: about the mean rows per expert, a power of two in [8, 128].

  Small tiles waste less padding when chunks are small and experts many; large ones run the
  matmuls at full rate. Static: it depends on shapes only.
  """
  mean_rows = max(num_rows // num_experts, 1)
  return min(max(1 << (mean_rows.bit_length() - 1), _MIN_TILE_ROWS), _MAX_TILE_ROWS)


def grouped_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  *,
  activation: str,
  tile_rows: int,
) -> jax.Array:
  """Weighted sum of each row's chosen local experts: y[n] = sum_k w[n,k] * mlp_{e[n,k]}(x[n]).

  Args:
    x: [N, D] rows in the compute dtype; rows that route nowhere may hold anything finite.
    expert_ids: [N, K] int32 local expert ids; ids outside [0, El) are experts held elsewhere
      (or padding) and contribute nothing.
    weights: [N, K] float32 combine weights.
    w_gate_up: [El, D, 2F] local experts' gate/up weights, in the compute dtype.
    w_down: [El, F, D] local experts' down weights, in the compute dtype.
    activation: "silu" or "gelu".
    tile_rows: B, rows per tile (see `default_tile_rows`).

  Returns:
    [N, D] float32.
  """
  rows, top_k = expert_ids.shape
  dim = x.shape[-1]
  layout = tile_layout(expert_ids.reshape(-1), w_gate_up.shape[0], tile_rows)
  x_padded = jnp.concatenate([x, jnp.zeros((1, dim), x.dtype)])  # row N is the empty row
  tile_tokens = jnp.minimum(layout.row_item // top_k, rows).reshape(-1, tile_rows)  # [tiles, B]

  tiled_out = tile_mlp(
    x_padded, w_gate_up, w_down, tile_tokens, layout.tile_group, layout.num_used_tiles, activation
  )  # [tiles, B, D]
  tiled_out = jnp.concatenate([tiled_out.reshape(-1, dim), jnp.zeros((1, dim), jnp.float32)])
  per_choice = tiled_out[layout.item_row].reshape(rows, top_k, dim)  # [N, K, D]
  return jnp.einsum("nk,nkd->nd", weights, per_choice)


def sorted_pallas_mlp(
  x: jax.Array,
  expert_ids: jax.Array,
  weights: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  *,
  activation: str,
) -> jax.Array:
  """`grouped_mlp`'s contract on the `kernels_pallas.moe_mlp` fused kernels.

  Sorts the N*K assignments by local expert (the others last, past the groups' sum, where the
  kernels write 0), runs the fused MLP with the routing weights in its epilogue, and sums each
  row's K results. On a CPU the kernels run in the Pallas interpreter: for testing only.

  Args and returns: as `grouped_mlp` (without `tile_rows`).
  """
  rows, top_k = expert_ids.shape
  local_experts = w_gate_up.shape[0]
  flat = expert_ids.reshape(-1)
  key = jnp.where((flat >= 0) & (flat < local_experts), flat, local_experts)
  order = jnp.argsort(key, stable=True)  # [N*K]
  group_sizes = jnp.zeros(local_experts + 1, jnp.int32).at[key].add(1)[:local_experts]
  interpret = on_cpu()
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
    implementation="triton" if interpret else None,
    interpret=interpret,
  )  # [N*K, D]
  out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)  # back to assignment order
  return jnp.sum(out.reshape(rows, top_k, -1).astype(jnp.float32), axis=1)


def on_cpu() -> bool:
  """Whether the default device is a CPU (where Pallas kernels can only be interpreted)."""
  return jax.devices()[0].platform == "cpu"


def use_pallas(config: MoEConfig) -> bool:
  """Whether the expert compute runs on the Pallas kernels: "pallas", or "auto" on a GPU where
  a kernel supports the compute dtype and activation (else the tiled XLA path is faster than
  the kernels' `ragged_dot` fallback)."""
  if config.expert_backend == "auto":
    return kernels_pallas.api.best_implementation(config.dtype, config.activation) != "xla"
  return config.expert_backend == "pallas"
