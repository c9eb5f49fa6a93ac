"""FP8 compute of the expert matmuls (`MoEConfig.compute_quant`): each operand quantized on the
fly to float8_e4m3fn with float32 scales, from the float master weights, in training and in
inference.

Every product an expert computes is one of three kinds, and each recipe says how its two
operands are grouped (a group shares one scale; values x / scale rounded to nearest even in
e4m3fn; the products of the dequantized values summed in float32). "fp8_deepseek" and
"fp8_rowwise" scale each group by amax(|group|) / 448 (float32); "mxfp8", the block-scaled
format of Blackwell's tensor cores (OCP MX), by a power of two (e8m0): 2^ceil(log2(amax /
448)), the smallest that keeps every value within e4m3's 448, as NVIDIA's MXFP8 training
recipe rounds it (no value saturates). A group of zeros takes scale 1.

================  =============================  ============================  =================
product           "fp8_deepseek" (DeepSeek-V3)   "fp8_rowwise"                 "mxfp8"
================  =============================  ============================  =================
forward  a @ W    a: 1x128 along the contraction a: one scale per row          a: 1x32 along the
                  W: 128x128 blocks of [in, out]  W: one scale per output       contraction
                                                 column                        W: 32x1 along it
dgrad    g @ W^T  g: 1x128 along the contraction g: one scale per row          g: 1x32, W: 1x32
                  W: the forward's blocks         W: the forward's scales (per  (W quantized
                                                 W's column)                   again, along out)
wgrad    a^T @ g  a, g: 128x1 along the tokens   a, g: one scale per column,   a, g: 32x1 along
                                                 over the tokens               the tokens
================  =============================  ============================  =================

(forward: x @ W_gate_up and hidden @ W_down; dgrad: the cotangents through W_down and
W_gate_up; wgrad: the weights' gradients, whose token axis is the rows of one tile of the
tile loop: whole groups of the recipe's, or one group where the tile is shorter.) The master
weights and their gradients stay in their float dtypes; the router, the shared experts and
adapters compute unquantized. `fp8_deepseek` needs D and F to be multiples of 128, `mxfp8` of
32 (their groups): `MoEConfig` says so.

On the tile loop the quantization is emulated: dequantized values multiplied in float32 at
full precision, the numerics a Hopper kernel that promotes its fp8 sums to float32 every 128
of the contraction computes; with `expert_backend="pallas"`, "fp8_deepseek" runs on such
kernels (`kernels_pallas.gmm_fp8`, `moejax.plan.fp8_kernel_reason`), and with "fused" on the
fused path's (`kernels_pallas.fused_moe`, `moejax.plan.fused_unsupported_reason`), each
quantizing with the same function. Their wgrads' token groups are 128 rows of one expert as
they lay its rows out (gmm_fp8: sorted by expert; fused: in token order), not the tile
loop's tiles: the weights' gradients differ from the tile loop's by that grouping.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from kernels_pallas.fp8_groups import GROUP, dequantize_groups, quantize_groups

ComputeQuant = Literal["fp8_deepseek", "fp8_rowwise", "mxfp8"]
RECIPES: tuple[str, ...] = ("fp8_deepseek", "fp8_rowwise", "mxfp8")
MX_GROUP = 32  # mxfp8's group along an axis (fp8_deepseek's: GROUP, 128)
Product = Literal["forward", "dgrad", "wgrad"]


def fake_quantized(
  x: jax.Array, group_shape: tuple[int | None, int | None], power_of_two: bool = False
) -> jax.Array:
  """x [M, N] quantized to float8_e4m3fn in groups and dequantized, in float32
  (`kernels_pallas.fp8_groups.quantize_groups`, which the fp8 kernels share).

  Args:
    x: [M, N] float.
    group_shape: (rows, cols) of a group; None for the whole axis, and the whole axis where
      it is shorter than the group (a tile of fewer than 128 tokens is one group).
    power_of_two: each scale rounded up to a power of two (mxfp8's e8m0 scales), else
      amax / 448 as it is.

  >>> fake_quantized(jnp.array([[448.0, 1.0, 1.1], [0.0, 0.0, 0.0]]), (1, None)).tolist()
  [[448.0, 1.0, 1.125], [0.0, 0.0, 0.0]]
  >>> fake_quantized(jnp.array([[500.0, 1.1, 0.3]]), (1, None), power_of_two=True).tolist()
  [[512.0, 1.125, 0.3125]]

  (500 / 448 rounds up to the scale 2; 250, 0.55 and 0.15 are then rounded in e4m3.)
  """
  return dequantize_groups(*quantize_groups(x, group_shape, power_of_two))


def _groups(recipe: str, product: Product) -> tuple[tuple, tuple]:
  """(lhs group, rhs group) of a product `lhs @ rhs` as it is multiplied: forward a @ W,
  dgrad g @ W^T (rhs = W^T, W's groups transposed), wgrad a^T @ g (lhs = a^T)."""
  if recipe == "mxfp8":  # along each product's contraction; W^T quantized along W's out
    return ((1, MX_GROUP), (MX_GROUP, 1))
  if recipe == "fp8_deepseek":
    return {
      "forward": ((1, GROUP), (GROUP, GROUP)),
      "dgrad": ((1, GROUP), (GROUP, GROUP)),
      "wgrad": ((1, GROUP), (GROUP, 1)),
    }[product]
  return {
    "forward": ((1, None), (None, 1)),
    "dgrad": ((1, None), (1, None)),
    "wgrad": ((1, None), (None, 1)),
  }[product]


def matmul(lhs: jax.Array, rhs: jax.Array, recipe: str | None, product: Product) -> jax.Array:
  """lhs [M, K] @ rhs [K, N] in float32, each operand quantized by `recipe` for `product`
  (None: the plain product of the operands as they are). As multiplied: a forward's a @ W,
  a dgrad's g @ W^T (rhs = W^T), a wgrad's a^T @ g (lhs = a^T)."""
  if recipe is None:
    return jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)
  lhs_group, rhs_group = _groups(recipe, product)
  power_of_two = recipe == "mxfp8"
  lhs_q = fake_quantized(lhs, lhs_group, power_of_two)
  rhs_q = fake_quantized(rhs, rhs_group, power_of_two)
  return jnp.dot(lhs_q, rhs_q, precision=jax.lax.Precision.HIGHEST)


def token_group(recipe: str | None) -> int | None:
  """The recipe's group along an axis (its wgrad's along the tokens), or None (whole axes)."""
  return {"fp8_deepseek": GROUP, "mxfp8": MX_GROUP}.get(recipe)


def size_reason(recipe: str | None, **widths: int) -> str | None:
  """Why the recipe cannot quantize the experts' `widths` (by their config names: not
  multiples of its group), or None."""
  group = token_group(recipe)
  if group is None:
    return None
  for name, size in widths.items():
    if size % group:
      return (
        f"compute_quant={recipe!r} quantizes in groups of {group}: {name}={size} must be "
        f"a multiple of {group}"
      )
  return None
