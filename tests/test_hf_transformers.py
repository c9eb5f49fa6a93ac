"""Each family's MoE block in Hugging Face `transformers` against moejax, on a checkpoint that
`save_pretrained` wrote locally: the loader reads the real on-disk layout, and the outputs
agree at 1e-4 in float32. Needs the `.[hf]` extra (transformers and a CPU torch)."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import hf, moe_apply
from tests.helpers import mesh_of, seed_of

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATTENTION = dict(vocab_size=32, hidden_size=16, num_attention_heads=2, num_key_value_heads=2)
MLA = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
# model_type -> (config.json fields of a tiny model, MoE layer index, the block's module path)
FAMILIES = {
  "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24), 0, "mlp"),
  "phimoe": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                  router_jitter_noise=0.2), 0, "mlp"),
  "qwen2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                     shared_expert_intermediate_size=12, norm_topk_prob=False), 0, "mlp"),
  "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                     norm_topk_prob=True), 0, "mlp"),
  "qwen3_next": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=12, layer_types=["full_attention"]), 0,
                 "mlp"),
  "olmoe": (dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24), 0, "mlp"),
  "deepseek_v2": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                       n_shared_experts=1, first_k_dense_replace=0, n_group=4, topk_group=2,
                       topk_method="group_limited_greedy", routed_scaling_factor=1.5, **MLA),
                  0, "mlp"),
  "deepseek_v3": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                       n_shared_experts=1, first_k_dense_replace=0, n_group=4, topk_group=2,
                       routed_scaling_factor=2.5, norm_topk_prob=True, **MLA), 0, "mlp"),
  "glm4_moe": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    intermediate_size=24, n_shared_experts=1, first_k_dense_replace=0,
                    n_group=4, topk_group=2, norm_topk_prob=True, head_dim=8), 0, "mlp"),
  "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                   swiglu_limit=1.0, layer_types=["full_attention"], head_dim=8), 0, "mlp"),
  "llama4_text": (dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=24,
                       intermediate_size_mlp=24, moe_layers=[0], no_rope_layers=[1],
                       head_dim=8), 0, "feed_forward"),
  "longcat_flash": (dict(n_routed_experts=4, zero_expert_num=2, moe_topk=2,
                         expert_ffn_hidden_size=24, ffn_hidden_size=24, num_hidden_layers=2,
                         routed_scaling_factor=1.5, head_dim=4, **MLA), 0, "mlp"),
  "minimax": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                   layer_types=["full_attention"], head_dim=8), 0, "mlp"),
  "granitemoe": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24), 0,
                 "block_sparse_moe"),
  "jamba": (dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24,
                 expert_layer_period=1, expert_layer_offset=0, attn_layer_period=1,
                 attn_layer_offset=0), 0, "feed_forward"),
  "ernie4_5_moe": (dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=24,
                        moe_layer_start_index=0, moe_num_shared_experts=1), 0, "mlp"),
  "hunyuan_v1_moe": (dict(num_experts=4, moe_topk=2, intermediate_size=24, head_dim=8), 0,
                     "mlp"),
  "lfm2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                    intermediate_size=24, num_dense_layers=0, routed_scaling_factor=1.5,
                    layer_types=["full_attention"]), 0, "feed_forward"),
  "dbrx": (dict(d_model=16, n_heads=2, n_layers=1, attn_config=dict(kv_n_heads=2,
                rope_theta=1e4), ffn_config=dict(moe_num_experts=4, moe_top_k=2,
                ffn_hidden_size=24)), 0, "ffn"),
}  # fmt: skip


def hf_checkpoint(model_type: str, fields: dict, path, seed: int):
  """A tiny model with random weights (biases and buffers too), saved with save_pretrained."""
  if model_type == "dbrx":  # its own names for the attention sizes
    config = transformers.AutoConfig.for_model(model_type, vocab_size=32, **fields)
  else:
    layers = fields.pop("num_hidden_layers", 1)
    config = transformers.AutoConfig.for_model(
      model_type, **ATTENTION, num_hidden_layers=layers, **fields
    )
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
  with torch.no_grad():
    for tensor in [*model.parameters(), *model.buffers()]:
      if tensor.is_floating_point():
        tensor.normal_(0.0, 0.4)
  model.save_pretrained(path)
  return model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_block_matches_transformers(model_type, tmp_path, request):
  fields, layer, block_name = FAMILIES[model_type]
  model = hf_checkpoint(model_type, dict(fields), tmp_path, seed_of(request.node.name) % 2**31)
  decoder = model.transformer.blocks if model_type == "dbrx" else model.model.layers
  block = getattr(decoder[layer], block_name)
  rng = np.random.default_rng(seed_of(request.node.name))
  x = rng.standard_normal((1, 24, 16)).astype(np.float32)
  with torch.no_grad():
    expected = block(torch.from_numpy(x))
  expected = (expected[0] if isinstance(expected, tuple) else expected).numpy().reshape(24, 16)

  config = hf.config_from_hf(
    __import__("json").loads((tmp_path / "config.json").read_text()), chunk_size=5
  )
  params = hf.load_layer(tmp_path, layer, config)
  mask = jnp.asarray(rng.random(24) < 0.75)
  for mesh in (None, mesh_of(2, 4)):
    y, _ = moe_apply(params, jnp.asarray(x[0]), config=config, mesh=mesh, token_mask=mask)
    want = np.where(np.asarray(mask)[:, None], expected, 0.0)
    chex.assert_trees_all_close(y, want, atol=1e-4, rtol=1e-4)
