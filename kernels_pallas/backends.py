"""The backend registry: every grouped-matmul implementation, by name, in one table.

`BACKENDS[name]` is a frozen `Backend` record: its block-size class and defaults, the GPUs
it is made for, why it cannot run a case, and its two products, `gmm` (out = lhs @ rhs[g]
per group of rows, with optional epilogues) and `tgmm` (out[g] = lhs[rows of g]^T @ dout[rows
of g], the weight gradient). Everything that chooses or calls a backend reads this table, and
two questions have one answer each: `unsupported_reason` (can this backend run this case, and
if not why) and `select_kernel` (which kernel runs a case on a device), which walks the table
in its order of preference.

>>> list(BACKENDS)
['mosaic', 'triton', 'xla']
>>> unsupported_reason("mosaic", Case(jnp.float32))
'mosaic runs bf16/f16 wgmma only, got float32'
>>> select_kernel(Case(jnp.bfloat16, "silu"), capability="9.0")
'mosaic'
>>> select_kernel(Case(jnp.bfloat16, "gelu"), capability="9.0")  # mosaic has silu only
'triton'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax.numpy as jnp

from kernels_pallas import gmm_mosaic, gmm_triton, gmm_xla, mosaic_quant, platform
from kernels_pallas.activations import EPILOGUE_ACTIVATIONS
from kernels_pallas.formats import FORMATS
from kernels_pallas.gmm_mosaic import MosaicBlocks
from kernels_pallas.gmm_triton import TritonBlocks


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of the grouped matmuls.

  Attributes:
    name: "xla", "triton" or "mosaic".
    made_for: GPU compute capability ("9.0") -> whether this is a kernel built for that GPU;
      None stands for no GPU, where the kernel made for every GPU (triton) runs in its
      interpreter for testing. Always False for xla, which is no kernel.
    blocks_type: its block-size dataclass (None for xla).
    default_blocks: (M, K, N) -> the forward kernel's blocks for that shape class.
    tgmm_blocks: (M, K, N) -> the transposed kernel's blocks.
    tgmm_multiples: blocks -> (M, K, N) multiples `tgmm`'s operands must be padded to.
    unsupported_reason: (dtype, activation, precision) -> why it cannot run the case, or None.
    quant_formats: the `kernels_pallas.formats.FORMATS` its kernels take as a `BlockScaled`
      rhs, dequantized tile by tile in registers (`kernels_pallas.dequant`). XLA takes none:
      its ragged_dot would need every expert's weights dequantized at once.
    gmm: `gmm(lhs, rhs, group_sizes, row_weights, *, blocks, activation, transpose_rhs,
      out_dtype, precision, interpret)` -> [M, N]; operands padded to whole blocks.
    tgmm: `tgmm(lhs, dout, group_sizes, *, blocks, row_tile, out_dtype, precision,
      interpret)` -> [G, K, N]; operands padded to `tgmm_multiples` and to `row_tile`, the
      forward kernel's rows per tile (what a kernel that regroups rows aligns them to).
    fit_blocks: (blocks, BlockScaled rhs, transpose_rhs) -> the blocks its kernels run that
      rhs with, read that way.
    candidate_blocks: forward-kernel blocks worth timing beside `default_blocks` (what
      `moejax.tune` measures, each a candidate of its own); () for none.
    gmm_tiles, tgmm_tiles: for a backend whose kernels regroup rows into whole tiles of one
      group each, its kernels on rows so regrouped (`gmm_mosaic_tiles`, `tgmm_mosaic_tiles`):
      the expert MLP then keeps its rows in tiles from one product to the next (`ops`); None
      for the others.
  """

  name: str
  made_for: Callable[[str | None], bool]
  blocks_type: type | None
  default_blocks: Callable
  tgmm_blocks: Callable
  tgmm_multiples: Callable
  unsupported_reason: Callable
  gmm: Callable
  tgmm: Callable
  quant_formats: tuple[str, ...] = ()
  fit_blocks: Callable = lambda blocks, rhs, transpose_rhs=False: blocks
  candidate_blocks: tuple = ()
  gmm_tiles: Callable | None = None
  tgmm_tiles: Callable | None = None


def _mosaic_tgmm_blocks(num_rows: int, k: int, n: int) -> MosaicBlocks:
  """128 x 128 output tiles, 64 rows a step; 3 stages keep shared memory under the limit."""
  del num_rows, k, n
  return MosaicBlocks(block_m=128, block_n=128, block_k=64, max_concurrent_steps=3)


# A backend's name (`implementation=` of the ops).
BackendName = Literal["mosaic", "triton", "xla"]

# In order of preference: a device runs the first kernel made for it that can run the case.
BACKENDS: dict[BackendName, Backend] = {
  "mosaic": Backend(
    name="mosaic",
    made_for=lambda capability: capability is not None and capability.startswith("9"),  # Hopper
    blocks_type=MosaicBlocks,
    default_blocks=gmm_mosaic.default_blocks,
    tgmm_blocks=_mosaic_tgmm_blocks,
    tgmm_multiples=lambda b: (1, b.block_m, b.block_n),
    unsupported_reason=gmm_mosaic.unsupported_reason,
    gmm=gmm_mosaic.gmm_mosaic,
    tgmm=gmm_mosaic.tgmm_mosaic,
    quant_formats=tuple(FORMATS),  # one decode path takes every format
    fit_blocks=mosaic_quant.fit_blocks,
    candidate_blocks=gmm_mosaic.CANDIDATE_BLOCKS,
    gmm_tiles=gmm_mosaic.gmm_mosaic_tiles,
    tgmm_tiles=gmm_mosaic.tgmm_mosaic_tiles,
  ),
  "triton": Backend(
    name="triton",
    made_for=lambda capability: True,  # every CUDA GPU; on a CPU, the interpreted kernel
    blocks_type=TritonBlocks,
    default_blocks=gmm_triton.default_blocks,
    tgmm_blocks=gmm_triton.default_blocks,
    tgmm_multiples=lambda b: (b.block_m, b.block_k, b.block_n),
    unsupported_reason=gmm_triton.unsupported_reason,
    gmm=gmm_triton.gmm_triton,
    tgmm=gmm_triton.tgmm_triton,
    quant_formats=tuple(FORMATS),  # one decode path takes every format
    fit_blocks=gmm_triton.fit_blocks,
  ),
  "xla": Backend(
    name="xla",
    made_for=lambda capability: False,
    blocks_type=None,
    default_blocks=gmm_xla.no_blocks,
    tgmm_blocks=gmm_xla.no_blocks,
    tgmm_multiples=lambda _: (1, 1, 1),
    unsupported_reason=gmm_xla.unsupported_reason,
    gmm=gmm_xla.gmm_xla,
    tgmm=gmm_xla.tgmm_xla,
  ),
}


# The reference backend: made for no device, it runs every float case (not quantized rhs);
# what a call takes where no kernel is chosen.
REFERENCE = "xla"


@dataclasses.dataclass(frozen=True)
class Case:
  """What a call asks of a backend.

  Attributes:
    dtype: lhs's dtype (the kernels' compute dtype).
    activation: the gated epilogue's activation, or None for a plain product.
    precision: `jax.lax.Precision` / `DotAlgorithmPreset` of the products, or None.
    rhs_dtype: rhs's dtype, None for lhs's (ignored for a quantized rhs, which is decoded to
      lhs's dtype).
    rhs_format: the `kernels_pallas.formats.FORMATS` name of a `BlockScaled` rhs, or None.
    biases: whether the MLP has expert biases (no backend has a bias epilogue).
  """

  dtype: object
  activation: str | None = None
  _: dataclasses.KW_ONLY
  precision: object = None
  rhs_dtype: object = None
  rhs_format: str | None = None
  biases: bool = False


def unsupported_reason(name: str, case: Case) -> str | None:
  """Why backend `name` cannot run `case`, or None: the one answer to that question.

  >>> unsupported_reason("xla", Case(jnp.float32, "swiglu_oai"))
  "activation='swiglu_oai' (the epilogues have ('silu', 'gelu'))"
  """
  return _reason(BACKENDS[name], case)


def _reason(backend: Backend, case: Case) -> str | None:
  if case.activation is not None and case.activation not in EPILOGUE_ACTIVATIONS:
    return f"activation={case.activation!r} (the epilogues have {EPILOGUE_ACTIVATIONS})"
  if case.biases:
    return "expert biases (no backend has a bias epilogue)"
  if case.rhs_format is not None:
    if case.rhs_format not in backend.quant_formats:
      return f"{backend.name} takes no {case.rhs_format} (BlockScaled) weights"
  elif case.rhs_dtype is not None and jnp.dtype(case.rhs_dtype) != jnp.dtype(case.dtype):
    return (
      f"{backend.name} needs lhs and rhs of one dtype, got {jnp.dtype(case.dtype)} and "
      f"{jnp.dtype(case.rhs_dtype)}"
    )
  return backend.unsupported_reason(case.dtype, case.activation, case.precision)


_DEVICE = object()  # `select_kernel`'s default: the default device's GPU


def select_kernel(case: Case, capability: str | object | None = _DEVICE) -> str | None:
  """The first kernel in `BACKENDS` made for the GPU of `capability` (default: the default
  device's; None: no GPU, where kernels are interpreted) that can run `case`, or None."""
  if capability is _DEVICE:
    capability = platform.gpu_compute_capability()
  for backend in BACKENDS.values():
    if backend.made_for(capability) and _reason(backend, case) is None:
      return backend.name
  return None


def no_kernel_reason(case: Case, capability: str | object | None = _DEVICE) -> str:
  """Why `select_kernel` finds no kernel: the reason of each kernel made for the device."""
  if capability is _DEVICE:
    capability = platform.gpu_compute_capability()
  reasons = [f"{b.name}: {_reason(b, case)}" for b in BACKENDS.values() if b.made_for(capability)]
  return "; ".join(reasons) or f"no kernel is made for GPU capability {capability}"
