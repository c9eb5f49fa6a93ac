"""Tiny models of each family `moejax.hf` reads, built by Hugging Face `transformers` and saved
with `save_pretrained` (needs the `hf` extra: torch and transformers)."""

ATTENTION = dict(vocab_size=32, hidden_size=16, num_attention_heads=2, num_key_value_heads=2)
MLA = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
# model_type -> (config.json fields of a tiny model of LAYERS decoder layers, dense and MoE ones
# mixed where the family has a rule for it, and one MoE layer's index); the block's module path
# is `moejax.hf.Family.loaded_block`'s.
LAYERS = 3
_TYPES = dict(layer_types=["full_attention"] * LAYERS)
_QWEN3_VL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                     intermediate_size=24, head_dim=8, decoder_sparse_step=2)  # fmt: skip
_GLM4V_MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                  intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                  topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5,
                  head_dim=8)  # fmt: skip
_QWEN3_5_MOE = dict(
  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
  shared_expert_intermediate_size=12, head_dim=8,
  layer_types=["linear_attention", "full_attention", "full_attention"],
  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
  linear_value_head_dim=8,
)  # fmt: skip
_GEMMA4 = dict(
  num_experts=4, top_k_experts=2, moe_intermediate_size=24, intermediate_size=24,
  enable_moe_block=True, head_dim=8, global_head_dim=8, num_kv_shared_layers=0,
  hidden_size_per_layer_input=0,
  layer_types=["sliding_attention", "full_attention", "full_attention"],
)  # fmt: skip
_QWEN4_EXP = dict(
  **_QWEN3_5_MOE, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
  indexer_compress_ratio=4, ngram_vocab_size_base=64, split_ngram_parts=1, heads_per_ngram=1,
)  # fmt: skip
_OCR = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
            intermediate_size=24, n_shared_experts=1,
            mlp_layer_types=["dense", "sparse", "sparse"])  # fmt: skip
_DOTS3_NOTE = dict(
  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=24,
  n_shared_experts=2, shared_experts_intermediate_size=12, n_group=4, topk_group=2,
  routed_scaling_factor=1.5, **MLA, head_dim=8, index_topk=4, index_head_dim=8,
  index_n_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
  mlp_layer_types=["dense", "sparse", "sparse"],
)  # fmt: skip
_INKLING = dict(
  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2,
  head_dim=8, route_scale=1.5, swa_num_attention_heads=2, swa_num_key_value_heads=2,
  swa_head_dim=8, d_rel=4, sliding_window_size=8, rel_extent=8, intermediate_size=24,
  mlp_layer_types=["dense", "sparse", "sparse"],
)  # fmt: skip
_INKLING2 = dict(
  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=8,
  mlp_gate_softcap=1.0, mlp_up_softcap=2.0, route_scale=1.5, unpadded_vocab_size=32,
  swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_head_dim=8, d_rel=4,
  sliding_window_size=8, rel_extent=8, n_layers_per_attn_res_block=1,
)  # fmt: skip
_MUSE_SPARK = dict(
  num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, moe_hidden_size=8,
  intermediate_size=24, head_dim=8, mlp_layer_types=["dense", "sparse", "sparse"],
  routed_scaling_factor=1.5, output_multiplier=0.7, post_norm_eps=1e-6,
)  # fmt: skip
FAMILIES = {
  "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24), 2),
  "phimoe": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                  router_jitter_noise=0.2), 2),
  "qwen2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                     shared_expert_intermediate_size=12, norm_topk_prob=False,
                     intermediate_size=24, mlp_only_layers=[1]), 2),
  "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                     norm_topk_prob=True, intermediate_size=24, decoder_sparse_step=2), 1),
  "qwen3_vl_moe": (_QWEN3_VL_MOE, 1),
  "qwen3_vl_moe_text": (_QWEN3_VL_MOE, 1),
  "qwen3_next": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=12, intermediate_size=24,
                      mlp_only_layers=[0], **_TYPES), 1),
  "mellum": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                  norm_topk_prob=True, intermediate_size=24, head_dim=8,
                  mlp_layer_types=["sparse", "dense", "sparse"]), 0),
  "laguna": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                  shared_expert_intermediate_size=12, intermediate_size=24, head_dim=8,
                  moe_routed_scaling_factor=1.5, moe_router_logit_softcapping=1.0,
                  **_TYPES), 1),
  "lara_mini": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                     shared_expert_intermediate_size=12, norm_topk_prob=True, head_dim=8,
                     layer_types=["linear_attention", "full_attention", "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                     linear_value_head_dim=8), 1),
  "flint": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                 shared_expert_intermediate_size=12, norm_topk_prob=True, intermediate_size=24,
                 head_dim=8, mlp_only_layers=[0]), 1),
  "qwen3_5_moe_text": (_QWEN3_5_MOE, 1),
  "qwen3_5_moe": (_QWEN3_5_MOE, 1),  # the vision-language model, as released
  "qwen4_exp_text": (_QWEN4_EXP, 1),
  "qwen4_exp": (_QWEN4_EXP, 1),
  "qwen3_omni_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                          intermediate_size=24, head_dim=8, decoder_sparse_step=2), 1),
  "olmoe": (dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24), 2),
  "deepseek_v2": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                       n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                       topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                       intermediate_size=24, **MLA), 1),
  "deepseek_ocr2": (_OCR, 1),
  "unlimited_ocr": (_OCR, 1),
  "deepseek_v3": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                       n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                       routed_scaling_factor=2.5, norm_topk_prob=True, intermediate_size=24,
                       **MLA), 2),
  "dots1": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                 intermediate_size=24, n_shared_experts=2, first_k_dense_replace=1, n_group=4,
                 topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5, head_dim=8,
                 **_TYPES), 1),
  "deepseek_v32": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                        intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                        index_topk=4, index_head_dim=8, index_n_heads=2, **MLA), 2),
  "glm_moe_dsa": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                       intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
                       n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                       index_topk=4, index_head_dim=8, index_n_heads=2, **MLA), 1),
  "solar_open": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                      n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
                      routed_scaling_factor=1.5, head_dim=8), 0),
  "minicpm5_moe": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                        intermediate_size=24, n_shared_experts=2, first_k_dense_replace=1,
                        n_group=4, topk_group=2, routed_scaling_factor=1.5, head_dim=8), 1),
  "glm4_moe_lite": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                         intermediate_size=24, n_shared_experts=1, n_group=4, topk_group=2,
                         norm_topk_prob=True, routed_scaling_factor=1.8,
                         mlp_layer_types=["sparse", "dense", "sparse"], **MLA), 0),
  "mimo_v2_flash": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                         intermediate_size=24, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=1.5, head_dim=8, v_head_dim=8), 1),
  "hy_v4": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                 intermediate_size=24, n_shared_experts=1, n_group=4, topk_group=2,
                 norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=1.0,
                 index_topk=4, index_head_dim=8, index_n_heads=2, hc_mult=2, pad_token_id=0,
                 **MLA), 1),
  "hy_v4_vl": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    intermediate_size=24, n_shared_experts=1, n_group=4, topk_group=2,
                    norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=1.0,
                    index_topk=4, index_head_dim=8, index_n_heads=2, hc_mult=2, pad_token_id=0,
                    **{**MLA, "qk_rope_head_dim": 6}, head_dim=8,
                    rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                         mrope_section=[1, 1, 1])), 1),
  "glm5_next": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                     intermediate_size=24, n_shared_experts=1, n_group=4, topk_group=2,
                     routed_scaling_factor=1.5, swiglu_limit=1.0, kv_lora_rank=8, q_lora_rank=8,
                     qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
                     index_topk=4, index_kpool=2, index_head_dim=8, index_n_heads=2,
                     linear_head_dim=8, linear_num_heads=2, hc_mult=2, pad_token_id=0,
                     mlp_layer_types=["dense", "sparse", "sparse"]), 1),
  "dots3_note_text": (_DOTS3_NOTE, 1),
  "dots3_note": (_DOTS3_NOTE, 1),
  "kimi_linear": (dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                       intermediate_size=24, n_shared_experts=1, n_group=4, topk_group=2,
                       norm_topk_prob=True, routed_scaling_factor=1.5, linear_head_dim=8,
                       linear_num_heads=2, pad_token_id=0,
                       layer_types=["linear_attention", "full_attention", "full_attention"],
                       mlp_layer_types=["dense", "sparse", "sparse"], **MLA), 1),
  "bailing_hybrid": (dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                          intermediate_size=24, n_shared_experts=1, n_group=4, topk_group=2,
                          norm_topk_prob=True, routed_scaling_factor=1.5,
                          first_k_dense_replace=1, head_dim=8, pad_token_id=0, eos_token_id=1,
                          layer_group_size=2, **MLA), 1),
  "aria_text": (dict(moe_num_experts=4, moe_topk=2, intermediate_size=24,
                     moe_num_shared_experts=2, head_dim=8), 1),
  "axk1": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                intermediate_size=24, n_shared_experts=1, n_group=4, topk_group=2,
                norm_topk_prob=True, routed_scaling_factor=1.5,
                mlp_layer_types=["dense", "sparse", "sparse"], **MLA), 1),
  "axk2": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                intermediate_size=24, n_shared_experts=1, n_group=4, topk_group=2,
                norm_topk_prob=True, routed_scaling_factor=1.5, index_topk=4, index_head_dim=8,
                index_n_heads=2, mlp_layer_types=["dense", "sparse", "sparse"], **MLA), 1),
  "deepseek_v4": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                       routed_scaling_factor=1.5, swiglu_limit=1.0, head_dim=8, pad_token_id=0,
                       mlp_layer_types=["hash_moe", "moe", "moe"]), 1),
  "kolibri1": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                    shared_expert_intermediate_size=12, head_dim=8), 1),
  "beam": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                intermediate_size=24, n_group=4, topk_group=2, norm_topk_prob=True,
                routed_scaling_factor=1.5, head_dim=8,
                mlp_layer_types=["dense", "sparse", "sparse"]), 1),
  "exaone_moe": (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                      intermediate_size=24, num_shared_experts=2, n_group=4, topk_group=2,
                      norm_topk_prob=True, routed_scaling_factor=1.5, head_dim=8), 1),
  "mistral4": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
                    n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.5,
                    **MLA), 1),
  "afmoe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                 intermediate_size=24, num_shared_experts=1, route_scale=1.5,
                 num_dense_layers=1, head_dim=8, **_TYPES), 1),
  "cohere2_moe": (dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24,
                       num_shared_experts=1, head_dim=8,
                       mlp_layer_types=["dense", "sparse", "sparse"]), 1),
  "mistral_large4": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                          intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
                          n_group=4, topk_group=2, routed_scaling_factor=1.5, index_topk=4,
                          index_head_dim=8, index_n_heads=2, **MLA), 1),
  "minimax_m2": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                      head_dim=8), 2),
  "minimax_m3_vl": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                         dense_intermediate_size=24, shared_intermediate_size=12, head_dim=8,
                         rotary_dim=4, swiglu_alpha=1.3, swiglu_limit=1.0,
                         routed_scaling_factor=1.5,
                         mlp_layer_types=["dense", "sparse", "sparse"]), 1),
  "hy_v3": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                 intermediate_size=24, num_shared_experts=1, router_scaling_factor=1.5,
                 head_dim=8, mlp_layer_types=["dense", "sparse", "sparse"]), 1),
  "flex_olmo": (dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24,
                     pad_token_id=0), 2),
  "glm4v_moe": (_GLM4V_MOE, 1),
  "glm4v_moe_text": (_GLM4V_MOE, 1),
  "glm4_moe": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
                    n_group=4, topk_group=2, norm_topk_prob=True, head_dim=8), 1),
  "inkling_text": (_INKLING, 1),
  "inkling_mm_model": (_INKLING, 1),
  "inkling2_text": (_INKLING2, 1),
  "inkling2": (_INKLING2, 1),
  "inkling2_loop_text": (dict(**_INKLING2, loop_layer_index_start=1, loop_layer_index_end=2), 1),
  "inkling2_loop": (dict(**_INKLING2, loop_layer_index_start=1, loop_layer_index_end=2), 1),
  "nemotron_h": (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                      moe_shared_expert_intermediate_size=12, moe_latent_size=8, n_group=4,
                      topk_group=2, routed_scaling_factor=1.5, intermediate_size=24,
                      layers_block_type=["mamba", "moe", "moe"], mamba_num_heads=2,
                      mamba_head_dim=16, ssm_state_size=8, n_groups=1), 1),
  # text experts 24 wide, vision experts 20; head_dim 8's rotary sections
  "ernie4_5_vl_moe": (dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=[24, 20],
                           intermediate_size=24, moe_num_shared_experts=1,
                           rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                mrope_section=[1, 1, 2])), 1),
  # layer 1 clamps (routed and shared at limits of their own that bind), layer 2 does not
  "step3p7": (dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                   intermediate_size=24, share_expert_dim=12, head_dim=8,
                   moe_router_scaling_factor=1.5, mlp_layer_types=["dense", "sparse", "sparse"],
                   swiglu_limits=[0, 0.5, 0], swiglu_limits_shared=[0, 0.7, 0]), 1),
  # ZAYA routes one expert of four or its skip class (transformers allows K = 1 only)
  "zaya": (dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=24,
                router_hidden_size=8, head_dim=8), 1),
  "muse_spark_text": (_MUSE_SPARK, 1),
  "muse_spark": (_MUSE_SPARK, 1),  # the multimodal model, as released
  "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                   swiglu_limit=1.0, head_dim=8, **_TYPES), 2),
  # 18 experts: product keys of 4 + 4 logits reach the first 16
  "doge": (dict(num_experts=18, num_experts_per_tok=3, intermediate_size=24, is_moe=True), 1),
  "llama4_text": (dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=24,
                       intermediate_size_mlp=24, interleave_moe_layer_step=2,
                       no_rope_layers=[1] * LAYERS, head_dim=8), 1),
  "longcat_flash": (dict(n_routed_experts=4, zero_expert_num=2, moe_topk=2,
                         expert_ffn_hidden_size=24, ffn_hidden_size=24,
                         routed_scaling_factor=1.5, head_dim=4,
                         num_hidden_layers=2 * LAYERS, **MLA), 1),  # two attentions a layer
  "minimax": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                   head_dim=8, **_TYPES), 2),
  "granitemoe": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24), 2),
  "granitemoeshared": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                            shared_intermediate_size=12), 2),
  "granitemoe_swa": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                          shared_intermediate_size=12), 2),
  "granitemoehybrid": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                            shared_intermediate_size=12, mamba_n_heads=2, mamba_d_head=16,
                            mamba_d_state=8, mamba_n_groups=1,
                            layer_types=["mamba", "attention", "mamba"]), 2),
  "jetmoe": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                  kv_channels=8), 2),
  "gemma4_text": (_GEMMA4, 1),
  "gemma4": (_GEMMA4, 1),  # the multimodal model, as released
  "jamba": (dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24,
                 expert_layer_period=2, expert_layer_offset=1, attn_layer_period=1,
                 attn_layer_offset=0), 1),
  "ernie4_5_moe": (dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=24,
                        intermediate_size=24, moe_layer_start_index=1,
                        moe_num_shared_experts=1), 2),
  "hunyuan_v1_moe": (dict(num_experts=4, moe_topk=2, intermediate_size=24, head_dim=8), 2),
  "lfm2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                    intermediate_size=24, num_dense_layers=1, routed_scaling_factor=1.5,
                    **_TYPES), 2),
  "dbrx": (dict(d_model=16, n_heads=2, n_layers=LAYERS, attn_config=dict(kv_n_heads=2,
                rope_theta=1e4), ffn_config=dict(moe_num_experts=4, moe_top_k=2,
                ffn_hidden_size=24)), 2),
}  # fmt: skip
# Text models of vision-language models saved alone (their `_text` model types): the fields
# of the model they come from.
_TEXT_MODELS = ("minimax_m3_vl", "glm5_next", "hy_v4_vl", "mistral_large4")
FAMILIES.update({f"{model_type}_text": FAMILIES[model_type] for model_type in _TEXT_MODELS})

# The norm a family's block applies to its output, which moejax leaves to the decoder layer
# (where the checkpoint stores it): the comparison applies it to moejax's output.
OUTPUT_NORM = {"axk1": "post_mlp_layernorm"}
# The shared MLP a family's decoder layer runs beside its block, which moejax's layer holds:
# the comparison adds it to the block's output.
BESIDE_BLOCK = dict.fromkeys(
  ("granitemoeshared", "granitemoe_swa", "granitemoehybrid"), "shared_mlp"
)

# Causal LMs that transformers' AutoModelForCausalLM does not map.
_CAUSAL_LM = {"mistral4": "Mistral4ForCausalLM"}
# Text models of vision-language models, saved alone as the base models they are.
_BASE_MODEL = (
  "qwen3_vl_moe_text",
  "glm4v_moe_text",
  "muse_spark_text",
  "glm5_next_text",
  "hy_v4_vl_text",
  "mistral_large4_text",
)
# Vision-language models as released: their class, a tiny vision tower; the fields above are
# their `text_config`'s.
_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=16)
_GEMMA4_VISION = dict(
  hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
  num_key_value_heads=2, head_dim=8,
)  # fmt: skip
# DeepSeek-OCR-2's and Unlimited-OCR's SAM encoders
_SAM = dict(hidden_size=16, output_channels=16, num_hidden_layers=2, num_attention_heads=2,
            image_size=64, patch_size=16, window_size=2, global_attn_indexes=[1])  # fmt: skip
_OCR_ENCODER = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2)  # fmt: skip
# Dots3-Note's vision tower (an MoE of its own, not read) and audio tower
_DOTS3_NOTE_VISION = dict(
  hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
  moe_intermediate_size=16, num_local_experts=2, num_experts_per_tok=1, adapter_in_dim=16,
  adapter_out_dim=16, mlp_layer_types=["dense"],
)  # fmt: skip
# Multimodal models' towers besides the vision tower
_OTHER_TOWERS = {
  "qwen3_omni_moe": dict(
    audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2,
                      encoder_ffn_dim=16, output_dim=16, downsample_hidden_size=16),
  ),
  "inkling_mm_model": dict(
    audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2),
  ),
  "muse_spark": dict(
    audio_config=dict(patch_sizes=[2], hidden_sizes=[16], depths=[1], num_hidden_layers=1,
                      out_hidden_size=16),
    out_hidden_size=16, projector_hidden_size=16,
  ),
  "dots3_note": dict(
    audio_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, downsample_hidden_size=16, adapter_input_size=16,
                      adapter_out_dim=16, feature_size=16),
  ),
}  # fmt: skip
_INKLING2_VISION = dict(
  hidden_size=16, num_hidden_layers=1, num_attention_heads=2, posemb_grid_size=2,
  projection_hidden_dim=16, text_hidden_size=16,
)  # fmt: skip
_MUSE_SPARK_VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=16, pos_emb_height=2, pos_emb_width=2)  # fmt: skip
_MULTIMODAL = {
  "muse_spark": (
    "MuseSparkForConditionalGeneration",
    _MUSE_SPARK_VISION,
  ),
  "qwen3_vl_moe": (
    "Qwen3VLMoeForConditionalGeneration",
    dict(**_VISION, deepstack_visual_indexes=[0]),
  ),
  "glm4v_moe": ("Glm4vMoeForConditionalGeneration", _VISION),
  "mistral_large4": (
    "MistralLarge4ForConditionalGeneration",
    dict(
      hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8
    ),
  ),
  "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", _VISION),
  "qwen4_exp": ("Qwen4ExpForConditionalGeneration", _VISION),
  "dots3_note": ("Dots3NoteForConditionalGeneration", _DOTS3_NOTE_VISION),
  "glm5_next": (
    "Glm5NextForConditionalGeneration",
    dict(
      depth=1,
      hidden_size=16,
      num_heads=2,
      out_hidden_size=16,
      intermediate_size=16,
      projection_intermediate_size=16,
    ),
  ),
  "minimax_m3_vl": (
    "MiniMaxM3SparseForConditionalGeneration",
    dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2),
  ),
  "deepseek_ocr2": (
    "DeepseekOcr2ForConditionalGeneration",
    dict(
      sam_config=dict(**_SAM, downsample_channels=[16, 16]),
      encoder_config=dict(**_OCR_ENCODER, vocab_size=32, num_key_value_heads=2),
    ),
  ),
  "unlimited_ocr": (
    "UnlimitedOcrForConditionalGeneration",
    dict(sam_config=_SAM, encoder_config=_OCR_ENCODER),
  ),
  "hy_v4_vl": (
    "HYV4VLForConditionalGeneration",
    dict(
      hidden_size=16,
      intermediate_size=16,
      num_hidden_layers=1,
      num_attention_heads=2,
      out_hidden_size=16,
    ),
  ),
  "gemma4": ("Gemma4ForConditionalGeneration", _GEMMA4_VISION),
  **{
    model_type: (f"{name}ForConditionalGeneration", _INKLING2_VISION)
    for model_type, name in (("inkling2", "Inkling2"), ("inkling2_loop", "Inkling2Loop"))
  },
  "ernie4_5_vl_moe": (
    "Ernie4_5_VLMoeForConditionalGeneration",
    dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16),
  ),
  "inkling_mm_model": (
    "InklingForConditionalGeneration",
    dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2),
  ),
  "step3p7": (
    "Step3p7ForConditionalGeneration",
    dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2),
  ),
  "qwen3_omni_moe": (
    "Qwen3OmniMoeForConditionalGeneration",
    dict(**_VISION, deepstack_visual_indexes=[0]),
  ),
}


def hf_checkpoint(model_type: str, fields: dict, path, seed: int):
  """A tiny model with random weights (biases and buffers too), saved with save_pretrained."""
  import torch
  import transformers

  if model_type == "dbrx":  # its own names for the attention sizes
    config = transformers.AutoConfig.for_model(model_type, vocab_size=32, **fields)
  elif model_type in _MULTIMODAL:
    text = dict(**ATTENTION, num_hidden_layers=LAYERS, **fields)
    towers = dict(text_config=text, vision_config=_MULTIMODAL[model_type][1])
    towers.update(_OTHER_TOWERS.get(model_type, {}))
    if model_type == "qwen3_omni_moe":  # its thinker holds them; no talker (no audio output)
      towers = dict(thinker_config=towers, enable_audio_output=False)
    config = transformers.AutoConfig.for_model(model_type, **towers)
  else:
    layers = fields.pop("num_hidden_layers", LAYERS)
    config = transformers.AutoConfig.for_model(
      model_type, **ATTENTION, num_hidden_layers=layers, **fields
    )
  torch.manual_seed(seed)
  if model_type in _MULTIMODAL or model_type in _CAUSAL_LM:
    name = _MULTIMODAL[model_type][0] if model_type in _MULTIMODAL else _CAUSAL_LM[model_type]
    model = getattr(transformers, name)(config)
  elif model_type in _BASE_MODEL:
    model = transformers.AutoModel.from_config(config)
  else:
    model = transformers.AutoModelForCausalLM.from_config(config)
  model = model.float().eval()
  with torch.no_grad():
    for tensor in [*model.parameters(), *model.buffers()]:
      if tensor.is_floating_point():
        tensor.normal_(0.0, 0.4)
    for name, table in model.named_buffers():
      if name.endswith("tid2eid"):  # token id -> K distinct experts (DeepSeek-V4's hash routes)
        experts = model.config.get_text_config().n_routed_experts
        rows = [torch.randperm(experts)[: table.shape[1]] for _ in range(table.shape[0])]
        table.copy_(torch.stack(rows))
  model.save_pretrained(path)
  return model
