"""`MoEParams`: the layer's weights as a pytree, their shapes (the checkpoint format) and checks."""

from __future__ import annotations

from typing import NamedTuple

import jax

from moejax.config import MoEConfig


class MoEParams(NamedTuple):
  """Weights of one MoE layer. Names and shapes are the checkpoint format.

  Attributes:
    router_kernel: [D, E + Z] (Z = `num_zero_experts`, usually 0).
    w_gate_up: [E, D, 2F]; gate = `[..., :F]`, up = `[..., F:]`. With redundant experts
      (`config.num_redundant_experts` R > 0) this and every expert parameter holds the
      P = E + R physical slots, [P, ...] (`moejax.eplb.place`).
    w_down: [E, F, D].
    routing_bias: [E + Z] selection bias, or None unless `config.use_routing_bias`.
    shared_w_gate_up: [D, 2Fs], or None without shared experts.
    shared_w_down: [Fs, D], or None without shared experts.
    router_bias: [E + Z] bias of the router's logits, or None unless `config.router_bias`.
    b_gate_up: [E, 2F] expert biases, or None unless `config.expert_bias`.
    b_down: [E, D], or None unless `config.expert_bias`.
    shared_gate_kernel: [D, 1], or None unless `config.shared_expert_gate`.
  """

  router_kernel: jax.Array
  w_gate_up: jax.Array
  w_down: jax.Array
  routing_bias: jax.Array | None = None
  shared_w_gate_up: jax.Array | None = None
  shared_w_down: jax.Array | None = None
  router_bias: jax.Array | None = None
  b_gate_up: jax.Array | None = None
  b_down: jax.Array | None = None
  shared_gate_kernel: jax.Array | None = None


# Parameters with a leading expert axis [E, ...], split over the mesh's expert axis.
EXPERT_PARAMS = ("w_gate_up", "w_down", "b_gate_up", "b_down")
# Parameters that start at zero in a new layer (the others are matrices, fan-in initialised).
BIAS_PARAMS = ("routing_bias", "router_bias", "b_gate_up", "b_down")


# Weights the chunk loop computes with, besides the expert parameters.
SHARED_PARAMS = ("shared_w_gate_up", "shared_w_down", "shared_gate_kernel")


def compute_weights(params: MoEParams, config: MoEConfig) -> dict[str, jax.Array]:
  """The expert and shared-expert weights present, as the chunk loop computes with them.

  The one place that decides a weight's compute form: today each is cast to `config.dtype`;
  a weight that carries its own format (a quantized matrix with its scales) is to opt out of
  the cast here, as a unit.
  """
  return {
    name: getattr(params, name).astype(config.dtype)
    for name in (*EXPERT_PARAMS, *SHARED_PARAMS)
    if getattr(params, name) is not None
  }


def param_shapes(config: MoEConfig) -> dict[str, tuple[int, ...]]:
  """Shape of every parameter the config needs, keyed by `MoEParams` field name (expert
  parameters [P, ...], P = E + R physical experts)."""
  d, e, f = config.hidden_size, config.num_physical_experts, config.intermediate_size
  outputs = config.num_router_outputs
  shapes = {"router_kernel": (d, outputs), "w_gate_up": (e, d, 2 * f), "w_down": (e, f, d)}
  if config.use_routing_bias:
    shapes["routing_bias"] = (outputs,)
  if config.has_shared_experts:
    fs = config.shared_intermediate_size
    shapes["shared_w_gate_up"] = (d, 2 * fs)
    shapes["shared_w_down"] = (fs, d)
  if config.router_bias:
    shapes["router_bias"] = (outputs,)
  if config.expert_bias:
    shapes["b_gate_up"] = (e, 2 * f)
    shapes["b_down"] = (e, d)
  if config.shared_expert_gate:
    shapes["shared_gate_kernel"] = (d, 1)
  return shapes


def check_params(params: MoEParams, config: MoEConfig) -> None:
  """Raises ValueError if a parameter is missing, unexpected, or of the wrong shape."""
  expected = param_shapes(config)
  for name in MoEParams._fields:
    value = getattr(params, name)
    if name not in expected:
      if value is not None:
        raise ValueError(f"params.{name} is given but the config does not use it")
      continue
    if value is None:
      raise ValueError(f"params.{name} is missing; expected shape {expected[name]}")
    if tuple(value.shape) != expected[name]:
      raise ValueError(f"params.{name} has shape {tuple(value.shape)}, expected {expected[name]}")
