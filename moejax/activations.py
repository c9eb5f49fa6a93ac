"""The experts' gated activations: one table, name -> how the hidden layer is computed.

`moejax.reference` keeps its own independent version of each (it is the oracle), and the
kernels' epilogues have the ones `kernels_pallas.activations.EPILOGUE_ACTIVATIONS` lists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kernels_pallas.activations import activate, erf_in_kernel


def _swiglu_oai(gate: jax.Array, up: jax.Array, act: GatedActivation) -> jax.Array:
  """GPT-OSS's clamped SwiGLU: (u + 1) * g * sigmoid(alpha g), g = min(gate, limit) and
  u = clip(up, -limit, limit)."""
  gate = jnp.minimum(gate, act.limit)
  up = jnp.clip(up, -act.limit, act.limit)
  return (up + 1.0) * gate * jax.nn.sigmoid(act.alpha * gate)


def _swiglu_clamped(gate: jax.Array, up: jax.Array, act: GatedActivation) -> jax.Array:
  """DeepSeek-V4's clamped SwiGLU: silu(min(gate, limit)) * clip(up, -limit, limit)."""
  return jax.nn.silu(jnp.minimum(gate, act.limit)) * jnp.clip(up, -act.limit, act.limit)


def _swiglu_clamped_after(gate: jax.Array, up: jax.Array, act: GatedActivation) -> jax.Array:
  """Step-3.5's and Step-3.7's clamped SwiGLU: min(silu(gate), limit) * clip(up, -limit,
  limit), the gate clamped after its activation."""
  return jnp.minimum(jax.nn.silu(gate), act.limit) * jnp.clip(up, -act.limit, act.limit)


def soft_capped(x: jax.Array, cap: float) -> jax.Array:
  """`cap * tanh(x / cap)`, elementwise; `x` itself if cap is 0 (Laguna's router logits,
  Inkling 2's gate and up)."""
  return x if not cap else cap * jnp.tanh(x / cap)


def _swiglu_softcapped(gate: jax.Array, up: jax.Array, act: GatedActivation) -> jax.Array:
  """Inkling 2's SwiGLU: the sigmoid of the raw gate, the linear gate factor and up each
  soft-capped (c * tanh(x / c))."""
  gate_factor = soft_capped(gate, act.gate_softcap)
  return gate_factor * jax.nn.sigmoid(gate) * soft_capped(up, act.up_softcap)


# name -> (gate, up, the activation's parameters) -> hidden.
GATED: dict[str, Callable[[jax.Array, jax.Array, GatedActivation], jax.Array]] = {
  "silu": lambda gate, up, act: jax.nn.silu(gate) * up,
  # exact: erf, differentiable under shard_map on every JAX
  "gelu": lambda gate, up, act: activate(gate, "gelu") * up,
  "gelu_tanh": lambda gate, up, act: jax.nn.gelu(gate, approximate=True) * up,
  # relu(u) * u = relu(u)**2: squared-ReLU experts (Nemotron-H) with gate = up
  "relu": lambda gate, up, act: jax.nn.relu(gate) * up,
  "swiglu_oai": _swiglu_oai,
  "swiglu_clamped": _swiglu_clamped,
  "swiglu_clamped_after": _swiglu_clamped_after,
  "swiglu_softcapped": _swiglu_softcapped,
}


@dataclasses.dataclass(frozen=True)
class GatedActivation:
  """How a gated MLP combines its gate and up projections into the hidden layer.

  "silu", "gelu" (exact erf), "gelu_tanh" and "relu" compute `act(gate) * up`; "swiglu_oai"
  (GPT-OSS) computes `(u + 1) * g * sigmoid(alpha * g)` with g = min(gate, limit) and
  u = clip(up, -limit, limit); "swiglu_clamped" (DeepSeek-V4) `silu(g) * u`;
  "swiglu_clamped_after" (Step-3.7) `min(silu(gate), limit) * u`;
  "swiglu_softcapped" (Inkling 2) `cap(gate, gate_softcap) * sigmoid(gate) * cap(up,
  up_softcap)` with cap(x, c) = c * tanh(x / c).

  >>> GatedActivation("swiglu_oai", limit=7.0)(jnp.array([9.0]), jnp.array([-9.0])).tolist()
  [-41.999...]
  """

  name: str | Callable[[jax.Array, jax.Array], jax.Array]  # a GATED name, or the function
  limit: float = 7.0
  alpha: float = 1.702
  gate_softcap: float = 4.0
  up_softcap: float = 25.0

  def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    if callable(self.name):  # the caller's own (gate, up) -> hidden
      return self.name(gate, up)
    return GATED[self.name](gate, up, self)

  @property
  def in_kernel(self) -> GatedActivation:
    """The same activation in operations Pallas Triton lowers, traced into a kernel's
    epilogue: exact gelu's erf from exp and arithmetic (`erf_in_kernel`, within 1e-6)."""
    if self.name == "gelu":
      return dataclasses.replace(self, name=_gelu_in_kernel)
    return self


def _gelu_in_kernel(gate: jax.Array, up: jax.Array) -> jax.Array:
  return activate(gate, "gelu", erf_in_kernel) * up
