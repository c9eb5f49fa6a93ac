"""Quantized Hugging Face checkpoints: a DeepSeek-V3 fine-grained fp8 layer (per-expert or
fused) and a GPT-OSS MXFP4 layer, written here in their real key names and layouts, read
without dequantizing and run against the NumPy blocks of `tests/hf_checkpoints.py` on weights
dequantized here in NumPy (and, with the `hf` extra, against transformers' own fp8
dequantization and MXFP4 unpacking)."""

import importlib.util
import json

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.quantized import BlockScaled
from moejax import hf, moe_apply
from tests.helpers import mesh_of, seed_of
from tests.hf_checkpoints import (
  DEEPSEEK,
  FP8_BLOCK,
  LAYER,
  T,
  deepseek_block,
  deepseek_fp8_checkpoint,
  gpt_oss_block,
  write,
)


class TestDeepSeekFp8:
  @pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
  def test_loads_quantized_and_matches_the_numpy_block(self, fused, tmp_path, request):
    hf_config, _, get = deepseek_fp8_checkpoint(tmp_path, seed_of(request.node.name), fused)
    config = hf.config_from_hf(hf_config, chunk_size=5)
    assert (config.expert_quant, config.quant_block_size) == ("fp8_block", (8, 4))
    params = hf.load_layer(tmp_path, LAYER, config)
    assert isinstance(params.w_gate_up, BlockScaled)
    assert params.w_gate_up.values.dtype == jnp.float8_e4m3fn
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T, 16)).astype(np.float32)
    expected = deepseek_block(x.astype(np.float64), get, hf_config, biased=True)
    for mesh in (None, mesh_of(2, 4)):
      y, _ = moe_apply(params, jnp.asarray(x), config=config, mesh=mesh)
      chex.assert_trees_all_close(y, expected.astype(np.float32), atol=2e-4, rtol=2e-4)
    floats = hf.load_layer(tmp_path, LAYER, config, dequantize=True)
    gate = get("experts.3.gate_proj.weight").T
    chex.assert_trees_all_close(floats.w_gate_up[3][:, :12], gate.astype(np.float32))
    on_mesh = hf.load_layer(tmp_path, LAYER, config, mesh=mesh_of(2, 4))
    assert on_mesh.w_gate_up.scales.sharding.spec[0] == "expert"

  @pytest.mark.slow
  @pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
    reason="needs the hf extra (torch, transformers)",
  )
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

  def test_config(self):
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    config = hf.config_from_hf(
      {"model_type": "deepseek_v3", "hidden_size": 128, "quantization_config": fp8,
       **{**DEEPSEEK, "moe_intermediate_size": 128}}
    )  # fmt: skip
    assert config.quant_block == (64, 128)
    with pytest.raises(NotImplementedError, match="quant_method='awq'"):
      hf.config_from_hf(
        {"model_type": "deepseek_v3", "hidden_size": 16, "quantization_config":
         {"quant_method": "awq"}, **DEEPSEEK}
      )  # fmt: skip


def e2m1(code: np.ndarray) -> np.ndarray:
  """An e2m1 code's value from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
  sign = np.where(code & 8, -1.0, 1.0)
  exponent, mantissa = (code >> 1) & 3, code & 1
  normal = 2.0 ** (exponent - 1.0) * (1 + mantissa / 2)
  return sign * np.where(exponent == 0, mantissa * 0.5, normal)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """[E, rows, n, 16] uint8 + [E, rows, n] uint8 -> [E, 32 n, rows] float64, GPT-OSS's input-
  major float layout (low nibble first, scale 2^(s - 127))."""
  low, high = e2m1(blocks & 0x0F), e2m1(blocks >> 4)
  values = np.stack([low, high], -1).reshape(*blocks.shape[:-1], 32)
  values = values * 2.0 ** (scales.astype(np.float64) - 127)[..., None]
  return values.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1)


class TestGptOssMxfp4:
  d, f, e = 64, 32, 8

  def checkpoint(self, path, seed):
    rng = np.random.default_rng(seed)
    d, f, e = self.d, self.f, self.e
    blocks = lambda rows, cols: rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
    scales = lambda rows, cols: rng.integers(122, 127, (e, rows, cols // 32), dtype=np.uint8)
    stored = {
      "router.weight": 0.3 * rng.standard_normal((e, d)).astype(np.float32),
      "router.bias": 0.3 * rng.standard_normal(e).astype(np.float32),
      "experts.gate_up_proj_blocks": blocks(2 * f, d),
      "experts.gate_up_proj_scales": scales(2 * f, d),
      "experts.gate_up_proj_bias": 0.3 * rng.standard_normal((e, 2 * f)).astype(np.float32),
      "experts.down_proj_blocks": blocks(d, f),
      "experts.down_proj_scales": scales(d, f),
      "experts.down_proj_bias": 0.3 * rng.standard_normal((e, d)).astype(np.float32),
    }
    floats = {name: v for name, v in stored.items() if "proj_b" not in name[-7:]}
    for name in ("gate_up_proj", "down_proj"):
      floats[f"experts.{name}"] = mxfp4_dequantize(
        stored[f"experts.{name}_blocks"], stored[f"experts.{name}_scales"]
      )
    config = dict(
      model_type="gpt_oss", hidden_size=d, hidden_act="silu", num_local_experts=e,
      num_experts_per_tok=2, intermediate_size=f, swiglu_limit=2.0,
      quantization_config={"quant_method": "mxfp4"},
    )  # fmt: skip
    write(path, config, stored, "mlp")
    return config, stored, floats.__getitem__

  def test_loads_quantized_and_matches_the_numpy_block(self, tmp_path, request):
    hf_config, _, get = self.checkpoint(tmp_path, seed_of(request.node.name))
    config = hf.config_from_hf(hf_config, chunk_size=5)
    assert config.expert_quant == "mxfp4"
    params = hf.load_layer(tmp_path, LAYER, config)
    assert params.w_down.values.dtype == jnp.float4_e2m1fn
    assert params.w_down.scales.dtype == jnp.float8_e8m0fnu
    x = np.random.default_rng(1).standard_normal((T, self.d)).astype(np.float32)
    expected = gpt_oss_block(x.astype(np.float64), get, hf_config)
    for mesh in (None, mesh_of(2, 4)):
      y, _ = moe_apply(params, jnp.asarray(x), config=config, mesh=mesh)
      chex.assert_trees_all_close(y, expected.astype(np.float32), atol=2e-4, rtol=2e-4)

  @pytest.mark.slow
  @pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
    reason="needs the hf extra (torch, transformers)",
  )
  def test_unpacking_matches_transformers(self, tmp_path, request):
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, stored, _ = self.checkpoint(tmp_path, seed_of(request.node.name))
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
