"""The tensors of a local safetensors checkpoint (one file or sharded), read with NumPy.

No torch: safetensors' NumPy reader, and for the dtypes NumPy lacks (bfloat16, the fp8s) a
memory map of the raw bytes viewed as `ml_dtypes`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kernels_pallas.quantized import BlockScaled

# safetensors dtypes NumPy lacks (safetensors' NumPy reader fails on them): read raw.
_RAW_DTYPES = {
  "BF16": ml_dtypes.bfloat16,
  "F8_E4M3": ml_dtypes.float8_e4m3fn,
  "F8_E5M2": ml_dtypes.float8_e5m2,
  "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


class SafetensorsFiles(contextlib.ExitStack):
  """The tensors of a local safetensors checkpoint, single file or sharded, read lazily.

  A context manager: each file is opened once, on its first read, and closed on exit.
  `get` returns a fine-grained fp8 weight dequantized with its `…_scale_inv` (blocks of
  `fp8_block`, [out, in]); `get_raw` returns what the file holds.
  """

  def __init__(self, path: Path, fp8_block: tuple[int, int] | None = None, *, stem: str = "model"):
    super().__init__()
    self.fp8_block = fp8_block
    self._open: dict[Path, Any] = {}
    self._headers: dict[Path, dict] = {}
    index = path / f"{stem}.safetensors.index.json"
    if index.exists():
      weight_map = json.loads(index.read_text())["weight_map"]
      self.files = {key: path / name for key, name in weight_map.items()}
    elif (path / f"{stem}.safetensors").exists():
      single = path / f"{stem}.safetensors"
      self.files = dict.fromkeys(self._file(single).keys(), single)
    else:
      raise FileNotFoundError(f"{path} has neither {stem}.safetensors nor its index")

  def _file(self, path: Path):
    if path not in self._open:
      from safetensors import safe_open

      self._open[path] = self.enter_context(safe_open(path, "np"))
    return self._open[path]

  def __contains__(self, key: str) -> bool:
    return key in self.files

  def _header(self, path: Path) -> dict:
    """The safetensors header of a file: {key: {dtype, shape, data_offsets}}."""
    if path not in self._headers:
      with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        self._headers[path] = {"__size__": size, **json.loads(file.read(size))}
    return self._headers[path]

  def get_raw(self, key: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The tensor as stored (fp8 as ml_dtypes arrays, memory-mapped)."""
    if key not in self.files:
      near = sorted(k for k in self.files if k.startswith(key.rsplit(".", 2)[0]))[:5]
      raise KeyError(f"checkpoint has no tensor {key!r} (keys near it: {near})")
    path = self.files[key]
    header = self._header(path)
    info = header[key]
    if info["dtype"] in _RAW_DTYPES:
      start, end = info["data_offsets"]
      raw = np.memmap(path, np.uint8, "r", offset=8 + header["__size__"] + start, shape=end - start)
      value = raw.view(_RAW_DTYPES[info["dtype"]]).reshape(info["shape"])
    else:
      value = self._file(path).get_tensor(key)
    if shape is not None and value.shape != shape:
      raise ValueError(f"checkpoint tensor {key!r} has shape {value.shape}, expected {shape}")
    return value

  def get(self, key: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The tensor in float32; an fp8 weight with a `…_scale_inv` comes dequantized."""
    value = self.get_raw(key, shape)
    if f"{key}_scale_inv" not in self:
      return np.asarray(value, np.float32)
    if self.fp8_block is None:
      raise ValueError(f"{key} has a scale_inv but config.json has no weight_block_size")
    scales = np.asarray(self.get_raw(f"{key}_scale_inv"), np.float32)
    block = (self.fp8_block[1], self.fp8_block[0])  # as (in, out) of the transposed weight
    return np.asarray(BlockScaled(value.T, scales.T, block).dequantize(), np.float32).T
