"""`moe_mlp`: the routed experts on plain arrays, for callers that route themselves.

A framework that computes its own routing (expert ids and combine weights, as Levanter's
grug `moe_mlp` takes them) and stores its own expert weights calls this instead of building a
`MoEConfig` and `MoEParams`: it makes both from the arrays' shapes and runs `moe_apply` (the
same chunk loop, exchange schemes, expert paths, tuning and call plan), the given weights
used as they are.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from moejax.config import ActivationFn, Dispatch, ExpertBackend, MoEConfig
from moejax.forward import MoEAux, moe_apply
from moejax.params import MoEParams

# How a stored [E, D, 2F] gate/up weight holds its two halves: gate then up along the last
# axis (moejax's own, Mixtral's and Levanter's), or alternating columns (GPT-OSS's).
GateUpLayout = Literal["concatenated", "interleaved"]


def moe_mlp(
  x: jax.Array,  # [..., D]
  expert_ids: jax.Array,  # [..., K]
  combine_weights: jax.Array,  # [..., K]
  w_gate_up: jax.Array,  # [E, D, 2F], or the gate alone [E, D, F] with `w_up`
  w_down: jax.Array,  # [E, F, D]
  *,
  w_up: jax.Array | None = None,
  gate_up_layout: GateUpLayout = "concatenated",
  activation: str | ActivationFn = "silu",
  mesh: Mesh | None = None,
  token_mask: jax.Array | None = None,
  dispatch: Dispatch = "auto",
  chunk_size: int | Literal["auto"] = "auto",
  expert_backend: ExpertBackend = "auto",
  data_axis: str | tuple[str, ...] = "data",
  expert_axis: str | tuple[str, ...] = "expert",
  capacity_factor: float | None = None,
) -> tuple[jax.Array, MoEAux]:
  """y[t] = sum_k combine_weights[t, k] * mlp_{expert_ids[t, k]}(x[t]), the gated MLP
  `activation(x W_gate, x W_up) W_down` of each chosen expert.

  Args:
    x: [..., D] float tokens, in the compute dtype.
    expert_ids: [..., K] int32 expert ids in [0, E), distinct per token (concrete ones are
      checked; under `jit` a bad one routes nowhere and is counted, as `moe_apply` says).
    combine_weights: [..., K] float weights, used as they are; they get gradients.
    w_gate_up: [E, D, 2F] gate and up in `gate_up_layout`, or with `w_up` the gate [E, D, F].
    w_down: [E, F, D].
    w_up: [E, D, F] the up projection when stored apart from the gate, or None.
    gate_up_layout: "concatenated" (gate `[..., :F]`, up `[..., F:]`) or "interleaved"
      (gate at even columns, up at odd ones).
    activation: a gated activation of `MoEConfig.activation`: a name ("silu", "gelu",
      ...) or your own `(gate, up) -> hidden` (the XLA tile loop runs it).
    mesh: a mesh whose axes of size > 1 are in `data_axis` or `expert_axis` (the experts
      split over the expert group, the tokens over both), or None: the ambient mesh, else
      one device.
    token_mask: [...] bool, True for real tokens (masked rows come back 0); None: all real.
    dispatch, chunk_size, expert_backend, data_axis, expert_axis: as `MoEConfig`'s.
    capacity_factor: None (dropless), or f: each device computes at most max(El,
      ceil(f·C·K)) of the assignments reaching its experts per chunk and drops the rest
      (`MoEConfig.capacity_factor`; counted in `MoEAux.dropped_assignments`).

  Returns:
    (y [..., D] in x's dtype, the call's `MoEAux`; its router losses are 0: there is no
    router).

  >>> e, d, f = 4, 8, 16
  >>> w_gate_up, w_down = jnp.ones((e, d, 2 * f)) / d, jnp.ones((e, f, d)) / f
  >>> ids, weights = jnp.array([[0, 3]]), jnp.array([[0.25, 0.75]])
  >>> y, _ = moe_mlp(jnp.ones((1, d)), ids, weights, w_gate_up, w_down)
  >>> y.shape, round(float(y[0, 0]), 4)  # silu(1) * 1, weighed 0.25 + 0.75
  ((1, 8), 0.7311)
  """
  w_gate_up = _fused_gate_up(w_gate_up, w_up, gate_up_layout)
  experts, dim, width = w_gate_up.shape[0], w_gate_up.shape[1], w_gate_up.shape[2] // 2
  config = MoEConfig(
    num_experts=experts,
    top_k=expert_ids.shape[-1],
    hidden_size=dim,
    intermediate_size=width,
    activation=activation,
    external_router=True,
    dtype=jnp.result_type(x),
    param_dtype=jnp.result_type(w_gate_up),
    dispatch=dispatch,
    chunk_size=chunk_size,
    expert_backend=expert_backend,
    data_axis=data_axis,
    expert_axis=expert_axis,
    capacity_factor=capacity_factor,
  )
  return moe_apply(
    MoEParams(w_gate_up=w_gate_up, w_down=w_down),
    x,
    config=config,
    mesh=mesh,
    token_mask=token_mask,
    expert_ids=expert_ids,
    combine_weights=combine_weights,
  )


def _fused_gate_up(w_gate_up: jax.Array, w_up: jax.Array | None, layout: GateUpLayout) -> jax.Array:
  """[E, D, 2F] gate then up, from the layout the caller stores."""
  if w_up is not None:
    if w_up.shape != w_gate_up.shape:
      raise ValueError(
        f"w_up has shape {w_up.shape}; expected the gate's (w_gate_up's) {w_gate_up.shape}"
      )
    return jnp.concatenate([w_gate_up, w_up], axis=-1)
  if layout not in ("concatenated", "interleaved"):
    raise ValueError(f"gate_up_layout must be 'concatenated' or 'interleaved', got {layout!r}")
  if w_gate_up.ndim != 3 or w_gate_up.shape[-1] % 2:
    raise ValueError(f"w_gate_up has shape {w_gate_up.shape}; expected [E, D, 2F]")
  if layout == "concatenated":
    return w_gate_up
  return jnp.concatenate([w_gate_up[..., 0::2], w_gate_up[..., 1::2]], axis=-1)
