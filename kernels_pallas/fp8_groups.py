"""Group-wise fp8 quantization: float8_e4m3fn values with one float32 scale per group, the one
definition `moejax.compute_quant`'s emulated recipes and the fp8 kernels (`gmm_fp8`) share.

A group of `group_shape` (rows, cols) over the last two axes shares its scale amax(|group|) / 448
(1 for a group of zeros), or, with `power_of_two`, that rounded up to a power of two (MXFP8's
e8m0 scales: no value saturates); values are x / scale (an IEEE division) rounded to nearest
even in e4m3fn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
GROUP = 128  # DeepSeek-V3's group along an axis (1x128 rows, 128x128 blocks)


def quantize_groups(
  x: jax.Array, group_shape: tuple[int | None, int | None], power_of_two: bool = False
) -> tuple[jax.Array, jax.Array]:
  """x [..., R, C] as (values [..., R, C] float8_e4m3fn, scales [..., R/gr, C/gc] float32).

  Args:
    x: [..., R, C] float; R and C multiples of the group's.
    group_shape: (rows, cols) of a group; None for the whole axis, and the whole axis where it
      is shorter than the group.
    power_of_two: scales rounded up to powers of two.

  >>> values, scales = quantize_groups(jnp.array([[448.0, 1.0, 1.1], [0.0, 0.0, 0.0]]), (1, None))
  >>> values.astype(jnp.float32).tolist(), scales.tolist()
  ([[448.0, 1.0, 1.125], [0.0, 0.0, 0.0]], [[1.0], [1.0]])
  """
  *lead, rows, cols = x.shape
  gr, gc = (min(g or size, size) for g, size in zip(group_shape, (rows, cols), strict=True))
  grouped = x.astype(jnp.float32).reshape(*lead, rows // gr, gr, cols // gc, gc)
  amax = jnp.max(jnp.abs(grouped), axis=(-3, -1), keepdims=True)
  scale = jnp.where(amax > 0, _divided(amax, E4M3_MAX), 1.0)
  if power_of_two:
    scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
  values = _divided(grouped, scale).astype(jnp.float8_e4m3fn).reshape(x.shape)
  return values, scale.reshape(*lead, rows // gr, cols // gc)


def _divided(a: jax.Array, b) -> jax.Array:
  """a / b (b broadcast to a's shape), one IEEE division wherever it is compiled. XLA may
  multiply by the reciprocal of a constant or broadcast divisor instead, an ulp off in some
  cases: a scale an ulp off rounds a value on a boundary the other way, and the kernels and
  the emulation, compiled apart, would disagree. An opaque full-shape divisor keeps the
  division."""
  return a / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.float32(b), a.shape))


def dequantize_groups(values: jax.Array, scales: jax.Array) -> jax.Array:
  """values * scales in float32, each scale broadcast over its group (`quantize_groups`'s
  inverse up to the rounding)."""
  *_, rows, cols = values.shape
  gr, gc = rows // scales.shape[-2], cols // scales.shape[-1]
  scales = jnp.repeat(jnp.repeat(scales, gr, axis=-2), gc, axis=-1)
  return values.astype(jnp.float32) * scales
