"""The gated activations of the kernels' epilogues, in a form every backend can lower."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import compat

# The activations the kernels' gated epilogue computes (`activate`).
EPILOGUE_ACTIVATIONS = ("silu", "gelu")


def activate(x: jax.Array, activation: str, erf=compat.erf) -> jax.Array:
  """silu, or gelu in its exact form 0.5 x (1 + erf(x / sqrt 2)), with `erf` swappable."""
  if activation == "silu":
    return x / (1.0 + jnp.exp(-x))
  return 0.5 * x * (1.0 + erf(x * 0.7071067811865476))


def erf_in_kernel(x: jax.Array) -> jax.Array:
  """erf from exp and arithmetic, for Triton, whose Pallas lowering has no erf.

  Abramowitz & Stegun 7.1.26: absolute error 1.5e-7 in exact arithmetic, under 1e-6 in
  float32, a few float32 ulps of erf near 1.
  """
  t = 1.0 / (1.0 + 0.3275911 * jnp.abs(x))
  poly = t * (
    0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
  )
  magnitude = 1.0 - poly * jnp.exp(-x * x)
  return jnp.where(x < 0, -magnitude, magnitude)
