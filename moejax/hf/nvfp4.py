"""NVFP4 checkpoints: NVIDIA ModelOpt's and compressed-tensors' `nvfp4-pack-quantized`.

Both store a linear layer's weight [out, in] as e2m1 codes two a byte along the input axis
(uint8 [out, in/2], the low nibble first), a float8_e4m3fn scale per 16 inputs ([out,
in/16]) and one float32 scale for the whole matrix; they differ in its name and sense:

- ModelOpt: `weight`, `weight_scale`, `weight_scale_2`: dequantized = codes * (scale *
  scale_2), `quantization_config` {quant_method: "modelopt", quant_algo: "NVFP4"}.
- compressed-tensors: `weight_packed`, `weight_scale`, `weight_global_scale` = g, the
  reciprocal: dequantized = codes * (scale / g).

moejax keeps the codes and the e4m3 scales as stored and the matrix scale as a multiplier
(`BlockScaled.global_scale`, once per column): ModelOpt's exactly, compressed-tensors' as
1 / g in float32 (its weights then agree with compressed-tensors' own dequantization to a
float32 rounding). Activation scales (`input_scale`, `input_global_scale`) are not read:
moejax computes in float (W4A16, as NVFP4 runs on GPUs without FP4 tensor cores).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from kernels_pallas.quantized import BlockScaled

GROUP = 16  # inputs per e4m3 scale


@dataclasses.dataclass(frozen=True)
class Nvfp4Names:
  """The tensor names of one NVFP4 convention, as suffixes of a linear layer's prefix.

  Attributes:
    codes: the packed uint8 codes [out, in/2].
    scales: the float8_e4m3fn scales [out, in/16].
    matrix_scale: the float32 scale of the matrix ([] or [1]).
    reciprocal: whether `matrix_scale` divides (compressed-tensors) rather than multiplies.
  """

  codes: str
  scales: str
  matrix_scale: str
  reciprocal: bool


MODELOPT = Nvfp4Names("weight", "weight_scale", "weight_scale_2", reciprocal=False)
COMPRESSED_TENSORS = Nvfp4Names(
  "weight_packed", "weight_scale", "weight_global_scale", reciprocal=True
)


def stored_names(files, layer: str) -> Nvfp4Names | None:
  """The convention the linear layer at `layer` (a key prefix) is stored in, or None when it
  is not NVFP4."""
  for names in (MODELOPT, COMPRESSED_TENSORS):
    if f"{layer}.{names.matrix_scale}" in files:
      return names
  return None


# e2m1 codes 0..15 (sign in bit 3) as the values they stand for.
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
  """uint8 [..., n] -> float4_e2m1fn [..., 2n]: value 2j is byte j's low nibble, 2j + 1 its
  high nibble.

  >>> unpack_fp4(np.array([[0x21, 0xF7]], np.uint8)).astype(float).tolist()
  [[0.5, 1.0, 6.0, -6.0]]
  """
  codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
  return _E2M1[codes].astype(ml_dtypes.float4_e2m1fn)


def read_nvfp4(files, layer: str, shape: tuple[int, int], names: Nvfp4Names) -> BlockScaled:
  """The NVFP4 weight [out, in] `shape` of the linear layer at `layer` as a `BlockScaled`
  [in, out]: values, scales [in/16, out] and global scale [out] as stored (its matrix
  scale as a multiplier)."""
  rows, cols = shape
  packed = np.asarray(files.get_raw(f"{layer}.{names.codes}", (rows, cols // 2)))
  scales = np.asarray(files.get_raw(f"{layer}.{names.scales}", (rows, cols // GROUP)))
  matrix_scale = np.asarray(files.get_raw(f"{layer}.{names.matrix_scale}"))
  expected = {
    names.codes: (packed.dtype, np.dtype(np.uint8)),
    names.scales: (scales.dtype, np.dtype(ml_dtypes.float8_e4m3fn)),
    names.matrix_scale: (matrix_scale.dtype, np.dtype(np.float32)),
  }
  for name, (got, want) in expected.items():
    if got != want:
      raise ValueError(f"{layer}.{name}: expected {want}, got {got}")
  if matrix_scale.size != 1:
    raise ValueError(f"{layer}.{names.matrix_scale}: expected one value, got {matrix_scale.shape}")
  multiplier = matrix_scale.reshape(())
  if names.reciprocal:
    multiplier = np.float32(1) / multiplier
  global_scale = np.full((rows,), multiplier, np.float32)
  return BlockScaled(unpack_fp4(packed).T, scales.T, (GROUP, 1), global_scale)


def modelopt_fields(quantization: dict) -> dict:
  """The `MoEConfig` fields of ModelOpt's `quantization_config` (NVFP4 weights in groups of
  16); ValueError naming any other field."""
  where = "quantization_config"
  algo = quantization.get("quant_algo")
  if algo != "NVFP4":
    raise ValueError(f"{where}.quant_algo={algo!r}: moejax reads ModelOpt's 'NVFP4'")
  groups = quantization.get("config_groups") or {}
  sizes = {f"{where}.group_size": quantization.get("group_size")}
  for name, group in groups.items():
    sizes[f"{where}.config_groups.{name}.weights.group_size"] = (group.get("weights") or {}).get(
      "group_size"
    )
  for field, size in sizes.items():
    if size not in (None, GROUP):
      raise ValueError(f"{field}={size!r}, expected {GROUP} (NVFP4's scale group)")
  return dict(expert_quant="nvfp4")


# compressed-tensors' weight quantization that "nvfp4" is, field by field.
COMPRESSED_TENSORS_WEIGHTS = dict(
  num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=GROUP
)
