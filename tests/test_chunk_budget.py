"""`chunk_size="auto"`: the chunk follows the memory budget, checked against the compiled
program's `memory_analysis()` on the 2x4 mesh (abstract inputs: nothing is allocated)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import pytest

from moejax import MoEConfig, MoEParams, chunk_layout, moe_apply, param_shapes, plan_call
from moejax.chunk_budget import auto_chunk, budget_bytes, chunk_bytes, outside_chunks
from moejax.quant import quantize_experts
from moejax.testing import random_params, rank_mask
from tests.helpers import check_against_reference, count_compiles, mesh_of, seed_of, slow

MIB = 1 << 20
BASE = dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=256)
S, DEVICES = 4, 8  # the 2x4 mesh


def compiled_temp(config: MoEConfig, tokens: int, grad: bool, params=None) -> int:
  """Temporary bytes of the compiled layer (forward, or its gradient in x and the params)."""
  if params is None:
    shapes = param_shapes(config)
    params = MoEParams(**{k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()})
  x = jax.ShapeDtypeStruct((tokens, config.hidden_size), jnp.float32)
  forward = lambda p, x: moe_apply(p, x, config=config, mesh=mesh_of(2, 4))[0]
  wrt = (1,) if config.expert_quant else (0, 1)  # quantized experts are constants
  loss = lambda p, x: jnp.sum(forward(p, x).astype(jnp.float32))
  program = jax.grad(loss, argnums=wrt) if grad else forward
  return jax.jit(program).lower(params, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
  "scheme, grad",
  [
    pytest.param("all_gather", False, id="forward-all_gather"),
    slow("all_gather", True, id="gradient-all_gather"),
    slow("all_to_all", False, id="forward-all_to_all"),
    pytest.param("all_to_all", True, id="gradient-all_to_all"),
  ],
)
def test_what_a_chunk_adds_stays_within_the_budget(scheme, grad):
  """At 65,536 tokens per device the chunk "auto" picks adds at most its `chunk_bytes` to the
  compiled temp (against chunks of 8 rows), and those fit the budget; the whole temp is at
  most the budget plus what no chunk bounds (`outside_chunks`)."""
  config = MoEConfig(**BASE, dispatch=scheme, chunk_memory_bytes=16 * MIB)
  tokens = 65536 * DEVICES
  call = plan_call(config, (tokens, config.hidden_size), mesh=mesh_of(2, 4))
  layout = call.layout
  assert 8 < layout.chunk < layout.share and layout.share % layout.chunk == 0, layout
  temp = compiled_temp(config, tokens, grad)
  smallest = compiled_temp(dataclasses.replace(config, chunk_size=8), tokens, grad)
  estimate = chunk_bytes(config, layout.chunk, S, scheme, call.expert.path)
  assert estimate <= 16 * MIB
  assert temp - smallest <= estimate, (temp - smallest) / MIB
  assert temp <= 16 * MIB + outside_chunks(config, layout.local, 2), temp / MIB


@pytest.mark.parametrize(
  "per_device, scheme",
  [(256, "all_gather"), slow(256, "all_to_all"), slow(512, "all_gather"), (512, "all_to_all")],
  ids=["256-all_gather", "256-all_to_all", "512-all_gather", "512-all_to_all"],
)
def test_small_calls_take_one_chunk_within_the_budget(per_device, scheme):
  config = MoEConfig(**BASE, dispatch=scheme, chunk_memory_bytes=16 * MIB)
  layout = chunk_layout(config, per_device * DEVICES, mesh_of(2, 4))
  assert layout.chunk == layout.share == per_device
  for grad in (False, True):
    temp = compiled_temp(config, per_device * DEVICES, grad)
    assert temp <= 16 * MIB + outside_chunks(config, layout.local, 2), temp / MIB


def test_quantized_experts_and_bf16_within_the_budget():
  config = MoEConfig(**BASE, dtype=jnp.bfloat16, chunk_memory_bytes=8 * MIB)
  tokens = 16384 * DEVICES
  params = random_params(dataclasses.replace(config, dtype=jnp.float32), jax.random.key(0))
  qparams, qconfig = quantize_experts(params, config, "fp8_block")
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), qparams)
  layout = chunk_layout(qconfig, tokens, mesh_of(2, 4))
  assert layout.chunk < layout.share
  for grad in (False, True):
    temp = compiled_temp(qconfig, tokens, grad, abstract)
    assert temp <= 8 * MIB + outside_chunks(qconfig, layout.local, 2), temp / MIB


def test_auto_keeps_the_chunk_contract(request):
  """Chunked by the budget: output and gradients equal the reference's (NaN padding, empty
  ranks), all-padding chunks are skipped, and another token pattern compiles nothing new."""
  config = MoEConfig(**BASE, chunk_memory_bytes=2 * MIB)
  rows = 512
  layout = chunk_layout(config, rows * DEVICES, mesh_of(2, 4))
  assert layout.share // layout.chunk == 8, layout  # 80 rows fit 2 MiB: 8 chunks of 64
  params = random_params(config, jax.random.key(seed_of(request.node.name)))
  x = jax.random.normal(jax.random.key(1), (rows * DEVICES, config.hidden_size))
  mask = rank_mask([0, 512, 100, 3, 0, 0, 0, 0], rows)
  check_against_reference(params, x, config, mesh_of(2, 4), mask, seed=2)
  _, aux = moe_apply(params, x, config=config, mesh=mesh_of(2, 4), token_mask=mask)
  chex.assert_trees_all_equal(aux.chunks_run.tolist(), [8, 8, 8, 8, 0, 0, 0, 0])
  other = rank_mask([3, 0, 0, 512, 7, 0, 64, 0], rows)
  with count_compiles() as compiles:
    moe_apply(params, x, config=config, mesh=mesh_of(2, 4), token_mask=other)
  assert not compiles, "a new token pattern compiled a new program"


def test_the_budget_and_its_errors():
  config = MoEConfig(**BASE)
  assert config.chunk_size == "auto" and budget_bytes(config) == 256 * MIB  # a CPU
  tile_loop = lambda chunk: "tile_loop"
  assert auto_chunk(config, share=100, axis_size=4, scheme="all_gather", path_of=tile_loop) == 100
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="chunk_memory_bytes must be a positive int"):
      MoEConfig(**BASE, chunk_memory_bytes=bad)
  with pytest.raises(ValueError, match='chunk_size must be a positive int or "auto"'):
    MoEConfig(**BASE, chunk_size="large")


def test_the_gpu_budget_is_a_fraction_of_its_memory():
  from kernels_pallas import platform

  config = MoEConfig(**BASE)
  with platform.targeting(platform.Target(platform="gpu", memory_bytes=141 * 10**9)):
    assert budget_bytes(config) == 141 * 10**9 // 16
  with platform.targeting(platform.Target(platform="gpu")):  # an unknown kind, no stats
    assert budget_bytes(config) == 1 << 30
  assert budget_bytes(MoEConfig(**BASE, chunk_memory_bytes=123)) == 123
