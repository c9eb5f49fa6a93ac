"""Pallas GPU kernels for grouped expert matmuls. Independent of `moejax`.

- `gmm(lhs, rhs, group_sizes, ...)`: a drop-in for `jax.lax.ragged_dot`; differentiable.
- `moe_mlp(x_sorted, w_gate_up, w_down, group_sizes, ...)`: the fused expert MLP.
- `fused_moe_mlp(x, expert_ids, weights, w_gate_up, w_down, ...)`: the whole expert MLP on
  rows read by index (`fused_moe`: no sort, permuted copy or scatter), differentiable.
- `backends.BACKENDS`: the registry of implementations ("xla", "triton", "mosaic"), each a
  frozen record of its blocks, limits, `gmm` and `tgmm`. `interpret=True` runs a Pallas
  backend on a CPU in its interpreter.
- `TritonBlocks`, `MosaicBlocks`: block sizes; `autotune` picks and caches them per device.
- `BlockScaled`: a quantized rhs in one of `formats.FORMATS` (fp8_block, mxfp4, int4_group,
  nvfp4: one record each) that both kernels dequantize tile by tile (`dequant`,
  `mosaic_quant`); a qwix `QArray` is taken as one.
"""

from kernels_pallas import autotune
from kernels_pallas.api import gmm, moe_mlp
from kernels_pallas.backends import BACKENDS
from kernels_pallas.fused_moe import fused_moe_mlp
from kernels_pallas.gmm_mosaic import MosaicBlocks
from kernels_pallas.gmm_triton import TritonBlocks
from kernels_pallas.quantized import BlockScaled

__all__ = [
  "BACKENDS",
  "BlockScaled",
  "MosaicBlocks",
  "TritonBlocks",
  "autotune",
  "fused_moe_mlp",
  "gmm",
  "moe_mlp",
]
