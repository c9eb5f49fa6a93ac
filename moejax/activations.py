"""The experts' gated activations: one table, name -> how the hidden layer is computed.

`moejax.reference` keeps its own independent version of each (it is the oracle), and the
kernels' epilogues have the ones `kernels_pallas.activations.EPILOGUE_ACTIVATIONS` lists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas.activations import activate


def _swiglu_oai(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
  """GPT-OSS's clamped SwiGLU: (u + 1) * g * sigmoid(alpha g), g = min(gate, limit) and
  u = clip(up, -limit, limit)."""
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def _swiglu_clamped(gate: jax.Array, up: jax.Array, limit: float, alpha: float) -> jax.Array:
  """DeepSeek-V4's clamped SwiGLU: silu(min(gate, limit)) * clip(up, -limit, limit)."""
  return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


# name -> (gate, up, limit, alpha) -> hidden.
GATED: dict[str, Callable[[jax.Array, jax.Array, float, float], jax.Array]] = {
  "silu": lambda gate, up, limit, alpha: jax.nn.silu(gate) * up,
  # exact: erf, differentiable under shard_map on every JAX
  "gelu": lambda gate, up, limit, alpha: activate(gate, "gelu") * up,
  "gelu_tanh": lambda gate, up, limit, alpha: jax.nn.gelu(gate, approximate=True) * up,
  "swiglu_oai": _swiglu_oai,
  "swiglu_clamped": _swiglu_clamped,
}


@dataclasses.dataclass(frozen=True)
class GatedActivation:
  """How a gated MLP combines its gate and up projections into the hidden layer.

  "silu", "gelu" (exact erf) and "gelu_tanh" compute `act(gate) * up`; "swiglu_oai"
  (GPT-OSS) computes `(u + 1) * g * sigmoid(alpha * g)` with g = min(gate, limit) and
  u = clip(up, -limit, limit); "swiglu_clamped" (DeepSeek-V4) `silu(g) * u`.

  >>> GatedActivation("swiglu_oai", limit=7.0)(jnp.array([9.0]), jnp.array([-9.0])).tolist()
  [-41.999...]
  """

  name: str
  limit: float = 7.0
  alpha: float = 1.702

  def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    return GATED[self.name](gate, up, self.limit, self.alpha)
