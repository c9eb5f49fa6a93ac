"""The quantized weight formats: one `QuantFormat` record each in `FORMATS`, and every list
of formats derives from it (the config's checks, the kernels' decode form, the command
line's choices, the backends' formats). A new format is a row here, its kernels' decode
(`dequant`, `mosaic_quant`) and its tests; a checkpoint reader, where it has one, is a
method of its name on `moejax.hf.layouts.Layout`.

The formats: DeepSeek-V3's fine-grained fp8, OCP MXFP4 (GPT-OSS), symmetric INT4 with a
scale per group of inputs (compressed-tensors' pack-quantized: Kimi-K2-Thinking, K2.5;
blocks (group, 1)), and NVFP4 (NVIDIA's ModelOpt FP4 releases, compressed-tensors'
nvfp4-pack-quantized: e4m3 scales per 16 inputs under a float32 global scale).

Quantizing rounds to nearest; each format's `rule` maps blocks and their largest magnitudes
to (scales, values, global scale or None); a block of zeros gets scale 1 (so does an
all-zero matrix's global scale):

- "fp8_block": scale = the block's largest magnitude / 448 (e4m3's largest finite value),
  as DeepSeek-V3 quantizes.
- "mxfp4": a power-of-two scale 2^(floor(log2 amax) - 2) per 32 inputs, values clamped to
  ±6 (OCP MX v1.0; e2m1's largest exponent is 2).
- "int4_group": scale = amax / 7.5 rounded to bfloat16, values round(w / scale) clamped to
  [-8, 7], as compressed-tensors quantizes symmetric INT4 (its range 15 over 2).
- "nvfp4": compressed-tensors' arithmetic: g = 448 * 6 / the matrix's largest magnitude (as
  (1 / amax) * 2688), scale = g * (the block's amax / 6) rounded to e4m3, values =
  w / (scale / g) clamped to ±6; the global scale stored is 1 / g (a multiplier, as
  ModelOpt's `weight_scale_2`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

_E4M3_MAX = 448.0
_E2M1_MAX = 6.0
_E2M1_MAX_EXPONENT = 2
_INT4_HALF_RANGE = 7.5  # (7 - (-8)) / 2: compressed-tensors' symmetric scale divisor
_NVFP4_GLOBAL = _E4M3_MAX * _E2M1_MAX  # the global scale maps a matrix's amax to e4m3's max

# (blocks [..., in/bi, bi, out/bo, bo] float32, their amax [..., in/bi, 1, out/bo, 1]) ->
# (scales like amax, values like blocks, a global scale per matrix or None).
Rule = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array | None]]


@dataclasses.dataclass(frozen=True)
class QuantFormat:
  """A format of `BlockScaled` weights: what checkpoints store, how moejax quantizes to it,
  which layer sizes it takes and how the kernels read it.

  Attributes:
    values: dtype of the quantized values.
    scales: dtype of the scales (what quantizing writes).
    block: the fixed (bi, bo) block, or None where the checkpoint chooses it.
    rule: how quantizing computes scales and values (`Rule`).
    default_block: the block quantizing uses where nothing chooses one.
    other_scales: further scale dtypes checkpoints of the format store (kept as stored).
    global_scale: whether its weights carry a float32 `global_scale` (NVFP4).
    group_sizes: the input-group sizes bi it takes in blocks (bi, 1), or None for any block.
    whole_input_blocks: the layer's hidden and intermediate sizes must be multiples of bi
      (no partial block of inputs: 4-bit checkpoints store none).
    paired: two values a byte (4-bit): the kernels load neighbouring columns as one byte
      and decode them apart (`kernels_pallas.dequant`); else one value a byte.
  """

  values: jnp.dtype
  scales: jnp.dtype
  block: tuple[int, int] | None
  rule: Rule
  default_block: tuple[int, int]
  other_scales: tuple[jnp.dtype, ...] = ()
  global_scale: bool = False
  group_sizes: tuple[int, ...] | None = None
  whole_input_blocks: bool = False
  paired: bool = False

  def block_for(self, intermediate_size: int) -> tuple[int, int]:
    """The block quantizing uses for experts of F = `intermediate_size` where nothing
    chooses one: the fixed block, else `default_block` with its output side cut to divide F
    (a block may not straddle gate and up) where the format takes any block.

    >>> FORMATS["fp8_block"].block_for(64), FORMATS["int4_group"].block_for(64)
    ((128, 64), (32, 1))
    """
    if self.block is not None:
      return self.block
    rows, columns = self.default_block
    return rows, columns if self.group_sizes else math.gcd(columns, intermediate_size)

  def takes_scales(self, dtype) -> bool:
    """Whether `dtype` is one of the format's scale dtypes."""
    return jnp.dtype(dtype) in (self.scales, *self.other_scales)


def _divide(a: jax.Array, b: jax.Array) -> jax.Array:
  """a / b (b broadcast to a's shape) rounded as one IEEE division. XLA rewrites division by a
  constant or a broadcast value into multiplication by its reciprocal, an ulp off in half the
  cases; an opaque full-shape divisor keeps the division."""
  return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, a.shape))


def _on_e2m1_grid(values: jax.Array) -> jax.Array:
  """`values` (within ±6) rounded to nearest, ties to even, onto e2m1's values (steps of 0.5
  below 2, 1 below 4, 2 up to 6), so that the cast that stores them is exact: a backend's
  own float32 -> float4_e2m1fn conversion need not round correctly (XLA:CPU's loop emitters
  round 3.4994 to 4).

  >>> _on_e2m1_grid(jnp.array([0.25, 0.75, 2.5, 3.4994, 5.0, -5.01])).tolist()
  [0.0, 1.0, 2.0, 3.0, 4.0, -6.0]
  """
  magnitude = jnp.abs(values)
  step = jnp.where(magnitude < 2, 0.5, jnp.where(magnitude < 4, 1.0, 2.0))  # powers of two
  return jnp.round(values / step) * step


def _fp8_block(blocks: jax.Array, amax: jax.Array):
  scale = jnp.where(amax > 0, _divide(amax, jnp.float32(_E4M3_MAX)), 1.0)
  return scale, _divide(blocks, scale), None


def _mxfp4(blocks: jax.Array, amax: jax.Array):
  exponent = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - _E2M1_MAX_EXPONENT
  scale = jnp.where(amax > 0, jnp.exp2(exponent), 1.0)
  values = jnp.clip(blocks / scale, -_E2M1_MAX, _E2M1_MAX)  # a power of two: exact
  return scale, _on_e2m1_grid(values), None


def _int4_group(blocks: jax.Array, amax: jax.Array):
  scale = jnp.where(amax > 0, _divide(amax, jnp.float32(_INT4_HALF_RANGE)), 1.0)
  scale = scale.astype(jnp.bfloat16).astype(jnp.float32)  # as stored
  return scale, jnp.clip(jnp.round(_divide(blocks, scale)), -8, 7), None


def _nvfp4(blocks: jax.Array, amax: jax.Array):
  matrix_amax = jnp.max(amax, axis=(-4, -2), keepdims=True)
  # compressed-tensors' global scale g = 448 * 6 / amax, rounded as torch computes a number
  # over a tensor: the tensor's reciprocal times the number.
  inverse = (1 / matrix_amax) * jnp.float32(_NVFP4_GLOBAL)
  inverse = jnp.where(jnp.isfinite(inverse), inverse, 1.0)  # an all-zero matrix
  scale = inverse * _divide(amax, jnp.float32(_E2M1_MAX))
  scale = jnp.clip(scale, -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
  scale = jnp.where(scale > 0, scale, 1.0)
  values = _divide(blocks, _divide(scale, inverse))
  return scale, _on_e2m1_grid(jnp.clip(values, -_E2M1_MAX, _E2M1_MAX)), 1 / inverse


_FOUR_BIT = dict(whole_input_blocks=True, paired=True)

FORMATS: dict[str, QuantFormat] = {
  "fp8_block": QuantFormat(
    jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32), None, _fp8_block, (128, 128)
  ),
  "mxfp4": QuantFormat(
    jnp.dtype(jnp.float4_e2m1fn), jnp.dtype(jnp.float8_e8m0fnu), (32, 1), _mxfp4, (32, 1),
    **_FOUR_BIT,
  ),
  "int4_group": QuantFormat(
    jnp.dtype(jnp.int4), jnp.dtype(jnp.bfloat16), None, _int4_group, (32, 1),
    other_scales=(jnp.dtype(jnp.float32),), group_sizes=(32, 64, 128), **_FOUR_BIT,
  ),
  "nvfp4": QuantFormat(
    jnp.dtype(jnp.float4_e2m1fn), jnp.dtype(jnp.float8_e4m3fn), (16, 1), _nvfp4, (16, 1),
    global_scale=True, **_FOUR_BIT,
  ),
}  # fmt: skip
