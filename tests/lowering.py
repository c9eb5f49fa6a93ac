"""Programs lowered for a CUDA GPU without one (`jax.export`), and abstract quantized weights
to lower them with."""

import jax
import jax.numpy as jnp
from jax import export

from kernels_pallas.compat import cuda_target
from kernels_pallas.quantized import FORMATS, BlockScaled


def cuda_custom_calls(fn, *shapes, disabled=(), device_kind="NVIDIA H100") -> str:
  """The MLIR text of `fn` exported for CUDA at `shapes` (abstract arguments), on a target of
  `device_kind`: its custom calls name the kernels it lowered to."""
  exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=list(disabled))
  with cuda_target(device_kind):
    return exported(*shapes).mlir_module()


def block_scaled_spec(shape: tuple[int, ...], rhs_format: str) -> BlockScaled:
  """Abstract `BlockScaled` weights [G, in, out] in a format (fp8_block with 128x128 blocks,
  int4_group in groups of 128: the kernels take them as 32-row blocks)."""
  form = FORMATS[rhs_format]
  block = form.block or ((128, 1) if rhs_format == "int4_group" else (128, 128))
  scales = (shape[0], -(-shape[1] // block[0]), -(-shape[2] // block[1]))
  spec = jax.ShapeDtypeStruct
  global_scale = spec((shape[0], shape[2]), jnp.float32) if form.global_scale else None
  return BlockScaled(spec(shape, form.values), spec(scales, form.scales), block, global_scale)
