"""LoRA adapters on the experts: the typed values, their shapes, PEFT's initialization, merge.

With `MoEConfig.lora_rank` r > 0 every routed expert e computes its two projections as
`x @ (W[e] + s · A[e] @ B[e])`, s = `config.lora_scale` (PEFT's alpha / r, or alpha / sqrt(r)
with rsLoRA), and the shared experts likewise with one `SharedLoRA`. The product A @ B is
never formed in the layer: each projection adds `(x @ A) @ B`, two matmuls of rank r, and
the base weights (float or quantized) stay as stored. The adapters travel in
`MoEParams.lora` / `.shared_lora`; `moejax.MoELayer` holds them as `nnx.LoRAParam`s, so that
`nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)` trains only them.

>>> from moejax.config import MoEConfig
>>> config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, lora_rank=2)
>>> config.lora_scale
4.0

The adapters' shapes are in the layer's `moejax.call_record.CallRecord` (`.lora`,
`.shared_lora`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas.quantized import is_block_scaled
from moejax import meshes
from moejax.config import MoEConfig


class ExpertLoRA(NamedTuple):
  """The routed experts' adapters: one (A, B) pair per projection of each physical expert.

  Attributes:
    gate_up_a: [P, D, r].
    gate_up_b: [P, r, 2F]; its columns as `w_gate_up`'s (gate first, then up).
    down_a: [P, F, r].
    down_b: [P, r, D].
  """

  gate_up_a: jax.Array
  gate_up_b: jax.Array
  down_a: jax.Array
  down_b: jax.Array


class SharedLoRA(NamedTuple):
  """The shared experts' adapters (the fused shared MLP of width Fs).

  Attributes:
    gate_up_a: [D, r].
    gate_up_b: [r, 2Fs].
    down_a: [Fs, r].
    down_b: [r, D].
  """

  gate_up_a: jax.Array
  gate_up_b: jax.Array
  down_a: jax.Array
  down_b: jax.Array


def init_like(shapes: ExpertLoRA | SharedLoRA, key: jax.Array, dtype) -> ExpertLoRA | SharedLoRA:
  """New adapters as PEFT initializes them: each A Kaiming-uniform with a = sqrt(5) (uniform
  in ±1 / sqrt(fan_in), fan_in its input width), each B zero, so that a new adapter leaves
  the layer's output unchanged.

  Args:
    shapes: an `ExpertLoRA` / `SharedLoRA` of shapes, or of anything with a `.shape` (the
      layer's `moejax.call_record.call_record(config).lora`).
    key: the random key.
    dtype: the adapters' dtype.
  """
  keys = jax.random.split(key, 2)
  shapes = type(shapes)(*(tuple(getattr(s, "shape", s)) for s in shapes))

  def a_of(key, shape):
    bound = 1.0 / shape[-2] ** 0.5
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)

  return type(shapes)(
    a_of(keys[0], shapes.gate_up_a),
    jnp.zeros(shapes.gate_up_b, dtype),
    a_of(keys[1], shapes.down_a),
    jnp.zeros(shapes.down_b, dtype),
  )


def scaled(adapters: ExpertLoRA | SharedLoRA, config: MoEConfig, dtype) -> ExpertLoRA | SharedLoRA:
  """The adapters in `dtype` with s folded into each B: what the expert paths compute with
  (`x @ A @ (s · B)`); differentiable, so their gradients reach the stored adapters."""
  scale = config.lora_scale
  return type(adapters)(
    adapters.gate_up_a.astype(dtype),
    (adapters.gate_up_b.astype(jnp.float32) * scale).astype(dtype),
    adapters.down_a.astype(dtype),
    (adapters.down_b.astype(jnp.float32) * scale).astype(dtype),
  )


def merge(params, config: MoEConfig):
  """The layer without adapters that computes what `params` do: each base weight plus
  s · A @ B, in float32 then `config.param_dtype`.

  A quantized base is dequantized first: the merged weights are float (re-quantize them with
  `moejax.quant.quantize_experts` if wanted; the merge is then no longer exact).

  Args:
    params: `MoEParams` with `lora` (and `shared_lora` with shared experts).
    config: their config (`lora_rank` > 0).

  Returns:
    (params without adapters, the config with `lora_rank=0` and `expert_quant=None`).
  """
  if not config.lora_rank or params.lora is None:
    raise ValueError("merge needs adapters: config.lora_rank > 0 and params.lora")

  def merged(w, a, b) -> jax.Array:
    w = _float32(w)
    a, b = (meshes.on_mesh_of(adapter, w) for adapter in (a, b))
    return (w + config.lora_scale * jnp.matmul(a, b, precision="highest")).astype(
      config.param_dtype
    )

  lora = jax.tree.map(_float32, params.lora)
  out = params._replace(
    w_gate_up=merged(params.w_gate_up, lora.gate_up_a, lora.gate_up_b),
    w_down=merged(params.w_down, lora.down_a, lora.down_b),
    lora=None,
  )
  if params.shared_lora is not None:
    shared = jax.tree.map(_float32, params.shared_lora)
    out = out._replace(
      shared_w_gate_up=merged(params.shared_w_gate_up, shared.gate_up_a, shared.gate_up_b),
      shared_w_down=merged(params.shared_w_down, shared.down_a, shared.down_b),
      shared_lora=None,
    )
  return out, dataclasses.replace(config, lora_rank=0, expert_quant=None)


def _float32(w) -> jax.Array:
  return w.dequantize(jnp.float32) if is_block_scaled(w) else jnp.asarray(w, jnp.float32)
