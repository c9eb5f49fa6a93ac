"""PEFT adapters on transformers' MoE blocks against moejax, both ways: PEFT writes an adapter
(random, non-zero B), moejax reads it and computes PEFT's block output; moejax writes one,
PEFT loads it and computes moejax's. Needs the `.[hf]` extra (transformers, torch, peft)."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import hf, moe_apply
from moejax.hf.families import beside
from tests.helpers import random_adapters, seed_of, tolerance
from tests.transformers_models import FAMILIES, hf_checkpoint

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

pytestmark = [
  pytest.mark.slow,  # transformers' models and PEFT
  pytest.mark.extras,
  # PEFT's own use of transformers' deprecated names, and its notices
  pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
  pytest.mark.filterwarnings("ignore::UserWarning:peft"),
  # PEFT checks rank and alpha patterns against modules only, not the expert parameters they
  # apply to (they do apply: the outputs agree).
  pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys:RuntimeWarning"),
]
TOKENS = 24
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
# model_type -> the block's expert parameters PEFT targets, and its shared experts' modules
# (relative to the block; "../" climbs out of it)
FUSED = {
  "qwen2_moe": (EXPERTS, tuple(f"shared_expert.{name}" for name in GATE_UP_DOWN)),
  "gpt_oss": (EXPERTS, ()),  # [E, in, out], marked
  "llama4_text": (EXPERTS, tuple(f"shared_expert.{name}" for name in GATE_UP_DOWN)),  # unmarked
  "granitemoe": (EXPERTS, ()),  # stored input_linear
  # a shared MLP beside the block, its gate and up one linear layer
  "granitemoeshared": (EXPERTS, ("../shared_mlp.input_linear", "../shared_mlp.output_linear")),
  # stored per expert at block_sparse_moe, loaded fused at mlp
  **dict.fromkeys(["mixtral", "phimoe", "minimax"], (EXPERTS, ())),
}


def tiny_model(model_type: str, path, seed: int):
  fields, layer = FAMILIES[model_type]
  model = hf_checkpoint(model_type, dict(fields), path, seed)
  config = hf.config_from_hf(json.loads((path / "config.json").read_text()), chunk_size=5)
  return model, config, hf.family_of(model_type).loaded_block(layer), layer


def block_of(model, block: str):
  return model.get_submodule(block)


def block_output(model, block: str, x: np.ndarray) -> np.ndarray:
  """The block's output for tokens x [T, D], plus the shared MLP's beside it, if any."""
  modules = [block]
  if f"{block.rsplit('.', 1)[0]}.shared_mlp" in dict(model.named_modules()):
    modules.append(f"{block.rsplit('.', 1)[0]}.shared_mlp")
  out = 0.0
  with torch.no_grad():
    for module in modules:
      y = block_of(model, module)(torch.from_numpy(x[None]))
      out = out + (y[0] if isinstance(y, tuple) else y).numpy().reshape(x.shape)
  return out


def moejax_output(model_dir, layer, config, adapters, x) -> np.ndarray:
  params = hf.load_layer(model_dir, layer, config)
  params = params._replace(lora=adapters.lora, shared_lora=adapters.shared_lora)
  return np.asarray(moe_apply(params, jnp.asarray(x), config=adapters.config)[0])


@pytest.mark.parametrize("model_type", FUSED)
def test_fused_adapters_both_ways(model_type, tmp_path, request):
  seed = seed_of(request.node.name) % 2**31
  model, config, block, layer = tiny_model(model_type, tmp_path / "model", seed)
  parameters, shared = FUSED[model_type]
  targets = dict(
    target_parameters=[f"{block}.{name}" for name in parameters],
    target_modules=[beside(block, name) for name in shared],
  )
  # down's own alpha (`alpha_pattern`): moejax folds the ratio of the scales into its B
  lora_config = peft.LoraConfig(r=3, lora_alpha=5.0, alpha_pattern={"down_proj": 2.0}, **targets)
  peft_model = peft.get_peft_model(model, lora_config)
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, value in peft_model.named_parameters():
      if "lora_" in name:
        value.normal_(0.0, 0.3)
  x = np.random.default_rng(seed).standard_normal((TOKENS, config.hidden_size)).astype(np.float32)
  theirs = block_output(peft_model.base_model.model, block, x)
  with peft_model.disable_adapter():  # the adapters matter: the check can fail
    assert not np.allclose(block_output(peft_model.base_model.model, block, x), theirs, atol=1e-2)
  peft_model.save_pretrained(tmp_path / "peft")

  adapters = hf.load_lora(tmp_path / "peft", layer, config, model_type=model_type)
  # The shared experts' gate and up adapters (rank 3 each) fuse into one of rank 6.
  assert adapters.config.lora_rank == (6 if len(shared) == 3 else 3)
  assert adapters.config.lora_scale == pytest.approx(5 / 3)
  ours = moejax_output(tmp_path / "model", layer, config, adapters, x)
  chex.assert_trees_all_close(ours, theirs, **tolerance(comparison="torch"))

  # moejax -> PEFT: other random adapters, written by moejax, loaded by PEFT.
  mine = trained(adapters.config, seed)
  written = hf.load_layer(tmp_path / "model", layer, config)
  written = written._replace(lora=mine.lora, shared_lora=mine.shared_lora)
  hf.save_lora(tmp_path / "ours", {layer: written}, mine.config, model_type=model_type)
  fresh, *_ = tiny_model(model_type, tmp_path / "fresh", seed)
  loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "ours")
  chex.assert_trees_all_close(
    moejax_output(tmp_path / "model", layer, config, mine, x),
    block_output(loaded.base_model.model, block, x),
    **tolerance(comparison="torch"),
  )


def trained(config, seed: int) -> hf.LoadedAdapters:
  """Adapters of the config's rank with every entry random (B too)."""
  return hf.LoadedAdapters(config, *random_adapters(config, jax.random.key(seed), scale=0.3))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_per_expert_adapters_both_ways(model_type, tmp_path, request):
  """moejax writes one adapter per expert and projection (transformers 4's modules: PEFT
  converts them for transformers 5's fused experts) and reads it back: gate's and up's of
  rank 4 become one of rank 8, down's is padded to it; the outputs are PEFT's."""
  seed = seed_of(request.node.name) % 2**31
  model, config, block, layer = tiny_model(model_type, tmp_path / "model", seed)
  mine = trained(dataclasses.replace(config, lora_rank=4, lora_alpha=3.0), seed)
  written = hf.load_layer(tmp_path / "model", layer, config)._replace(lora=mine.lora)
  hf.save_lora(
    tmp_path / "ours", {layer: written}, mine.config, model_type=model_type, layout="per_expert"
  )
  x = np.random.default_rng(seed).standard_normal((TOKENS, config.hidden_size)).astype(np.float32)
  ours = moejax_output(tmp_path / "model", layer, config, mine, x)
  loaded = peft.PeftModel.from_pretrained(model, tmp_path / "ours")
  chex.assert_trees_all_close(
    ours, block_output(loaded.base_model.model, block, x), **tolerance(comparison="torch")
  )
  back = hf.load_lora(tmp_path / "ours", layer, config, model_type=model_type)
  assert back.config.lora_rank == 8 and back.config.lora_scale == pytest.approx(0.75)
  chex.assert_trees_all_close(
    moejax_output(tmp_path / "model", layer, config, back, x),
    ours,
    **tolerance(comparison="reordered"),
  )
