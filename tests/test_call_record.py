"""The call record: what a layer call expects, derived once from the config and the mesh, and
the one check of a call's arguments against it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels_pallas.quantized import BlockScaled
from moejax import MoEConfig, MoELayer, eplb, moe_apply, plan_call, quant, reference_moe
from moejax.call_record import call_record
from moejax.lora import ExpertLoRA, SharedLoRA
from moejax.params import MoEParams
from moejax.testing import abstract_params, random_params

from .helpers import mesh_of

F32, BF16, I32 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int32)
EXPERTS = ("expert", None, None)
REPLICATED_2D = (None, None)

# Every option that adds a parameter, a bf16 layer with replicas and adapters.
WIDE = MoEConfig(
  num_experts=4,
  top_k=2,
  hidden_size=8,
  intermediate_size=16,
  num_shared_experts=1,
  shared_intermediate_size=16,
  shared_expert_gate=True,
  use_routing_bias=True,
  router_bias=True,
  expert_bias=True,
  output_bias=True,
  num_zero_experts=1,
  num_redundant_experts=4,
  lora_rank=2,
  param_dtype="bfloat16",
  shared_fsdp=True,
)
# A latent, fp8-quantized layer without its own router, shared experts scored by the router.
NARROW = MoEConfig(
  num_experts=8,
  top_k=1,
  hidden_size=128,
  intermediate_size=256,
  latent_size=64,
  external_router=True,
  expert_quant="fp8_block",
  expert_fsdp=True,
)


def test_record_of_every_option_is_the_written_expectation():
  record = call_record(WIDE)
  # P = E + R = 8 slots, E + Z = 5 router outputs; the router's parameters float32.
  assert {n: (e.shape, e.dtype, e.spec) for n, e in record.params.items()} == {
    "router_kernel": ((8, 5), F32, (("data", "expert"), None)),
    "w_gate_up": ((8, 8, 32), BF16, EXPERTS),
    "w_down": ((8, 16, 8), BF16, EXPERTS),
    "routing_bias": ((5,), F32, (None,)),
    "shared_w_gate_up": ((8, 32), BF16, (("data", "expert"), None)),
    "shared_w_down": ((16, 8), BF16, (("data", "expert"), None)),
    "router_bias": ((5,), F32, (None,)),
    "b_gate_up": ((8, 32), BF16, ("expert", None)),
    "b_down": ((8, 8), BF16, ("expert", None)),
    "shared_gate_kernel": ((8, 1), BF16, (("data", "expert"), None)),
    "output_bias": ((8,), BF16, (None,)),
  }
  assert [(e.shape, e.dtype, e.spec) for e in record.lora] == [
    ((8, 8, 2), BF16, EXPERTS),
    ((8, 2, 32), BF16, EXPERTS),
    ((8, 16, 2), BF16, EXPERTS),
    ((8, 2, 8), BF16, EXPERTS),
  ]
  assert type(record.lora) is ExpertLoRA and type(record.shared_lora) is SharedLoRA
  assert [e.shape for e in record.shared_lora] == [(8, 2), (2, 32), (16, 2), (2, 8)]
  assert [(e.shape, e.dtype) for e in record.placement] == [((8,), I32), ((4, 5), I32), ((4,), I32)]
  assert record.quantized == {}
  assert record.widths == {"x": 8, "router_logits": 5, "expert_ids": 2}


def test_record_of_a_latent_quantized_layer_is_the_written_expectation():
  record = call_record(NARROW)
  fsdp = ("expert", "data", None)  # expert_fsdp: dim 1 over the data group
  assert {n: (e.shape, e.spec) for n, e in record.params.items()} == {
    "w_gate_up": ((8, 64, 512), fsdp),
    "w_down": ((8, 256, 64), fsdp),
    "latent_in": ((128, 64), (None, None)),
    "latent_out": ((64, 128), (None, None)),
  }
  fp8 = record.quantized["w_down"]
  assert (fp8.values.shape, fp8.values.dtype, fp8.scales.shape, fp8.scales.dtype, fp8.block) == (
    (8, 256, 64),
    jnp.dtype(jnp.float8_e4m3fn),
    (8, 2, 1),
    F32,
    (128, 128),
  )
  assert record.quantized["w_gate_up"].scales.shape == (8, 1, 4)
  assert record.lora is record.shared_lora is record.placement is None
  assert record.widths == {"x": 128, "router_logits": 8, "expert_ids": 1}


@pytest.mark.parametrize(
  "form, scales, global_scale",
  [
    ("mxfp4", ((4, 4, 64), "float8_e8m0fnu"), None),
    ("int4_group", ((4, 4, 64), "bfloat16"), None),
    ("nvfp4", ((4, 8, 64), "float8_e4m3fn"), ((4, 64), "float32")),
  ],
)
def test_record_of_each_quantized_format_matches_what_quantizing_writes(form, scales, global_scale):
  """The scales the record expects for w_gate_up [4, 128, 64] are those `quantize_experts`
  writes (hand-written here, and checked against the real thing)."""
  config = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=32)
  quantized_config = dataclasses.replace(config, expert_quant=form)
  expected = call_record(quantized_config).quantized["w_gate_up"]
  written = (expected.scales.shape, str(expected.scales.dtype))
  glob = expected.global_scale
  assert written == scales
  assert (None if glob is None else (glob.shape, str(glob.dtype))) == global_scale
  params, _ = quant.quantize_experts(random_params(config, jax.random.key(0)), config, form)
  made = params.w_gate_up
  assert (made.scales.shape, str(made.scales.dtype)) == written
  assert made.block == expected.block and made.values.dtype == expected.values.dtype


def test_layer_and_abstract_params_hold_what_the_record_says():
  """`MoELayer`'s variables and `abstract_params` on a 2x4 mesh: the record's shapes,
  dtypes and shardings, leaf for leaf; the record is built once per config and mesh."""
  mesh = mesh_of(2, 4)
  record = call_record(WIDE, mesh)
  assert call_record(WIDE, mesh) is record
  layer = MoELayer(WIDE, mesh=mesh, rngs=nnx.Rngs(0))
  made, abstract = layer.moe_params(), abstract_params(WIDE, mesh)
  assert jax.tree.structure(made) == jax.tree.structure(abstract)
  for real, want in zip(jax.tree.leaves(made), jax.tree.leaves(abstract), strict=True):
    assert (real.shape, real.dtype) == (want.shape, want.dtype)
    assert real.sharding.is_equivalent_to(want.sharding, real.ndim)
  assert [tuple(a.shape) for a in layer.placement.get_value()] == [
    e.shape for e in record.placement
  ]


CONFIG = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16)
TOKENS = 6


def _arguments(config=CONFIG):
  key = jax.random.key(3)
  return dict(
    params=random_params(config, key),
    x=jax.random.normal(key, (TOKENS, config.hidden_size)),
  )


# One wrong argument of each kind, and the message the check names it with.
WRONG = {
  "param shape": (
    lambda a: a["params"]._replace(w_down=a["params"].w_down[:, :8]),
    "params",
    r"params.w_down has shape \(4, 8, 8\), expected \(4, 16, 8\)",
  ),
  "x width": (
    lambda a: a["x"][:, :4],
    "x",
    r"x has shape \(6, 4\); expected \[..., hidden_size=8\]",
  ),
  "token_mask shape": (
    lambda a: jnp.ones(TOKENS + 1, bool),
    "token_mask",
    r"token_mask has shape \(7,\); expected x.shape\[:-1\]=\(6,\)",
  ),
  "router_logits width": (
    lambda a: jnp.zeros((TOKENS, 5)),
    "router_logits",
    r"router_logits has shape \(6, 5\); expected \(6, 4\)",
  ),
  "expert_ids width": (
    lambda a: jnp.zeros((TOKENS, 3), jnp.int32),
    "expert_ids",
    r"expert_ids has shape \(6, 3\); expected \[..., top_k\] = \(6, 2\)",
  ),
}


@pytest.mark.parametrize("kind", WRONG)
@pytest.mark.parametrize("call", [moe_apply, reference_moe], ids=["moe_apply", "reference"])
def test_a_wrong_argument_of_each_kind_is_named(kind, call):
  make, name, message = WRONG[kind]
  arguments = _arguments()
  arguments[name] = make(arguments)
  with pytest.raises(ValueError, match=f"^{message}$"):
    call(**arguments, config=CONFIG)


def test_wrong_adapters_scales_and_placement_are_named():
  """The record's nested parts: an adapter, a quantized matrix's scales, a placement field."""
  adapted = dataclasses.replace(CONFIG, lora_rank=2)
  arguments = _arguments(adapted)
  wrong = ExpertLoRA(*(jnp.zeros(s) for s in ((4, 8, 2), (4, 2, 32), (4, 16, 3), (4, 3, 8))))
  message = r"^params.lora.down_a has shape \(4, 16, 3\), expected \(4, 16, 2\)$"
  with pytest.raises(ValueError, match=message):
    moe_apply(arguments["params"]._replace(lora=wrong), arguments["x"], config=adapted)

  params, fp8 = quant.quantize_experts(_arguments()["params"], CONFIG, "fp8_block")
  scales = params.w_down.scales
  params = params._replace(w_down=BlockScaled(params.w_down.values, scales[:, :0], (128, 16)))
  message = r"^params.w_down has scales shape \(4, 0, 1\), expected \(4, 1, 1\) for"
  with pytest.raises(ValueError, match=message):
    moe_apply(params, _arguments()["x"], config=fp8)

  replicated = dataclasses.replace(CONFIG, num_redundant_experts=2)
  arguments = _arguments(replicated)
  placement = eplb.initial_placement(4, 2)
  placement = placement._replace(replica_counts=np.ones(3, np.int32))
  message = r"^placement.replica_counts has shape \(3,\), expected \(4,\) \(E=4, P=E\+R=6\)$"
  with pytest.raises(ValueError, match=message):
    moe_apply(**arguments, config=replicated, placement=placement)


def test_combine_weights_of_another_shape_than_the_ids_are_named():
  ids = jnp.tile(jnp.arange(2, dtype=jnp.int32), (TOKENS, 1))
  message = r"^combine_weights has shape \(6, 1\); expected expert_ids' shape \(6, 2\)$"
  for call in (moe_apply, reference_moe):
    with pytest.raises(ValueError, match=message):
      call(**_arguments(), config=CONFIG, expert_ids=ids, combine_weights=jnp.ones((TOKENS, 1)))


def test_a_mesh_that_does_not_fit_is_named_by_every_reader():
  """`moe_apply`, `MoELayer` and `plan_call` check the mesh through the same record."""
  mesh = mesh_of(1, 8)
  config = dataclasses.replace(CONFIG, num_experts=12)
  message = r"^num_experts=12 must be divisible by the size of expert_axis='expert', 8$"
  with pytest.raises(ValueError, match=message):
    plan_call(config, (TOKENS, 8), mesh=mesh)
  with pytest.raises(ValueError, match=message):
    MoELayer(config, mesh=mesh, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    moe_apply(**_arguments(config), config=config, mesh=mesh)


def test_a_config_of_another_type_is_refused_before_a_record_is_built():
  with pytest.raises(TypeError, match=r"^config must be a MoEConfig, got dict$"):
    moe_apply(MoEParams(), jnp.ones((2, 8)), config={})
