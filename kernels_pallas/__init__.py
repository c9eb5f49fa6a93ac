"""Pallas GPU kernels for grouped expert matmuls. Independent of `moejax`.

- `gmm(lhs, rhs, group_sizes, ...)`: a drop-in for `jax.lax.ragged_dot` with backends "xla",
  "mosaic" (Hopper) and "triton"; differentiable.
- `moe_mlp(x_sorted, w_gate_up, w_down, group_sizes, ...)`: the fused expert MLP.
- `TritonBlocks`, `MosaicBlocks`: block sizes; `autotune` picks and caches them per device.
"""

from kernels_pallas import autotune
from kernels_pallas.api import gmm, moe_mlp
from kernels_pallas.gmm_mosaic import MosaicBlocks
from kernels_pallas.gmm_triton import TritonBlocks

__all__ = ["MosaicBlocks", "TritonBlocks", "autotune", "gmm", "moe_mlp"]
