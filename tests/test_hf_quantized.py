"""Quantized Hugging Face checkpoints as released, one contract for every format: DeepSeek-V3's
fine-grained fp8 (per expert, or fused as transformers saves it), GPT-OSS's MXFP4, Kimi-K2's
INT4 (compressed-tensors pack-quantized; K2.5 nested) and NVIDIA's NVFP4 (ModelOpt and
compressed-tensors), each written in NumPy in its real key names and layouts
(`tests/hf_checkpoints.py`). Each format's own conventions follow its contract: fp8's
`scale_fmt`, the NumPy family blocks, and, with the `hf` extra, transformers' and
compressed-tensors' own dequantization, packing and rounding."""

import dataclasses
import importlib.util
import json

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from moejax import hf, moe_apply, quant, reference_moe
from moejax.hf.nvfp4 import COMPRESSED_TENSORS, MODELOPT
from moejax.stacking import layer_of
from moejax.testing import poison
from tests.helpers import mesh_of, seed_of, tolerance
from tests.hf_checkpoints import (
  DEEPSEEK,
  E2M1,
  FP8_BLOCK,
  INT4_GROUP,
  INT4_WEIGHTS,
  KIMI,
  LAYER,
  MODELOPT_CONFIG,
  NVFP4_WEIGHTS,
  T,
  deepseek_block,
  deepseek_fp8_checkpoint,
  gpt_oss_block,
  gpt_oss_mxfp4_checkpoint,
  int4_quantization_config,
  kimi_checkpoint,
  nvfp4_checkpoint,
  nvfp4_linear,
  nvfp4_quantization_config,
  pack_int4,
  save_raw_or_numpy,
)

_HF_MISSING = not all(
  importlib.util.find_spec(m) for m in ("torch", "transformers", "compressed_tensors")
)


def needs_hf(test):
  """Marks a test that compares with transformers: skipped without the hf extra, and in the
  `extras` tier (CI runs it where the extra is installed)."""
  skip = pytest.mark.skipif(
    _HF_MISSING, reason="needs the hf extra (torch, transformers, compressed-tensors)"
  )
  return pytest.mark.extras(skip(test))


def pytest_generate_tests(metafunc):
  """Each contract test once per checkpoint case (`CASES`) or unreadable config
  (`UNREADABLE`) of its class."""
  cls = metafunc.cls
  if cls is not None and "case" in metafunc.fixturenames:
    metafunc.parametrize("case", cls.CASES, ids=[case or cls.FORMAT for case in cls.CASES])
  if cls is not None and "unreadable" in metafunc.fixturenames:
    ids = [name for name, *_ in cls.UNREADABLE]
    metafunc.parametrize("unreadable", [case for _, *case in cls.UNREADABLE], ids=ids)


class QuantizedCheckpointContract:
  """What every quantized format's checkpoint must give: a config that names the format and
  its block, experts loaded as stored (the format's dtypes, never dequantized; on a mesh,
  split over the expert axis), each expert's matrices dequantizing to the weights the stored
  tensors stand for, and the layer on the 2x4 mesh (its padding NaN) matching the reference
  on the dequantized layer. A subclass writes its format's checkpoints (`write`, one per
  `CASES`) and says where an expert's float weights are (`expert_floats`)."""

  FORMAT: str
  BLOCK: tuple[int, int]
  DTYPES: tuple  # (values, scales)
  CASES: tuple[str, ...] = ("",)
  EXACT = (0, 0)  # (rtol, atol) of the loaded weights, dequantized, against the stored ones

  def write(self, path, seed: int, case: str) -> tuple[dict, dict]:
    """Writes a checkpoint of `case` at `path`; returns its config.json dict and the float
    tensors its stored ones stand for."""
    raise NotImplementedError

  def expert_floats(self, floats: dict, expert: int) -> tuple[np.ndarray, np.ndarray]:
    """An expert's (w_gate_up [D, 2F], w_down [F, D]) as the stored tensors stand for them."""
    raise NotImplementedError

  def test_loads_as_stored_and_runs_like_the_reference(self, case, tmp_path, request):
    seed = seed_of(request.node.name)
    hf_config, floats = self.write(tmp_path, seed, case)
    config = hf.config_from_hf(hf_config, chunk_size=8)
    assert (config.expert_quant, config.quant_block) == (self.FORMAT, self.BLOCK)
    params = hf.load_layer(tmp_path, LAYER, config, mesh=mesh_of(2, 4))
    w = params.w_gate_up
    assert (w.values.dtype, w.scales.dtype) == self.DTYPES
    assert w.scales.sharding.spec[0] == "expert"
    rtol, atol = self.EXACT
    for expert in (2, 5):
      loaded = (w[expert].dequantize(), params.w_down[expert].dequantize())
      chex.assert_trees_all_close(loaded, self.expert_floats(floats, expert), rtol=rtol, atol=atol)
    stack = hf.load_stack(tmp_path, config, layers=(LAYER, LAYER), mesh=mesh_of(2, 4))
    assert stack.w_gate_up.values.shape == (2, *w.values.shape)
    assert stack.w_gate_up.scales.sharding.spec[:2] == (None, "expert")
    chex.assert_trees_all_equal(
      jax.tree.map(np.asarray, layer_of(stack, 1)), jax.tree.map(np.asarray, params)
    )
    dequantized = hf.load_layer(tmp_path, LAYER, config, dequantize=True)
    x = jax.random.normal(jax.random.key(seed), (40, config.hidden_size))
    mask = jax.random.bernoulli(jax.random.key(seed + 1), 0.8, (40,))
    y, _ = moe_apply(params, poison(x, mask), config=config, mesh=mesh_of(2, 4), token_mask=mask)
    expected = reference_moe(dequantized, x, dataclasses.replace(config, expert_quant=None), mask)
    chex.assert_trees_all_close(y, expected, **tolerance())


class RejectsWhatItCannotRead:
  """A format's `quantization_config`s moejax cannot read raise ValueError naming the field."""

  UNREADABLE: tuple[tuple[str, dict, str], ...]  # (id, quantization_config, error pattern)

  def test_configs_moejax_cannot_read_name_the_field(self, unreadable):
    quantization, match = unreadable
    with pytest.raises(ValueError, match=match):
      hf.config_from_hf(dict(model_type="deepseek_v3", quantization_config=quantization, **KIMI))


def _fused_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
  """[out, in] gate and up linears -> the layer's [in, 2 out] w_gate_up."""
  return np.concatenate([gate.T, up.T], axis=1)


class TestDeepSeekFp8(QuantizedCheckpointContract, RejectsWhatItCannotRead):
  FORMAT, BLOCK = "fp8_block", (8, 4)
  DTYPES = (jnp.float8_e4m3fn, jnp.float32)
  CASES = ("per_expert", "fused")
  EXACT = (0, 1e-7)  # float64 dequantized in NumPy, float32 here
  UNREADABLE = (
    (
      "scale format",
      {"quant_method": "fp8", "weight_block_size": [4, 8], "scale_fmt": "e4m3"},
      r"scale_fmt='e4m3': moejax reads fp8",
    ),
  )

  def write(self, path, seed, case):
    hf_config, _, get = deepseek_fp8_checkpoint(path, seed, fused=case == "fused")
    return hf_config, get

  def expert_floats(self, get, expert):
    linear = lambda name: get(f"experts.{expert}.{name}.weight")
    return _fused_gate_up(linear("gate_proj"), linear("up_proj")), linear("down_proj").T

  def test_config_block_and_numpy_block(self, tmp_path, request):
    """The block is read [in, out] from DeepSeek's [out, in] `weight_block_size`; a method
    moejax does not read is named; the layer on one device matches the NumPy DeepSeek block
    on the stored weights."""
    fields = {"model_type": "deepseek_v3", "hidden_size": 128,
              **{**DEEPSEEK, "moe_intermediate_size": 128}}  # fmt: skip
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    assert hf.config_from_hf({**fields, "quantization_config": fp8}).quant_block == (64, 128)
    with pytest.raises(NotImplementedError, match="quant_method='awq'"):
      hf.config_from_hf({**fields, "quantization_config": {"quant_method": "awq"}})
    hf_config, _, get = deepseek_fp8_checkpoint(tmp_path, seed_of(request.node.name))
    config = hf.config_from_hf(hf_config, chunk_size=5)
    params = hf.load_layer(tmp_path, LAYER, config)
    x = np.random.default_rng(1).standard_normal((T, 16)).astype(np.float32)
    expected = deepseek_block(x.astype(np.float64), get, hf_config, biased=True)
    y, _ = moe_apply(params, jnp.asarray(x), config=config)
    chex.assert_trees_all_close(y, expected.astype(np.float32), **tolerance())

  def test_ue8m0_scales_are_checked(self, tmp_path, request):
    """`scale_fmt: "ue8m0"` (DeepSeek-V3.1 and later): powers of two load, stored as float32
    or as e8m0; others raise."""
    hf_config, stored, _ = deepseek_fp8_checkpoint(tmp_path, seed_of(request.node.name))
    hf_config["quantization_config"]["scale_fmt"] = "ue8m0"
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    config = hf.config_from_hf(hf_config)
    with pytest.raises(ValueError, match="w_gate_up's scales are not all powers of two"):
      hf.load_layer(tmp_path, LAYER, config)
    powers = {
      k: (2.0 ** np.ceil(np.log2(v))).astype(np.float32) if k.endswith("_scale_inv") else v
      for k, v in stored.items()
    }
    save_file(
      {f"model.layers.{LAYER}.mlp.{k}": v for k, v in powers.items()},
      str(tmp_path / "model.safetensors"),
    )
    params = hf.load_layer(tmp_path, LAYER, config)
    assert np.all(np.frexp(np.asarray(params.w_down.scales))[0] == 0.5)
    e8m0 = {
      k: v.astype(ml_dtypes.float8_e8m0fnu) if k.endswith("_scale_inv") else v
      for k, v in powers.items()
    }
    save_raw_or_numpy({f"model.layers.{LAYER}.mlp.{k}": v for k, v in e8m0.items()}, tmp_path)
    chex.assert_trees_all_equal(hf.load_layer(tmp_path, LAYER, config), params)

  @pytest.mark.slow
  @needs_hf
  def test_dequantization_matches_transformers(self, tmp_path, request):
    """The loaded blocks, dequantized, equal transformers' fine-grained fp8 dequantization
    of the fused tensors as stored ([E, out, in], block [out, in])."""
    import torch
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    hf_config, stored, _ = deepseek_fp8_checkpoint(tmp_path, seed_of(request.node.name), fused=True)
    params = hf.load_layer(tmp_path, LAYER, hf.config_from_hf(hf_config))
    theirs = lambda name: _dequantize_fp8_weight(
      torch.from_numpy(stored[name].view(np.uint8)).view(torch.float8_e4m3fn),
      torch.from_numpy(stored[f"{name}_scale_inv"]),
      FP8_BLOCK,
      torch.float32,
    ).numpy()
    ours = lambda w: np.swapaxes(np.asarray(w.dequantize()), -1, -2)
    chex.assert_trees_all_equal(ours(params.w_gate_up), theirs("experts.gate_up_proj"))
    chex.assert_trees_all_equal(ours(params.w_down), theirs("experts.down_proj"))


class TestGptOssMxfp4(QuantizedCheckpointContract):
  FORMAT, BLOCK = "mxfp4", (32, 1)
  DTYPES = (jnp.float4_e2m1fn, jnp.float8_e8m0fnu)

  def write(self, path, seed, case):
    hf_config, _, floats = gpt_oss_mxfp4_checkpoint(path, seed)
    return hf_config, floats

  def expert_floats(self, floats, expert):
    gate_up = floats["experts.gate_up_proj"][expert]  # [in, out], gate and up interleaved
    return np.concatenate([gate_up[:, 0::2], gate_up[:, 1::2]], 1), floats["experts.down_proj"][
      expert
    ]

  def test_matches_the_numpy_block(self, tmp_path, request):
    """On one device, the NumPy GPT-OSS block (biases, clamped SwiGLU) on the stored weights."""
    hf_config, _, floats = gpt_oss_mxfp4_checkpoint(tmp_path, seed_of(request.node.name))
    config = hf.config_from_hf(hf_config, chunk_size=5)
    params = hf.load_layer(tmp_path, LAYER, config)
    x = np.random.default_rng(1).standard_normal((T, config.hidden_size)).astype(np.float32)
    expected = gpt_oss_block(x.astype(np.float64), floats.__getitem__, hf_config)
    y, _ = moe_apply(params, jnp.asarray(x), config=config)
    chex.assert_trees_all_close(y, expected.astype(np.float32), **tolerance())

  @pytest.mark.slow
  @needs_hf
  def test_unpacking_matches_transformers(self, tmp_path, request):
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, stored, _ = gpt_oss_mxfp4_checkpoint(tmp_path, seed_of(request.node.name))
    params = hf.load_layer(tmp_path, LAYER, hf.config_from_hf(json.loads(
      (tmp_path / "config.json").read_text())), dequantize=True)  # fmt: skip
    theirs = lambda name: convert_moe_packed_tensors(
      torch.from_numpy(stored[f"experts.{name}_blocks"]),
      torch.from_numpy(stored[f"experts.{name}_scales"]),
      dtype=torch.float32,
    ).numpy()  # [E, in, out], gate/up interleaved
    gate_up = theirs("gate_up_proj")
    chex.assert_trees_all_equal(
      np.asarray(params.w_gate_up), np.concatenate([gate_up[..., 0::2], gate_up[..., 1::2]], -1)
    )
    chex.assert_trees_all_equal(np.asarray(params.w_down), theirs("down_proj"))


def _bad_int4_format() -> dict:
  quantization = int4_quantization_config()
  quantization["format"] = quantization["config_groups"]["group_0"]["format"] = "float-quantized"
  return quantization


class TestKimiInt4(QuantizedCheckpointContract, RejectsWhatItCannotRead):
  FORMAT, BLOCK = "int4_group", (INT4_GROUP, 1)
  DTYPES = (jnp.int4, jnp.bfloat16)
  CASES = ("kimi_k2", "kimi_k25")
  UNREADABLE = (
    ("format", _bad_int4_format(), r"format='float-quantized'"),
    ("bits", int4_quantization_config(num_bits=8), r"weights\.num_bits=8, expected 4"),
    ("asymmetric", int4_quantization_config(symmetric=False), r"symmetric=False.*zero points"),
    ("actorder", int4_quantization_config(actorder="group"), r"actorder='group' \(a per-input"),
    ("group size", int4_quantization_config(group_size=16), r"group_size=16, expected one of"),
  )

  def write(self, path, seed, case):
    return kimi_checkpoint(path, seed, nested=case == "kimi_k25")

  def expert_floats(self, floats, expert):
    linear = lambda name: floats[f"experts.{expert}.{name}.weight"]
    return _fused_gate_up(linear("gate_proj"), linear("up_proj")), linear("down_proj").T

  @pytest.mark.slow
  @needs_hf
  def test_packing_and_rounding_are_compressed_tensors_own(self, request):
    """Our unpacking of compressed-tensors' `pack_to_int32`, its unpacking of our NumPy
    packing, and `quant.quantize`'s int4_group against its symmetric group quantization: bit
    for bit."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import (
      pack_to_int32,
      unpack_from_int32,
    )
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    rng = np.random.default_rng(seed_of(request.node.name))
    values = rng.integers(-8, 8, (24, 64)).astype(np.int8)
    theirs = pack_to_int32(torch.from_numpy(values), 4).numpy()
    chex.assert_trees_all_equal(theirs, pack_int4(values))
    chex.assert_trees_all_equal(hf.unpack_int4(theirs, 64).astype(np.int8), values)
    unpacked = unpack_from_int32(torch.from_numpy(pack_int4(values)), 4, torch.Size(values.shape))
    chex.assert_trees_all_equal(unpacked.numpy(), values)

    w = (rng.standard_normal((48, 64)) * 0.05).astype(np.float32)  # [out, in]
    args = QuantizationArgs(**{**INT4_WEIGHTS, "scale_dtype": torch.bfloat16})
    groups = torch.from_numpy(w).reshape(48, 2, INT4_GROUP)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    codes = quantize(torch.from_numpy(w), scale.float(), zero, args, dtype=torch.int8)
    ours = quant.quantize(jnp.asarray(w.T), "int4_group", (INT4_GROUP, 1))
    chex.assert_trees_all_equal(np.asarray(ours.values).astype(np.int8).T, codes.numpy())
    chex.assert_trees_all_equal(
      np.asarray(ours.scales).T.view(np.uint16),
      scale.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
    )


class TestNvfp4(QuantizedCheckpointContract, RejectsWhatItCannotRead):
  """The codes and e4m3 scales load as stored, gate's and up's matrix scales each on its own
  columns; the weights are the convention's own dequantization (ModelOpt's exactly,
  compressed-tensors' division to a float32 rounding)."""

  FORMAT, BLOCK = "nvfp4", (16, 1)
  DTYPES = (jnp.float4_e2m1fn, jnp.float8_e4m3fn)
  CASES = ("modelopt", "compressed-tensors")
  EXACT = (2.4e-7, 0)  # compressed-tensors divides by g, moejax multiplies by 1 / g
  UNREADABLE = (
    ("modelopt algo", {**MODELOPT_CONFIG, "quant_algo": "FP8"}, r"quant_algo='FP8': moejax"),
    ("modelopt group", {**MODELOPT_CONFIG, "group_size": 32}, r"group_size=32, expected 16"),
    ("strategy", nvfp4_quantization_config(strategy="group"), r"strategy='group', expected"),
    ("group size", nvfp4_quantization_config(group_size=32), r"group_size=32, expected 16"),
  )

  def write(self, path, seed, case):
    if case == "modelopt":
      return nvfp4_checkpoint(path, seed, MODELOPT, MODELOPT_CONFIG)
    return nvfp4_checkpoint(path, seed, COMPRESSED_TENSORS, nvfp4_quantization_config())

  def expert_floats(self, floats, expert):
    linear = lambda name: floats[f"experts.{expert}.{name}"]
    return _fused_gate_up(linear("gate_proj"), linear("up_proj")), linear("down_proj").T

  def test_matrix_scales_and_dequantized_shared_experts(self, tmp_path, request):
    """The float32 matrix scale is kept per column (each half of [gate | up] its own) and
    split over the expert axis; shared experts load dequantized."""
    _, floats = self.write(tmp_path, seed_of(request.node.name), "modelopt")
    params = hf.load_layer(tmp_path, LAYER, mesh=mesh_of(2, 4))
    assert params.w_gate_up.global_scale.dtype == jnp.float32
    assert params.w_gate_up.global_scale.sharding.spec[0] == "expert"
    chex.assert_trees_all_equal(
      np.asarray(params.shared_w_down), floats["shared_experts.down_proj"].T
    )

  def test_a_layer_without_its_matrix_scale_names_both_conventions(self, tmp_path):
    nvfp4_checkpoint(
      tmp_path, 0, MODELOPT, MODELOPT_CONFIG, drop="experts.3.up_proj.weight_scale_2"
    )
    match = (
      r"no NVFP4 matrix scale at model\.layers\.2\.mlp\.experts\.3\.up_proj .*'weight_scale_2'"
    )
    with pytest.raises(KeyError, match=match):
      hf.load_layer(tmp_path, LAYER)

  @pytest.mark.slow
  @needs_hf
  def test_packing_dequantization_and_rounding_are_compressed_tensors_own(self, tmp_path, request):
    """compressed-tensors' packing of codes and our unpacking of it, its dequantization of a
    stored matrix against ours (to a float32 rounding: it divides by g, we multiply by 1 / g),
    and `quant.quantize`'s nvfp4 against its tensor_group quantization: codes, e4m3 scales and
    global scale bit for bit."""
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import (
      pack_fp4_to_uint8,
      unpack_fp4_from_uint8,
    )
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    from moejax.hf.nvfp4 import read_nvfp4, unpack_fp4
    from moejax.hf.safetensors_files import SafetensorsFiles

    rng = np.random.default_rng(seed_of(request.node.name))
    codes = rng.integers(0, 16, (24, 64)).astype(np.uint8)
    theirs = pack_fp4_to_uint8(torch.from_numpy(E2M1[codes]))
    chex.assert_trees_all_equal(unpack_fp4(theirs.numpy()).astype(np.float32), E2M1[codes])
    unpacked = unpack_fp4_from_uint8(theirs, 24, 64, dtype=torch.float32)
    chex.assert_trees_all_equal(unpacked.numpy(), E2M1[codes])

    args = QuantizationArgs(**NVFP4_WEIGHTS, scale_dtype=torch.float8_e4m3fn)
    stored, _ = nvfp4_linear(rng, 48, 64, COMPRESSED_TENSORS)
    save_raw_or_numpy({f"w.{k}": v for k, v in stored.items()}, tmp_path)
    with SafetensorsFiles(tmp_path) as files:
      ours = np.asarray(read_nvfp4(files, "w", (48, 64), COMPRESSED_TENSORS).dequantize()).T
    want = dequantize(
      unpack_fp4_from_uint8(torch.from_numpy(stored["weight_packed"]), 48, 64, torch.float32),
      torch.from_numpy(stored["weight_scale"].astype(np.float32)),
      args=args,
      global_scale=torch.from_numpy(stored["weight_global_scale"]),
      dtype=torch.float32,
    )
    chex.assert_trees_all_close(ours, want.numpy(), rtol=self.EXACT[0], atol=self.EXACT[1])

    w = torch.from_numpy((rng.standard_normal((48, 64)) * 0.05).astype(np.float32))  # [out, in]
    g = generate_gparam(w.amin(), w.amax())
    groups = w.reshape(48, 4, 16)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=g)
    values = quantize(w, scale, zero, args, global_scale=g)
    q = quant.quantize(jnp.asarray(w.numpy().T), "nvfp4", (16, 1))
    chex.assert_trees_all_equal(np.asarray(q.values).astype(np.float32).T, values.numpy())
    chex.assert_trees_all_equal(
      np.asarray(q.scales).T.view(np.uint8),
      scale.to(torch.float8_e4m3fn).view(torch.uint8).numpy(),
    )
    chex.assert_trees_all_equal(
      np.asarray(q.global_scale), np.full(48, np.float32(1) / g.numpy()[0], np.float32)
    )
