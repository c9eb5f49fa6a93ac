"""Stand-in weights and inputs, shared by tests, benchmarks, tuning and users: random weights of
every parameter a config needs, the same as abstract shapes laid out on a mesh (to compile a
call without memory, e.g. for compile-only GPUs), padding rows poisoned with NaN, which proves
that no masked row reaches an output, and the tolerances a result is checked with.

>>> config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16)
>>> abstract_params(config).w_gate_up.shape
(4, 8, 32)
>>> poison(jnp.ones((3, 2)), rank_mask([1, 0], 2)[:3]).tolist()
[[1.0, 1.0], [nan, nan], [nan, nan]]
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from moejax.call_record import call_record
from moejax.config import MoEConfig
from moejax.params import MoEParams

# (atol, rtol) per comparison and dtype, the suite's one table. "layer": the layer against
# the float32 reference (in float32 only the summation order differs); "kernel": a kernel
# against XLA on the same operands (in float32 only the K-block summation order differs);
# "reordered": one computation against another of the same float32 sums in another order or
# layout (seeded gradients, redundant slots, a round trip, a quantized rhs decoded apart);
# "torch": the layer against transformers' or PEFT's float32 modules (their own op order).
TOLERANCES = {
  ("layer", jnp.dtype(jnp.float32)): (3e-5, 3e-5),
  ("layer", jnp.dtype(jnp.bfloat16)): (5e-2, 5e-2),
  ("kernel", jnp.dtype(jnp.float32)): (1e-6, 1e-6),
  ("kernel", jnp.dtype(jnp.bfloat16)): (1e-2, 5e-3),
  ("reordered", jnp.dtype(jnp.float32)): (1e-5, 1e-5),
  ("torch", jnp.dtype(jnp.float32)): (1e-4, 1e-4),
}


def tolerance(dtype=jnp.float32, comparison: str = "layer") -> dict[str, float]:
  """`TOLERANCES[comparison, dtype]` as keyword arguments (atol, rtol), e.g. for chex."""
  atol, rtol = TOLERANCES[comparison, jnp.dtype(dtype)]
  return dict(atol=atol, rtol=rtol)


# Max |y - reference| / max |reference| of a layer against `reference_moe` in float32, by the
# layer's dtype, on any device: a GPU multiplies float32 in TF32 by default (~1e-3); gradients
# get twice the bound. What `moejax.tune` and benchmarks/gpu_check.py accept.
RELATIVE_BOUNDS = {jnp.dtype(jnp.float32): 3e-3, jnp.dtype(jnp.bfloat16): 3e-2}


def relative_error(actual, expected) -> float:
  """max |actual - expected| / max |expected|; inf where actual is not finite."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  if not np.all(np.isfinite(actual)):
    return float("inf")
  return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def random_params(config: MoEConfig, key: jax.Array, scale: float = 0.5) -> MoEParams:
  """Random float weights of every parameter the config needs (its `param_shapes`), normal
  times `scale` over the square root of the fan-in, in the dtype each is stored in: experts
  unquantized, no adapters (`moejax.quant.quantize_experts` and `moejax.lora` make those)."""
  expected = call_record(config).params
  keys = jax.random.split(key, len(expected))
  values = {
    name: (
      jax.random.normal(k, e.shape) * scale / np.sqrt(e.shape[-2] if len(e.shape) > 1 else 1)
    ).astype(e.dtype)
    for k, (name, e) in zip(keys, expected.items(), strict=True)
  }
  return MoEParams(**values)


def abstract_params(config: MoEConfig, mesh: Mesh | AbstractMesh | None = None) -> MoEParams:
  """Every parameter the layer takes for `config` as a `jax.ShapeDtypeStruct`, as a new
  `MoELayer` stores it: experts in the config's format (`BlockScaled` where `expert_quant` is
  set), LoRA adapters in `param_dtype`; on `mesh`, each laid out as the layer wants it
  (experts over the expert axis), for `jax.jit(...).lower(abstract_params(config, mesh), x)`
  without a byte of weights (`moejax.call_record.CallRecord.abstract_params`)."""
  return call_record(config, mesh).abstract_params()


def rank_mask(counts: Sequence[int], rows_per_rank: int) -> jax.Array:
  """[len(counts) * rows_per_rank] bool: rank r's first `counts[r]` rows valid, the rest
  padding (the layout of a data-parallel batch whose ranks hold uneven token counts)."""
  counts = np.asarray(counts)
  return jnp.asarray((np.arange(rows_per_rank)[None, :] < counts[:, None]).reshape(-1))


def poison(x: jax.Array, mask: jax.Array) -> jax.Array:
  """`x` [..., D] with NaN in every row `mask` [...] marks invalid: a masked row that reached
  an output, or a gradient, would show as NaN there."""
  return jnp.where(mask[..., None], x, jnp.nan)
