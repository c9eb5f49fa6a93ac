"""NVFP4 checkpoints as NVIDIA's ModelOpt and compressed-tensors store them (e2m1 codes two a
byte along the input axis, an e4m3 scale per 16 inputs, one float32 scale per matrix: ModelOpt's
`weight_scale_2` multiplies, compressed-tensors' `weight_global_scale` divides), written here in
NumPy in their key names; read without dequantizing and run against the reference; and, with
the `hf` extra, the packing, the dequantization and the quantization rule against
compressed-tensors itself."""

import dataclasses
import importlib.util
import json

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moejax import hf, moe_apply, quant, reference_moe
from moejax.hf_nvfp4 import COMPRESSED_TENSORS, MODELOPT, Nvfp4Names
from tests.helpers import mesh_of, seed_of, tolerance
from tests.hf_checkpoints import KIMI, LAYER, save_raw_or_numpy

D, F, E = 64, 32, 8  # KIMI's sizes
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
MODELOPT_CONFIG = dict(
  quant_method="modelopt", quant_algo="NVFP4", group_size=16, kv_cache_quant_algo=None,
  exclude_modules=["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"],
)  # fmt: skip
NVFP4_WEIGHTS = dict(
  num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
  dynamic=False, observer="minmax",
)  # fmt: skip


def compressed_tensors_config(**weights) -> dict:
  """compressed-tensors' NVFP4 (W4A4) `quantization_config`, with `weights` fields changed."""
  activations = {**NVFP4_WEIGHTS, "dynamic": "local"}
  group = dict(targets=["Linear"], weights={**NVFP4_WEIGHTS, **weights},
               input_activations=activations)  # fmt: skip
  return dict(
    quant_method="compressed-tensors", format="nvfp4-pack-quantized",
    quantization_status="compressed", config_groups=dict(group_0=group),
    ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
  )  # fmt: skip


def nvfp4_linear(rng, rows: int, cols: int, names: Nvfp4Names) -> tuple[dict, np.ndarray]:
  """One NVFP4 linear layer [out, in]: its stored tensors (suffix -> array, activation scale
  included) and the float32 weight they stand for, dequantized as the convention does
  (ModelOpt: codes * (scale * scale_2); compressed-tensors: codes * (scale / g))."""
  codes = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
  scales = rng.uniform(16, 448, (rows, cols // 16)).astype(ml_dtypes.float8_e4m3fn)
  matrix = np.float32(2.0 ** rng.uniform(-13, -11))
  if names.reciprocal:
    matrix = np.float32(1) / matrix  # g, as compressed-tensors stores it
  effective = np.repeat(scales.astype(np.float32), 16, axis=1)
  effective = effective / matrix if names.reciprocal else effective * matrix
  activation = "input_global_scale" if names.reciprocal else "input_scale"
  stored = {
    names.codes: codes[:, 0::2] | (codes[:, 1::2] << 4),
    names.scales: scales,
    names.matrix_scale: np.full((1,) if names.reciprocal else (), matrix, np.float32),
    activation: np.ones((1,) if names.reciprocal else (), np.float32),
  }
  return stored, E2M1[codes] * effective


def nvfp4_checkpoint(path, seed: int, names: Nvfp4Names, quantization: dict, drop: str = ""):
  """A DeepSeek-V3 MoE layer with its routed and shared experts in NVFP4 (as NVIDIA's
  DeepSeek-R1-FP4), the router float, without the tensor `drop` names; returns the
  config.json dict and the float32 weights the stored ones stand for, by key."""
  rng = np.random.default_rng(seed)
  stored = {
    "gate.weight": 0.3 * rng.standard_normal((E, D)).astype(np.float32),
    "gate.e_score_correction_bias": 0.1 * rng.standard_normal(E).astype(np.float32),
  }
  floats = {}
  shapes = (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F)))
  layers = [f"shared_experts.{n}" for n, _ in shapes] + [
    f"experts.{e}.{n}" for e in range(E) for n, _ in shapes
  ]
  for layer in layers:
    tensors, floats[layer] = nvfp4_linear(rng, *dict(shapes)[layer.rsplit(".", 1)[1]], names)
    stored.update({f"{layer}.{suffix}": value for suffix, value in tensors.items()})
  config = dict(model_type="deepseek_v3", quantization_config=quantization, **KIMI)
  (path / "config.json").write_text(json.dumps(config))
  prefix = f"model.layers.{LAYER}.mlp"
  kept = {f"{prefix}.{name}": v for name, v in stored.items() if name != drop}
  save_raw_or_numpy(kept, path)
  return config, floats


@pytest.mark.parametrize(
  "names, quantization",
  [(MODELOPT, MODELOPT_CONFIG), (COMPRESSED_TENSORS, compressed_tensors_config())],
  ids=["modelopt", "compressed-tensors"],
)
def test_nvfp4_experts_load_as_stored_and_match_the_reference(
  names, quantization, tmp_path, request
):
  """The codes and e4m3 scales load as stored, gate's and up's matrix scales each on its own
  columns; the weights are the convention's own dequantization (ModelOpt's exactly,
  compressed-tensors' division to a float32 rounding), and the layer on the 2x4 mesh matches
  the reference on them."""
  seed = seed_of(request.node.name)
  hf_config, floats = nvfp4_checkpoint(tmp_path, seed, names, quantization)
  config = hf.config_from_hf(hf_config, chunk_size=8)
  assert (config.expert_quant, config.quant_block) == ("nvfp4", (16, 1))
  params = hf.load_layer(tmp_path, LAYER, config, mesh=mesh_of(2, 4))
  w = params.w_gate_up
  assert (w.values.dtype, w.scales.dtype, w.global_scale.dtype) == (
    jnp.float4_e2m1fn, jnp.float8_e4m3fn, jnp.float32
  )  # fmt: skip
  assert w.global_scale.sharding.spec[0] == "expert"
  ulp = dict(rtol=0, atol=0) if names is MODELOPT else dict(rtol=2.4e-7, atol=0)
  gate_up = np.concatenate([floats["experts.5.gate_proj"].T, floats["experts.5.up_proj"].T], 1)
  chex.assert_trees_all_close(np.asarray(w[5].dequantize()), gate_up, **ulp)
  chex.assert_trees_all_close(
    np.asarray(params.w_down[2].dequantize()), floats["experts.2.down_proj"].T, **ulp
  )
  chex.assert_trees_all_close(
    np.asarray(params.shared_w_down), floats["shared_experts.down_proj"].T, **ulp
  )  # shared experts: dequantized
  dequantized = hf.load_layer(tmp_path, LAYER, config, dequantize=True)
  x = jax.random.normal(jax.random.key(seed), (40, D))
  mask = jax.random.bernoulli(jax.random.key(seed + 1), 0.8, (40,))
  y, _ = moe_apply(params, x, config=config, mesh=mesh_of(2, 4), token_mask=mask)
  float_config = dataclasses.replace(config, expert_quant=None)
  chex.assert_trees_all_close(y, reference_moe(dequantized, x, float_config, mask), **tolerance())


@pytest.mark.parametrize(
  "quantization, match",
  [
    ({**MODELOPT_CONFIG, "quant_algo": "FP8"}, r"quant_algo='FP8': moejax reads ModelOpt's"),
    ({**MODELOPT_CONFIG, "group_size": 32}, r"group_size=32, expected 16"),
    (compressed_tensors_config(strategy="group"), r"weights\.strategy='group', expected"),
    (compressed_tensors_config(group_size=32), r"weights\.group_size=32, expected 16"),
  ],
  ids=["modelopt algo", "modelopt group", "strategy", "group size"],
)
def test_nvfp4_configs_moejax_cannot_read_name_the_field(quantization, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(dict(model_type="deepseek_v3", quantization_config=quantization, **KIMI))


def test_an_nvfp4_layer_without_its_matrix_scale_names_both_conventions(tmp_path):
  nvfp4_checkpoint(tmp_path, 0, MODELOPT, MODELOPT_CONFIG, drop="experts.3.up_proj.weight_scale_2")
  match = r"no NVFP4 matrix scale at model\.layers\.2\.mlp\.experts\.3\.up_proj .*'weight_scale_2'"
  with pytest.raises(KeyError, match=match):
    hf.load_layer(tmp_path, LAYER)


@pytest.mark.slow
@pytest.mark.skipif(
  importlib.util.find_spec("compressed_tensors") is None,
  reason="needs the hf extra (compressed-tensors)",
)
def test_packing_dequantization_and_rounding_are_compressed_tensors_own(tmp_path, request):
  """compressed-tensors' packing of codes and our unpacking of it, its dequantization of a
  stored matrix against ours (to a float32 rounding: it divides by g, we multiply by 1 / g),
  and `quant.quantize`'s nvfp4 against its tensor_group quantization: codes, e4m3 scales and
  global scale bit for bit."""
  import torch
  from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
  from compressed_tensors.quantization import QuantizationArgs
  from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
  from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

  from moejax.hf_nvfp4 import read_nvfp4, unpack_fp4
  from moejax.safetensors_files import SafetensorsFiles

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
  chex.assert_trees_all_close(ours, want.numpy(), rtol=2.4e-7, atol=0)

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
