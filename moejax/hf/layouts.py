"""How families store their routed experts in safetensors files (`PerExpert` linear layers,
`Fused` 3-D tensors, DBRX's `Flat` ones, Step's `Stacked` ones, Doge's `Neurons`), float or
quantized, and the readers of each format's tensors; every reader returns moejax's layout
([in, out]) on the host."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable

import jax
import ml_dtypes
import numpy as np

from kernels_pallas.quantized import BlockScaled
from moejax.config import MoEConfig
from moejax.hf import nvfp4
from moejax.hf.safetensors_files import SafetensorsFiles


def halves(gate_up: np.ndarray, interleaved: bool) -> np.ndarray:
  """[..., 2F] with gate then up halves (de-interleaving GPT-OSS's alternating columns)."""
  if not interleaved:
    return gate_up
  return np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], axis=-1)


class Layout(abc.ABC):
  """How a family stores its routed experts. Each read returns moejax's tensors ([in, out]):
  `w_gate_up` [E, D, 2F], `w_down` [E, F, D] (and biases), float32 or `BlockScaled`; `key`
  turns a name relative to the MoE block into the checkpoint's key."""

  @abc.abstractmethod
  def present(self, files: SafetensorsFiles, key: Callable[[str], str]) -> bool:
    """Whether the layer's experts are stored this way."""

  @abc.abstractmethod
  def floats(self, files: SafetensorsFiles, key, e: int, d: int, f: int) -> dict:
    """Float experts (fp8 ones with a `…_scale_inv` dequantized), float32."""

  def read(
    self,
    files: SafetensorsFiles,
    key,
    expert_quant: str | None,
    e: int,
    d: int,
    f: int,
    block: tuple[int, int],
  ) -> dict:
    """The experts in `expert_quant`'s format (`BlockScaled` of `block`), float for None:
    the method of the format's name, which a layout that stores the format defines."""
    if expert_quant is None:
      return self.floats(files, key, e, d, f)
    reader = getattr(self, expert_quant, None)
    if reader is None:
      raise NotImplementedError(f"{expert_quant} experts stored as {self} are not read")
    return reader(files, key, e, d, f, block)


def _read_fp8(files: SafetensorsFiles, weight: str, shape: tuple[int, ...], block):
  """(values, scales) of an fp8 `weight` [..., out, in] as [..., in, out] and its blocks;
  scales stored as e8m0 (`scale_fmt: "ue8m0"` checkpoints may) widen to float32 (exact)."""
  *lead, rows, cols = shape
  scales_shape = (*lead, -(-rows // block[1]), -(-cols // block[0]))
  values = np.asarray(files.get_raw(weight, shape))
  scales = np.asarray(files.get_raw(f"{weight}_scale_inv", scales_shape))
  if scales.dtype == ml_dtypes.float8_e8m0fnu:
    scales = scales.astype(np.float32)
  if values.dtype != ml_dtypes.float8_e4m3fn or scales.dtype != np.float32:
    raise ValueError(
      f"{weight}: expected float8_e4m3fn values with float32 scale_inv, got "
      f"{values.dtype} and {scales.dtype}"
    )
  return np.swapaxes(values, -1, -2), np.swapaxes(scales, -1, -2)


def unpack_int4(packed: np.ndarray, columns: int) -> np.ndarray:
  """compressed-tensors' pack-quantized int32 words [..., n] -> int4 [..., columns]: value i
  of a row is nibble i (low nibble first, little-endian words) minus 8.

  >>> unpack_int4(np.array([[0x0000_00F8]], np.uint32).view(np.int32), 2).astype(int).tolist()
  [[0, 7]]
  """
  data = np.ascontiguousarray(packed).astype("<i4").view(np.uint8)
  nibbles = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
  return (nibbles[..., :columns].astype(np.int8) - 8).astype(ml_dtypes.int4)


def _read_int4(files: SafetensorsFiles, weight: str, shape: tuple[int, int], group: int):
  """A pack-quantized `weight` [out, in] (`…_packed` int32 [out, in/8], `…_scale` [out,
  in/group], `…_shape`) as a `BlockScaled` [in, out] with scales [in/group, out]."""
  rows, cols = shape
  stored_shape = tuple(int(n) for n in np.asarray(files.get_raw(f"{weight}_shape")))
  if stored_shape != shape:
    raise ValueError(f"{weight}_shape is {stored_shape}, expected {shape}")
  packed = np.asarray(files.get_raw(f"{weight}_packed", (rows, -(-cols // 8))))
  scales = np.asarray(files.get_raw(f"{weight}_scale", (rows, cols // group)))
  if packed.dtype != np.int32:
    raise ValueError(f"{weight}_packed: expected int32 words, got {packed.dtype}")
  if scales.dtype != ml_dtypes.bfloat16:
    scales = scales.astype(np.float32)  # float16 or float32: exact in float32
  return BlockScaled(unpack_int4(packed, cols).T, scales.T, (group, 1))


@dataclasses.dataclass(frozen=True)
class PerExpert(Layout):
  """One linear layer per expert and projection, `experts.{e}.{name}.weight` [out, in];
  `expert_block` b: the layer's E experts are those numbered from b * E (ERNIE-4.5-VL's
  vision experts, 1, follow its text experts, 0)."""

  gate: str = "gate_proj"
  up: str = "up_proj"
  down: str = "down_proj"
  expert_block: int = 0

  def _numbers(self, e: int) -> range:
    """The stored numbers of the layer's e experts."""
    return range(self.expert_block * e, (self.expert_block + 1) * e)

  def _layer(self, e: int, name: str) -> str:
    return f"experts.{e}.{name}"

  def _weight(self, e: int, name: str) -> str:
    return f"{self._layer(e, name)}.weight"

  def present(self, files, key) -> bool:
    return key(self._weight(0, self.gate)) in files

  def floats(self, files, key, e, d, f) -> dict:
    weight = lambda i, name, shape: files.get(key(self._weight(i, name)), shape).T
    gate_up = lambda i: np.concatenate(
      [weight(i, self.gate, (f, d)), weight(i, self.up, (f, d))], 1
    )
    return {
      "w_gate_up": np.stack([gate_up(i) for i in self._numbers(e)]),
      "w_down": np.stack([weight(i, self.down, (d, f)) for i in self._numbers(e)]),
    }

  def fp8_block(self, files, key, e, d, f, block) -> dict:
    read = lambda layer, shape: BlockScaled(
      *_read_fp8(files, f"{layer}.weight", shape, block), block
    )
    return self._quantized(read, key, e, d, f)

  def int4_group(self, files, key, e, d, f, block) -> dict:
    read = lambda layer, shape: _read_int4(files, f"{layer}.weight", shape, block[0])
    return self._quantized(read, key, e, d, f)

  def nvfp4(self, files, key, e, d, f, block) -> dict:
    def read(layer: str, shape: tuple[int, int]) -> BlockScaled:
      names = nvfp4.stored_names(files, layer)
      if names is None:
        raise KeyError(
          f"checkpoint has no NVFP4 matrix scale at {layer} (ModelOpt's "
          f"{nvfp4.MODELOPT.matrix_scale!r} or compressed-tensors' "
          f"{nvfp4.COMPRESSED_TENSORS.matrix_scale!r})"
        )
      return nvfp4.read_nvfp4(files, layer, shape, names)

    return self._quantized(read, key, e, d, f)

  def _quantized(self, read, key, e: int, d: int, f: int) -> dict:
    """`w_gate_up` and `w_down` of `BlockScaled` matrices `read(layer, [out, in])` gives,
    one per expert and projection ([in, out]; gate and up side by side)."""
    matrices = lambda name, shape: [
      read(key(self._layer(i, name)), shape) for i in self._numbers(e)
    ]
    gate_up = [
      _on_host(np.concatenate, g, u, axis=-1)
      for g, u in zip(matrices(self.gate, (f, d)), matrices(self.up, (f, d)), strict=True)
    ]
    down = matrices(self.down, (d, f))
    return {"w_gate_up": _on_host(np.stack, *gate_up), "w_down": _on_host(np.stack, *down)}


def _on_host(join, *matrices: BlockScaled, **kwargs) -> BlockScaled:
  """`join` (np.concatenate, np.stack) of the matrices' leaves, leaf by leaf, in host memory
  (a checkpoint's experts pass no device on their way)."""
  return jax.tree.map(
    lambda *leaves: join([np.asarray(leaf) for leaf in leaves], **kwargs), *matrices
  )


@dataclasses.dataclass(frozen=True)
class Fused(Layout):
  """3-D tensors of all experts: `gate_up` [E, 2F, D] and `down` [E, D, F] (transformers'
  [E, out, in]; [E, in, out] with `input_major`), gate and up as halves or, `interleaved`,
  alternating columns (GPT-OSS); biases at `{gate_up}_bias` and `{down}_bias` if stored."""

  gate_up: str = "experts.gate_up_proj"
  down: str = "experts.down_proj"
  input_major: bool = False
  interleaved: bool = False
  marked_transposed: bool = False  # transformers marks the module `is_transposed` (PEFT reads)

  def present(self, files, key) -> bool:
    return key(self.gate_up) in files or key(f"{self.gate_up}_blocks") in files

  def floats(self, files, key, e, d, f) -> dict:
    gate_up, down = files.get(key(self.gate_up))[:e], files.get(key(self.down))[:e]
    if not self.input_major:
      gate_up, down = gate_up.transpose(0, 2, 1), down.transpose(0, 2, 1)
    if gate_up.shape != (e, d, 2 * f) or down.shape != (e, f, d):
      raise ValueError(
        f"{key('experts')}: fused gate_up {gate_up.shape} / down {down.shape}, expected "
        f"{(e, d, 2 * f)} / {(e, f, d)}"
      )
    biases = self._biases(files, key, e)
    return {"w_gate_up": halves(gate_up, self.interleaved), "w_down": down, **biases}

  def _biases(self, files, key, e: int) -> dict:
    if key(f"{self.gate_up}_bias") not in files:
      return {}
    return {
      "b_gate_up": halves(files.get(key(f"{self.gate_up}_bias"))[:e], self.interleaved),
      "b_down": files.get(key(f"{self.down}_bias"))[:e],
    }

  def fp8_block(self, files, key, e, d, f, block) -> dict:
    if self.input_major or self.interleaved:
      raise NotImplementedError(f"fp8_block experts stored as {self} are not read")
    return {
      "w_gate_up": BlockScaled(*_read_fp8(files, key(self.gate_up), (e, 2 * f, d), block), block),
      "w_down": BlockScaled(*_read_fp8(files, key(self.down), (e, d, f), block), block),
    }

  def mxfp4(self, files, key, e, d, f, block) -> dict:
    """GPT-OSS's MXFP4: `{name}_blocks` [E, out, in/32, 16] uint8 and `{name}_scales`
    [E, out, in/32] e8m0, as `BlockScaled` [E, in, out] with scales [E, in/32, out]."""

    def matrix(name: str, rows: int, cols: int) -> BlockScaled:
      blocks = files.get_raw(key(f"{name}_blocks"), (e, rows, cols // 32, 16))
      scales = files.get_raw(key(f"{name}_scales"), (e, rows, cols // 32))
      values = unpack_mxfp4(np.asarray(blocks)).transpose(0, 2, 1)
      scales = np.asarray(scales).view(ml_dtypes.float8_e8m0fnu).transpose(0, 2, 1)
      return BlockScaled(values, scales, (32, 1))

    gate_up = matrix(self.gate_up, 2 * f, d)
    split = lambda a: halves(a, self.interleaved)
    return {
      "w_gate_up": BlockScaled(split(gate_up.values), split(gate_up.scales), gate_up.block),
      "w_down": matrix(self.down, d, f),
      **self._biases(files, key, e),
    }


@dataclasses.dataclass(frozen=True)
class Flat(Layout):
  """DBRX: (gate, up, down) tensors of [E * F, D] each (down stored transposed)."""

  gate: str
  up: str
  down: str

  def present(self, files, key) -> bool:
    return key(self.gate) in files

  def floats(self, files, key, e, d, f) -> dict:
    gate, up, down = (files.get(key(name), (e * f, d)) for name in (self.gate, self.up, self.down))
    gate_up = np.concatenate([gate.reshape(e, f, d), up.reshape(e, f, d)], axis=1)
    return {"w_gate_up": gate_up.transpose(0, 2, 1), "w_down": down.reshape(e, f, d)}


@dataclasses.dataclass(frozen=True)
class Stacked(Layout):
  """Step-3.5's and Step-3.7's: each projection of all experts as one tensor, `gate` and `up`
  [E, F, D], `down` [E, D, F] (transformers' [E, out, in])."""

  gate: str = "gate_proj.weight"
  up: str = "up_proj.weight"
  down: str = "down_proj.weight"

  def present(self, files, key) -> bool:
    return key(self.gate) in files

  def floats(self, files, key, e, d, f) -> dict:
    gate, up = (files.get(key(name), (e, f, d)) for name in (self.gate, self.up))
    down = files.get(key(self.down), (e, d, f))
    gate_up = np.concatenate([gate, up], axis=1)
    return {"w_gate_up": gate_up.transpose(0, 2, 1), "w_down": down.transpose(0, 2, 1)}


@dataclasses.dataclass(frozen=True)
class Neurons(Layout):
  """Doge's single-neuron experts: embeddings `down` [E', D] and `up` [E', D], expert e
  computing act(x . down_e) * up_e; its product keys reach the first E rows (E' may be more).
  They load as gated experts of F = 1 whose up projection is the constant 1 (weight 0, bias
  1), so act(gate) * up = act(x . down_e), and whose down projection is up_e (bias 0)."""

  down: str = "down_embed.weight"
  up: str = "up_embed.weight"

  def present(self, files, key) -> bool:
    return key(self.down) in files

  def floats(self, files, key, e, d, f) -> dict:
    if f != 1:
      raise ValueError(f"{key(self.down)}: single-neuron experts have intermediate_size 1, got {f}")
    down, up = (_leading_rows(files, key(name), e, d) for name in (self.down, self.up))
    return {
      "w_gate_up": np.stack([down, np.zeros_like(down)], axis=-1),  # [E, D, 2]
      "w_down": up[:, None, :],  # [E, 1, D]
      "b_gate_up": np.tile(np.array([0.0, 1.0], np.float32), (e, 1)),
      "b_down": np.zeros((e, d), np.float32),
    }


def _leading_rows(files: SafetensorsFiles, key: str, rows: int, cols: int) -> np.ndarray:
  """The first `rows` rows of a stored [>= rows, cols] tensor."""
  value = files.get(key)
  if value.ndim != 2 or value.shape[0] < rows or value.shape[1] != cols:
    raise ValueError(f"{key} has shape {value.shape}, expected [>= {rows}, {cols}]")
  return value[:rows]


def float_linear(files: SafetensorsFiles, weight: str, shape, config: MoEConfig) -> np.ndarray:
  """A linear layer's [out, in] weight in float32: as stored, fp8 dequantized with its
  `scale_inv`, or a pack-quantized INT4 or an NVFP4 one (a checkpoint that quantizes it: its
  `ignore` list does not name it) dequantized."""
  layer = weight.removesuffix(".weight")
  names = nvfp4.stored_names(files, layer)
  if names is not None:
    return np.asarray(nvfp4.read_nvfp4(files, layer, shape, names).dequantize()).T
  if weight not in files and f"{weight}_packed" in files:
    return np.asarray(_read_int4(files, weight, shape, config.quant_block[0]).dequantize()).T
  return files.get(weight, shape)


def unpack_mxfp4(blocks: np.ndarray) -> np.ndarray:
  """[..., n, 16] uint8 -> [..., 32 n] float4_e2m1fn: value 2j of each block is byte j's low
  nibble, 2j + 1 its high nibble (GPT-OSS's `*_blocks`).

  >>> unpack_mxfp4(np.array([[0x21, 0xF7] + [0] * 14], np.uint8)).astype(float)[:4].tolist()
  [0.5, 1.0, 6.0, -6.0]
  """
  return nvfp4.unpack_fp4(blocks).reshape(*blocks.shape[:-2], -1)
