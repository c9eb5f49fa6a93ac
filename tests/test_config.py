"""MoEConfig validation: every bad field raises ValueError naming it."""

import jax.numpy as jnp
import pytest

from moejax import MoEConfig

BASE = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(num_experts=0), "num_experts"),
    (dict(hidden_size=-1), "hidden_size"),
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(top_k=9), "top_k=9"),
    (dict(top_k=0), "top_k=0"),
    (dict(activation="relu2"), "activation"),
    (dict(scoring="tanh"), "scoring"),
    (dict(expert_backend="cuda"), "expert_backend"),
    (dict(dispatch="ring"), "dispatch"),
    (dict(activation="swiglu"), "activation"),
    (dict(activation="swiglu_oai", swiglu_limit=0.0), "swiglu_limit"),
    (dict(scoring="sparsemixer", top_k=3), "needs top_k=2"),
    (dict(scoring="sparsemixer", renormalize=True), "takes neither renormalize"),
    (dict(scoring="sparsemixer", sparsemixer_eps=-0.1), "sparsemixer_eps"),
    (dict(apply_router_weight_on_input=True), "apply_router_weight_on_input needs top_k=1"),
    (dict(num_zero_experts=-1), "num_zero_experts"),
    (dict(num_zero_experts=2, num_expert_groups=2, topk_groups=1, top_k=1), "num_zero_experts"),
    (dict(shared_expert_gate=True), "shared_expert_gate needs shared experts"),
    (dict(num_expert_groups=3), "num_expert_groups=3"),
    (dict(num_expert_groups=4, topk_groups=5), "topk_groups=5"),
    (dict(num_expert_groups=4, topk_groups=0), "topk_groups=0"),
    (dict(num_expert_groups=4, topk_groups=1, top_k=3), "top_k=3"),
    (dict(num_expert_groups=8, topk_groups=2, use_routing_bias=True), "groups of 1 need >= 2"),
    (dict(num_expert_groups=8, topk_groups=2, group_score="top2_sum"), "groups of 1 need >= 2"),
    (dict(group_score="sum"), "group_score must be one of"),
    (dict(dropped_groups="masked"), "dropped_groups must be one of"),
    (dict(routing_bias_on="logits"), "routing_bias_on='logits' needs use_routing_bias=True"),
    (dict(num_shared_experts=1), "shared_intermediate_size"),
    (dict(shared_intermediate_size=8), "num_shared_experts"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(shared_scaling_factor=-1.0), "shared_scaling_factor must be > 0"),
    (dict(shared_activation="relu2"), "shared_activation must be one of"),
    (dict(up_softcap=0.0), "up_softcap must be > 0"),
    (dict(shared_swiglu_limit=0.0), "shared_swiglu_limit must be > 0 or None"),
    (
      dict(shared_expert_scores=True, num_shared_experts=3, shared_intermediate_size=10),
      "shared_intermediate_size divides by num_shared_experts",
    ),
    (
      dict(shared_expert_scores=True, num_shared_experts=2, shared_intermediate_size=8),
      "needs renormalize=True and scoring 'sigmoid' or 'sqrtsoftplus'",
    ),
    (
      dict(
        shared_expert_scores=True,
        num_shared_experts=2,
        shared_intermediate_size=8,
        renormalize=True,
        scoring="sigmoid",
        shared_expert_gate=True,
      ),
      "both weigh the shared experts",
    ),
    (dict(latent_size=-8), "latent_size must be >= 0"),
    (dict(latent_size=8, num_zero_experts=2), "neither num_zero_experts"),
    (dict(zero_expert_output="skip"), "zero_expert_output must be one of"),
    (dict(zero_expert_output="none"), "zero_expert_output='none' describes zero experts"),
    (dict(external_router=True, router_bias=True), "external_router: the logits come with"),
    (dict(latent_norm_eps=1e-6), "latent_norm_eps normalizes the latent rows: it needs latent"),
    (dict(latent_size=8, latent_norm_eps=0.0), "latent_norm_eps must be None or a finite num"),
    (dict(expert_output_norm_eps="1e-6"), "expert_output_norm_eps must be None or a finite"),
    (
      dict(expert_output_norm_eps=1e-6, top_k=1, apply_router_weight_on_input=True),
      "would undo the weight",
    ),
    (dict(router_logit_softcap=-1.0), "router_logit_softcap must be >= 0"),
    (dict(dtype=jnp.int32), "dtype"),
    (dict(param_dtype=jnp.int8), "param_dtype"),
    (dict(data_axis="x", expert_axis="x"), "mesh axis 'x' is in both"),
    (dict(data_axis=("data", "tensor"), expert_axis=("expert", "tensor")), "'tensor' is in both"),
    (dict(expert_axis=("expert", "expert")), "names mesh axis 'expert' more than once"),
    (dict(expert_axis=()), "expert_axis must be a mesh axis name or a tuple of names"),
    (dict(data_axis=["data"]), "data_axis must be a mesh axis name or a tuple of names"),
    (dict(expert_fsdp=1), "expert_fsdp must be a bool, got 1"),
    (dict(save_dispatched_rows="yes"), "save_dispatched_rows must be a bool"),
    (dict(use_routing_bias="False"), "use_routing_bias must be a bool, got 'False'"),
    (dict(num_expert_groups=2.0), "num_expert_groups must be an int, got 2.0"),
    (dict(routed_scaling_factor="2.5"), "routed_scaling_factor must be a finite number"),
    (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor must be a finite number"),
    (dict(lora_rank=-1), "lora_rank must be an int >= 0"),
    (dict(lora_rank=4, lora_alpha=0.0), "lora_alpha must be > 0"),
    (dict(lora_rank=4, lora_rslora=1), "lora_rslora must be a bool"),
  ],
)
def test_bad_field_raises_naming_it(overrides, message):
  with pytest.raises(ValueError, match=message):
    MoEConfig(**{**BASE, **overrides})


def test_config_is_hashable_and_dtypes_normalised():
  a = MoEConfig(**BASE, dtype=jnp.bfloat16)
  b = MoEConfig(**BASE, dtype=jnp.dtype("bfloat16"))
  assert a == b and hash(a) == hash(b)
  assert a.dtype == jnp.dtype(jnp.bfloat16)


def test_the_activation_type_names_the_table():
  """`MoEConfig.activation`'s type lists exactly the activations `moejax.activations` has."""
  from typing import get_args

  from moejax.activations import GATED
  from moejax.config import Activation

  assert get_args(Activation) == tuple(GATED)


def test_lora_scale_is_peft_s():
  """PEFT scales an adapter by lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
  assert MoEConfig(**BASE, lora_rank=16, lora_alpha=8.0).lora_scale == 0.5
  assert MoEConfig(**BASE, lora_rank=16, lora_alpha=8.0, lora_rslora=True).lora_scale == 2.0
  assert MoEConfig(**BASE).lora_scale == 0.0


def test_every_format_takes_its_own_default_block():
  """No `quant_block_size`: each format quantizes in its own block (fp8_block's output side
  cut to divide F), so the defaults build at small sizes."""
  from kernels_pallas.formats import FORMATS

  sized = dict(BASE, hidden_size=32, intermediate_size=64)
  blocks = {name: MoEConfig(**sized, expert_quant=name).quant_block for name in FORMATS}
  assert blocks == {
    "fp8_block": (128, 64),
    "mxfp4": (32, 1),
    "int4_group": (32, 1),
    "nvfp4": (16, 1),
  }
  assert MoEConfig(**BASE, expert_quant="fp8_block", quant_block_size=(16, 16)).quant_block == (
    16,
    16,
  )
