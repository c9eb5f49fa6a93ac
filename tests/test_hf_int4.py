"""INT4 checkpoints as Kimi-K2-Thinking and K2.5 ship them (compressed-tensors pack-quantized:
int32 words of eight 4-bit values, a bfloat16 scale per 32 inputs), written here in NumPy in
their key names; read without dequantizing, run against the reference on weights dequantized
here; `scale_fmt: "ue8m0"` fp8 checkpoints; and, with the `hf` extra, the packing and the
quantization rule against compressed-tensors itself."""

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
from tests.helpers import mesh_of, seed_of, tolerance
from tests.hf_checkpoints import KIMI, LAYER, deepseek_fp8_checkpoint, save_raw_or_numpy

D, F, E, GROUP = 64, 32, 8, 32  # KIMI's sizes
INT4_WEIGHTS = dict(
  num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP, actorder=None,
  dynamic=False, observer="minmax",
)  # fmt: skip


def compressed_tensors_config(**weights) -> dict:
  """Kimi-K2-Thinking's `quantization_config`, with `weights` fields changed."""
  group = dict(targets=["Linear"], weights={**INT4_WEIGHTS, **weights}, input_activations=None)
  return dict(
    quant_method="compressed-tensors", format="pack-quantized", quantization_status="compressed",
    config_groups=dict(group_0=group), ignore=["lm_head", "re:.*self_attn.*", "re:.*shared.*"],
  )  # fmt: skip


def pack_int4(values: np.ndarray) -> np.ndarray:
  """int values in [-8, 7] [..., n] -> int32 words [..., n / 8]: value i is nibble i of its
  row's bytes (low nibble first) plus 8, the words little-endian."""
  nibbles = (values.astype(np.int16) + 8).astype(np.uint8).reshape(*values.shape[:-1], -1, 2)
  data = (nibbles[..., 0] | (nibbles[..., 1] << 4)).astype(np.uint8)
  return np.ascontiguousarray(data).view("<i4").astype(np.int32)


def kimi_checkpoint(path, seed: int, nested: bool = False):
  """A Kimi-K2 (or, `nested`, K2.5) MoE layer: routed experts pack-quantized, shared experts
  and the router float (the `ignore` list); returns the config.json dict and the float
  tensors the stored ones stand for (NumPy float64: values times scales)."""
  rng = np.random.default_rng(seed)
  stored = {
    "gate.weight": 0.3 * rng.standard_normal((E, D)).astype(np.float32),
    "gate.e_score_correction_bias": 0.1 * rng.standard_normal(E).astype(np.float32),
  }
  for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
    w = (0.3 * rng.standard_normal(shape)).astype(np.float32)
    stored[f"shared_experts.{name}.weight"] = w
  floats = dict(stored)
  for e in range(E):
    for name, (rows, cols) in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
      values = rng.integers(-8, 8, (rows, cols))
      scales = 2.0 ** rng.integers(-9, -5, (rows, cols // GROUP)) * rng.uniform(
        1, 2, (rows, cols // GROUP)
      )
      scales = scales.astype(ml_dtypes.bfloat16)
      key = f"experts.{e}.{name}.weight"
      stored[f"{key}_packed"] = pack_int4(values)
      stored[f"{key}_scale"] = scales
      stored[f"{key}_shape"] = np.array([rows, cols], np.int64)
      floats[key] = values * np.repeat(scales.astype(np.float64), GROUP, axis=1)
  quantization = compressed_tensors_config()
  config = dict(model_type="kimi_k2", quantization_config=quantization, **KIMI)
  prefix = f"model.layers.{LAYER}.mlp"
  if nested:  # K2.5: the text model's fields in text_config, its weights under language_model
    config = dict(model_type="kimi_k25", quantization_config=quantization,
                  text_config=dict(model_type="kimi_k2", **KIMI))  # fmt: skip
    prefix = f"language_model.{prefix}"
  (path / "config.json").write_text(json.dumps(config))
  save_raw_or_numpy({f"{prefix}.{name}": v for name, v in stored.items()}, path)
  return config, floats


@pytest.mark.parametrize("nested", [False, True], ids=["kimi_k2", "kimi_k25"])
def test_int4_experts_load_as_stored_and_match_the_reference(nested, tmp_path, request):
  seed = seed_of(request.node.name)
  hf_config, floats = kimi_checkpoint(tmp_path, seed, nested)
  config = hf.config_from_hf(hf_config, chunk_size=8)
  assert (config.expert_quant, config.quant_block, config.num_experts) == ("int4_group", (32, 1), E)
  params = hf.load_layer(tmp_path, LAYER, config, mesh=mesh_of(2, 4))
  assert params.w_gate_up.values.dtype == jnp.int4 and params.w_gate_up.scales.dtype == jnp.bfloat16
  assert params.w_gate_up.scales.sharding.spec[0] == "expert"
  gate, up = floats["experts.5.gate_proj.weight"].T, floats["experts.5.up_proj.weight"].T
  chex.assert_trees_all_equal(
    np.asarray(params.w_gate_up[5].dequantize()), np.concatenate([gate, up], 1).astype(np.float32)
  )
  chex.assert_trees_all_equal(
    np.asarray(params.w_down[2].dequantize()),
    floats["experts.2.down_proj.weight"].T.astype(np.float32),
  )
  floats_config = dataclasses.replace(config, expert_quant=None)
  dequantized = hf.load_layer(tmp_path, LAYER, config, dequantize=True)
  x = jax.random.normal(jax.random.key(seed), (40, D))
  mask = jax.random.bernoulli(jax.random.key(seed + 1), 0.8, (40,))
  y, _ = moe_apply(params, x, config=config, mesh=mesh_of(2, 4), token_mask=mask)
  chex.assert_trees_all_close(y, reference_moe(dequantized, x, floats_config, mask), **tolerance())


def test_ue8m0_fp8_scales_are_checked(tmp_path, request):
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


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(format="float-quantized"), r"format='float-quantized'"),
    (dict(num_bits=8), r"weights\.num_bits=8, expected 4"),
    (dict(symmetric=False), r"weights\.symmetric=False.*zero points"),
    (dict(actorder="group"), r"actorder='group' \(a per-input g_idx\)"),
    (dict(group_size=16), r"weights\.group_size=16, expected one of \(32, 64, 128\)"),
  ],
  ids=["format", "bits", "asymmetric", "actorder", "group size"],
)
def test_int4_configs_moejax_cannot_read_name_the_field(change, match):
  quantization = compressed_tensors_config(**{k: v for k, v in change.items() if k != "format"})
  if "format" in change:
    quantization["format"] = quantization["config_groups"]["group_0"]["format"] = change["format"]
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(dict(model_type="kimi_k2", quantization_config=quantization, **KIMI))


@pytest.mark.slow
@pytest.mark.skipif(
  importlib.util.find_spec("compressed_tensors") is None,
  reason="needs the hf extra (compressed-tensors)",
)
def test_packing_and_rounding_are_compressed_tensors_own(request):
  """Our unpacking of compressed-tensors' `pack_to_int32`, its unpacking of our NumPy
  packing, and `quant.quantize`'s int4_group against its symmetric group quantization: bit
  for bit."""
  import torch
  from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
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
  groups = torch.from_numpy(w).reshape(48, 2, GROUP)
  scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
  codes = quantize(torch.from_numpy(w), scale.float(), zero, args, dtype=torch.int8)
  ours = quant.quantize(jnp.asarray(w.T), "int4_group", (GROUP, 1))
  chex.assert_trees_all_equal(np.asarray(ours.values).astype(np.int8).T, codes.numpy())
  chex.assert_trees_all_equal(
    np.asarray(ours.scales).T.view(np.uint16),
    scale.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
  )
