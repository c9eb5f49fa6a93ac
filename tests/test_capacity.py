"""all_to_all's receive capacity beyond the layer contract (which runs every check with it,
`TestAllToAllCapacity`): adapters over quantized experts and the kept dispatched rows through
overflowed chunks, the buffers the plan sizes, and the config's errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import MoEConfig, moe_apply, plan_call, quant, reference_moe
from moejax.testing import poison, random_params
from tests.helpers import BASE, assert_close, mesh_of, random_adapters, seed_of

CONFIG = MoEConfig(**{**BASE, "chunk_size": 8}, dispatch="all_to_all", receive_capacity_factor=0.5)
TOKENS = 64  # 8 per device: one chunk each


def to_the_first_experts(config: MoEConfig) -> jax.Array:
  """[T, K] ids 0..K-1 for every token: experts 0 and 1, both on expert rank 0 of a 2x4
  mesh, which receives 4 x 8 rows per chunk against a capacity of 8."""
  return jnp.tile(jnp.arange(config.top_k, dtype=jnp.int32), (TOKENS, 1))


def test_adapters_over_quantized_experts_train_through_overflowed_chunks(request):
  """fp8 experts under LoRA adapters, every chunk overflowed: the output and the adapters'
  gradients are the reference's."""
  seed = seed_of(request.node.name)
  float_config = dataclasses.replace(CONFIG, lora_rank=2, quant_block_size=(8, 8))
  key = jax.random.key(seed)
  expert, _ = random_adapters(float_config, key)
  params = random_params(float_config, key)._replace(lora=expert)
  params, config = quant.quantize_experts(params, float_config, "fp8_block")
  x = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, config.hidden_size))
  mask = jax.random.bernoulli(jax.random.fold_in(key, 2), 0.9, (TOKENS,))
  ids = to_the_first_experts(config)
  mesh = mesh_of(2, 4)

  def loss(lora, layer):  # layer: params -> (y, its aux or None)
    y, aux = layer(params._replace(lora=lora))
    return jnp.sum(jnp.where(mask[:, None], y, 0.0) ** 2), (y, aux)

  ours = lambda p: moe_apply(
    p, poison(x, mask), config=config, mesh=mesh, token_mask=mask, expert_ids=ids
  )
  theirs = lambda p: (reference_moe(p, x, config, mask, expert_ids=ids), None)
  (_, (y, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params.lora, ours)
  (_, (want, _)), want_grads = jax.value_and_grad(loss, has_aux=True)(params.lora, theirs)
  assert int(np.sum(aux.overflowed_chunks)) > 0
  assert_close(y, want, what="y")
  for name, got, expected in zip(grads._fields, grads, want_grads, strict=True):
    assert_close(got, expected, what=f"d lora.{name}")


def test_the_kept_dispatched_rows_replay_through_overflowed_chunks(request):
  """With `save_dispatched_rows` the backward pass reuses each chunk's in-flight value: an
  overflowed chunk's holds nothing, and its gradient comes from the sub-chunks again."""
  config = dataclasses.replace(CONFIG, save_dispatched_rows=True)
  key = jax.random.key(seed_of(request.node.name))
  params = random_params(config, key)
  x = jax.random.normal(jax.random.fold_in(key, 1), (TOKENS, config.hidden_size))
  ids = to_the_first_experts(config)
  loss = lambda p, layer: jnp.sum(layer(p) ** 2)
  ours = lambda p: moe_apply(p, x, config=config, mesh=mesh_of(2, 4), expert_ids=ids)[0]
  grads = jax.grad(loss)(params, ours)
  want = jax.grad(loss)(params, lambda p: reference_moe(p, x, config, expert_ids=ids))
  for name in ("w_gate_up", "w_down", "router_kernel"):
    assert_close(getattr(grads, name), getattr(want, name), what=f"d {name}")


def test_the_plan_sizes_the_buffers_at_capacity():
  """The call plan's received rows: 0.5 x C x min(K, S) rounded up to 8, at least S, at most
  S·C; `chunk_size="auto"` budgets for them, so a capacity allows a larger chunk."""
  big = dataclasses.replace(
    CONFIG, num_experts=256, top_k=8, hidden_size=512, chunk_size="auto", chunk_memory_bytes=1 << 24
  )
  mesh = jax.sharding.AbstractMesh((1, 64), ("data", "expert"))
  with_capacity = plan_call(big, (64 * 4096, 512), mesh=mesh)
  worst = plan_call(
    dataclasses.replace(big, receive_capacity_factor=None), (64 * 4096, 512), mesh=mesh
  )
  chunk = with_capacity.layout.chunk
  assert with_capacity.received_rows == 8 * -(-4 * chunk // 8) < 64 * chunk
  assert worst.received_rows == 64 * worst.layout.chunk
  assert chunk >= 4 * worst.layout.chunk


@pytest.mark.parametrize(
  "overrides, message",
  [
    (dict(receive_capacity_factor=0.0), "receive_capacity_factor must be a number > 0"),
    (dict(receive_capacity_factor=True), "receive_capacity_factor must be a number > 0"),
    (dict(dispatch="auto"), "receive_capacity_factor sizes all_to_all's receive buffers"),
  ],
)
def test_a_bad_capacity_is_named(overrides, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(CONFIG, **overrides)
