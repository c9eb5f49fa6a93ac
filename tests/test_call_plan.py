"""`moejax.plan_call`: the decisions of a call, each with its reason, and the call runs them."""

import dataclasses

import jax
import pytest
from flax import nnx

from kernels_pallas import platform
from moejax import MoEConfig, MoELayer, chunk_layout, moe_apply, plan_call
from moejax.testing import poison, rank_mask
from tests.helpers import BASE, mesh_of

CONFIG = MoEConfig(**BASE)
HOPPER = platform.Target(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100")


def test_the_layer_runs_what_its_plan_says():
  """Chunk and layout from the plan: no device runs more chunks than it has, the device
  holding every row runs them all; the layer's plan is `plan_call`'s on its mesh."""
  mesh = mesh_of(2, 4)
  layer = MoELayer(CONFIG, mesh=mesh, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8 * 12, CONFIG.hidden_size))
  call = layer.plan(x)
  assert call == plan_call(CONFIG, x.shape, mesh=mesh)
  assert call.layout == chunk_layout(CONFIG, x.shape[0], mesh)
  assert (call.layout.devices, call.layout.share, call.layout.chunk) == (8, 12, 4)
  assert call.chunks == 3 and call.chunk_reason == "config.chunk_size=4"
  assert call.received_rows == 4 * call.layout.chunk and call.exchange.local_experts == 2
  mask = rank_mask([12, 0, 5, 12, 3, 12, 0, 1], 12)
  _, aux = moe_apply(layer.moe_params(), poison(x, mask), config=CONFIG, mesh=mesh, token_mask=mask)
  assert max(aux.chunks_run.tolist()) == call.chunks
  with pytest.raises(
    ValueError, match=r"x has shape \(3, 5\): expected \[\.\.\., hidden_size=16\]"
  ):
    plan_call(CONFIG, (3, 5))


def test_each_decision_names_its_evidence():
  auto = dataclasses.replace(CONFIG, chunk_size="auto", chunk_memory_bytes=1 << 16)
  call = plan_call(auto, (4096, 16))
  assert call.chunk_reason.startswith("chunk_size='auto': the largest that fits")
  assert "(config.chunk_memory_bytes)" in call.chunk_reason
  assert sum(b for _, b in call.chunk_terms) <= call.budget == 1 << 16 and call.chunks > 1
  assert "no recorded run measured all_to_all faster on cpu" in call.scheme_reason
  scheme = plan_call(
    dataclasses.replace(CONFIG, dispatch="all_to_all"), (64, 16), mesh=mesh_of(2, 4)
  )
  assert (scheme.scheme, scheme.scheme_reason) == ("all_to_all", "config.dispatch='all_to_all'")
  xla = dataclasses.replace(CONFIG, expert_backend="xla", chunk_size="auto")
  with platform.targeting(HOPPER):  # a GPU's decisions, planned on this CPU
    gpu = plan_call(xla, (256, 16))  # 512 (row, choice) assignments: ragged_dot's largest
    large = plan_call(xla, (257, 16))
    many_experts = plan_call(dataclasses.replace(xla, num_experts=33, top_k=1), (2, 16))
    fp8 = dataclasses.replace(xla, expert_quant="fp8_block")  # its block cut to F = 24
    quantized = plan_call(fp8, (256, 16))
  assert gpu.target.platform == "gpu" and gpu.expert.path == "ragged_dot" and gpu.tile_rows is None
  assert gpu.expert_reason.startswith("ragged_dot: 512 rows over 8 local experts on a GPU")
  assert large.expert.path == "tile_loop" and large.tile_rows >= 8
  assert "514 rows, more than the 512" in large.expert_reason
  assert many_experts.expert.path == "tile_loop"
  assert "33 local experts, more than the 32" in many_experts.expert_reason
  assert quantized.expert.path == "tile_loop"
  assert quantized.expert_reason == (
    "the tile loop; ragged_dot cannot run this case: xla takes no fp8_block (BlockScaled) weights"
  )
  with pytest.raises(TypeError, match=r"x must be the tokens .*got 5: for T tokens pass"):
    plan_call(CONFIG, 5)
  one_token = plan_call(CONFIG, (1, 16))
  assert str(one_token).startswith("on cpu: 1 token over 1 device(s)"), str(one_token)
  interpreted = plan_call(dataclasses.replace(CONFIG, expert_backend="pallas"), (64, 16))
  assert interpreted.expert.interpret and "interpreter" in interpreted.expert_warning
  assert "experts: pallas" in str(interpreted) and "warning:" in str(interpreted)
