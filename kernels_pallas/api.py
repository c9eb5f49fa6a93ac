"""Public entry points: `gmm` (a drop-in for `jax.lax.ragged_dot`) and `moe_mlp`.

`implementation` names a backend of `backends.BACKENDS`: "xla" (`jax.lax.ragged_dot`, the
reference), "mosaic" (Pallas Mosaic GPU, Hopper), "triton" (Pallas Triton, older GPUs). A case
a kernel does not support raises `NotImplementedError` naming the reason. None picks by
`best_implementation`: a kernel only where a recorded GPU run showed it correct and faster
than XLA (or for a quantized rhs, which XLA cannot take), else "xla". Whether a backend can
run a case, and which kernel a device runs, are the registry's answers (`backends`).
`interpret=True` runs a Pallas kernel on the CPU in its interpreter (the Mosaic GPU
interpreter for mosaic, the Pallas interpreter for triton).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels_pallas import autotune
from kernels_pallas.activations import EPILOGUE_ACTIVATIONS
from kernels_pallas.backends import BACKENDS, REFERENCE, Case, select_kernel, unsupported_reason
from kernels_pallas.gmm_xla import moe_mlp_reference
from kernels_pallas.ops import KernelSettings, gmm_vjp, moe_mlp_vjp
from kernels_pallas.quantized import format_of, from_qarray, is_qarray

IMPLEMENTATIONS = tuple(BACKENDS)


# Backends that a recorded GPU run of `benchmarks/gpu_check.py` (docs/performance.md) showed
# correct and faster than XLA, each with the fewest rows per call at which it was measured
# faster. Empty: the one run so far (H200, 2026-11-29) measured the Mosaic forward 2-13x
# faster than ragged_dot at 8192+ rows, but its backward failed there and was rewritten since.
KERNEL_FASTER_FROM_ROWS: dict[str, int] = {}


def measured_faster(kernel: str, num_rows: int) -> bool:
  """Whether `KERNEL_FASTER_FROM_ROWS` records `kernel` faster than XLA on calls of
  `num_rows` rows."""
  return num_rows >= KERNEL_FASTER_FROM_ROWS.get(kernel, math.inf)


def best_implementation(
  dtype, activation=None, num_rows: int = 0, *, rhs_format: str | None = None
) -> str:
  """The backend `implementation=None` runs on `num_rows` rows: the device's kernel for the
  case (`backends.select_kernel`) where it is `measured_faster`, or always for a quantized
  rhs (`rhs_format`), which XLA takes none of; else "xla"."""
  kernel = select_kernel(Case(dtype, activation, rhs_format=rhs_format))
  if kernel is not None and (rhs_format or measured_faster(kernel, num_rows)):
    return kernel
  return REFERENCE


def _settings(op, implementation, lhs, rhs, config, precision, out_dtype, interpret):
  """Kernel settings: the given blocks, else the tuned ones cached for this device and shape
  (`autotune`), else the per-shape-class heuristic (fitted to a quantized rhs in `ops`)."""
  num_rows, k = lhs.shape
  groups, _, n = rhs.shape
  backend = BACKENDS[implementation]
  if config is not None and not isinstance(config, backend.blocks_type):
    raise TypeError(
      f"config for {implementation} must be {backend.blocks_type.__name__}, got {config!r}"
    )
  key = autotune.cache_key(op, implementation, (num_rows, k, n, groups), lhs.dtype)
  return KernelSettings(
    implementation=implementation,
    blocks=config or autotune.lookup(key) or backend.default_blocks(num_rows, k, n),
    tgmm_blocks=backend.tgmm_blocks(num_rows, k, n),
    precision=precision,
    out_dtype=out_dtype,
    interpret=interpret,
  )


def _resolve(implementation: str | None, lhs, rhs, activation=None, precision=None) -> str:
  """The backend a call runs on: the named one, or for None `best_implementation`'s; raises
  NotImplementedError with the reason when it cannot run the call."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}"
    )
  rhs_format = format_of(rhs)
  case = Case(
    lhs.dtype, activation, precision=precision, rhs_dtype=None if rhs_format else rhs.dtype,
    rhs_format=rhs_format,
  )  # fmt: skip
  if implementation is None:
    implementation = best_implementation(lhs.dtype, activation, lhs.shape[0], rhs_format=rhs_format)
    if implementation == REFERENCE and rhs_format is None:
      return REFERENCE  # jax.lax.ragged_dot's own dtype rules
  why = unsupported_reason(implementation, case)
  if why is not None:
    raise NotImplementedError(why)
  return implementation


def _check_gmm_shapes(lhs, rhs, group_sizes) -> None:
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise ValueError(f"gmm needs lhs [M, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}")
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"lhs K={lhs.shape[1]} must equal rhs K={rhs.shape[1]}")
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(f"group_sizes has shape {group_sizes.shape}, expected ({rhs.shape[0]},)")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  *,
  precision=None,
  preferred_element_type=None,
  implementation: str | None = None,
  config=None,
  interpret: bool = False,
) -> jax.Array:
  """Grouped matmul with `jax.lax.ragged_dot`'s semantics.

  Rows of lhs are grouped in order by `group_sizes`; group g's rows are multiplied by rhs[g].
  Rows past sum(group_sizes) give 0; zero-size groups are allowed. Differentiable.

  Args:
    lhs: [M, K].
    rhs: [G, K, N], or a `BlockScaled` (fp8_block, mxfp4, int4_group, nvfp4) for a backend
      that lists its format in `quant_formats`: dequantized tile by tile in the kernel, no
      gradient. A qwix `QArray` in one of those formats is taken as its `BlockScaled`.
    group_sizes: [G] int, sum <= M.
    precision: `jax.lax.Precision` of the products.
    preferred_element_type: output dtype (default lhs's).
    implementation: "xla", "mosaic", "triton", or None (best for the device, XLA fallback).
    config: block sizes (`TritonBlocks` / `MosaicBlocks`), or None for the heuristic.
    interpret: run the Pallas kernel in its interpreter (CPU testing).

  Returns:
    [M, N].

  >>> lhs, rhs = jnp.ones((5, 2)), jnp.ones((2, 2, 3))
  >>> gmm(lhs, rhs, jnp.array([1, 3]), implementation="xla")[:, 0].tolist()
  [2.0, 2.0, 2.0, 2.0, 0.0]
  """
  rhs = from_qarray(rhs) if is_qarray(rhs) else rhs
  _check_gmm_shapes(lhs, rhs, group_sizes)
  implementation = _resolve(implementation, lhs, rhs, precision=precision)
  if implementation == REFERENCE:
    return jax.lax.ragged_dot(
      lhs, rhs, group_sizes, precision=precision, preferred_element_type=preferred_element_type
    )
  settings = _settings(
    "gmm", implementation, lhs, rhs, config, precision, preferred_element_type, interpret
  )
  return gmm_vjp(lhs, rhs, group_sizes, settings)


def moe_mlp(
  x_sorted: jax.Array,
  w_gate_up: jax.Array,
  w_down: jax.Array,
  group_sizes: jax.Array,
  *,
  row_weights: jax.Array | None = None,
  activation: str = "silu",
  precision=None,
  implementation: str | None = None,
  config=None,
  interpret: bool = False,
) -> jax.Array:
  """The fused expert MLP on rows sorted by expert: w * (act(x @ Wg) * (x @ Wu)) @ Wd.

  The first kernel computes `act(gate) * up` in its epilogue, so the [M, 2F] pre-activation
  never goes to memory; the second scales each row by its routing weight in its epilogue.
  Differentiable in x, both weights and row_weights.

  Args:
    x_sorted: [M, D] rows grouped by expert in order.
    w_gate_up: [G, D, 2F]; gate = `[..., :F]`, up = `[..., F:]`.
    w_down: [G, F, D]. Both may be `BlockScaled` of one format (as for `gmm`'s rhs): then
      they are constants, and gradients reach x and row_weights only.
    group_sizes: [G] int, sum <= M; rows past the sum give 0.
    row_weights: [M] routing weight of each row, or None for 1.
    activation: "silu" or "gelu" (exact erf).
    precision: `jax.lax.Precision` of the products.
    implementation: as for `gmm`.
    config: block sizes for the forward kernels, or None.
    interpret: run Pallas kernels in the interpreter.

  Returns:
    [M, D] in x's dtype.
  """
  if activation not in EPILOGUE_ACTIVATIONS:
    raise ValueError(f"activation must be one of {EPILOGUE_ACTIVATIONS}, got {activation!r}")
  w_gate_up, w_down = (from_qarray(w) if is_qarray(w) else w for w in (w_gate_up, w_down))
  _check_gmm_shapes(x_sorted, w_gate_up, group_sizes)
  if format_of(w_gate_up) != format_of(w_down):
    raise ValueError(
      f"w_gate_up and w_down must share a format, got {format_of(w_gate_up)} and "
      f"{format_of(w_down)}"
    )
  f = w_gate_up.shape[-1] // 2
  if w_gate_up.shape[-1] % 2 or w_down.shape != (w_gate_up.shape[0], f, x_sorted.shape[1]):
    raise ValueError(
      f"w_gate_up {w_gate_up.shape} and w_down {w_down.shape} must be [G, D, 2F] and [G, F, D]"
    )
  if row_weights is not None and row_weights.shape != x_sorted.shape[:1]:
    raise ValueError(f"row_weights has shape {row_weights.shape}, expected ({x_sorted.shape[0]},)")
  weights = jnp.ones(x_sorted.shape[:1], x_sorted.dtype) if row_weights is None else row_weights
  implementation = _resolve(implementation, x_sorted, w_gate_up, activation, precision)
  if implementation == REFERENCE:
    return moe_mlp_reference(
      x_sorted, w_gate_up, w_down, group_sizes, weights, activation, precision
    )
  settings = _settings(
    "moe_mlp", implementation, x_sorted, w_gate_up, config, precision, None, interpret
  )
  return moe_mlp_vjp(x_sorted, w_gate_up, w_down, group_sizes, weights, activation, settings)
