"""Levanter grug's routed MoE MLP, run by moejax.

`moe_mlp` takes what `levanter.grug.grug_moe.moe_mlp` takes (routing done by the model:
selected experts and combine weights; the experts' [E, D, 2I] gate‖up and [E, I, D] down
weights) and returns what it returns, computed by `moejax.moe_mlp`: moejax's chunk loop,
exchange over the mesh's "expert" axis and expert paths. A grug model changes one line:

    from moejax.integrations.levanter import moe_mlp   # instead of grug_moe's

Its mesh needs no ceremony: the "expert" axis splits the experts, every other axis
(Levanter's "replica_dcn", "data", "context", "model", of any size) splits the tokens.

Capacity as grug's ring has it: with an expert axis of 2 or more devices, each computes at
most max(El, ceil(capacity_factor · assignments gathered / S)) of the assignments that reach
its experts and drops the rest (`MoEConfig.capacity_factor`, in one chunk of each device's
tokens, as grug's ring gathers them); on one device, or with `capacity_factor=None`, nothing
drops. Tested against grug's own `scatter` and `ring` backends, forward and gradients, on
one device and on 8, with and without drops.

>>> import jax.numpy as jnp
>>> e, d, i = 4, 8, 16
>>> y = moe_mlp(jnp.ones((2, d)), jnp.array([[0, 3], [1, 2]]), jnp.full((2, 2), 0.5),
...             jnp.ones((e, d, 2 * i)) / d, jnp.ones((e, i, d)) / i)
>>> y.shape, round(float(y[0, 0]), 4)  # silu(1) * 1
((2, 8), 0.7311)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from moejax import meshes
from moejax.functional import moe_mlp as moejax_moe_mlp

EXPERT_AXIS = "expert"  # grug's expert-parallel axis
CAPACITY_FACTOR = 1.25  # grug's default (`levanter.grug._moe.common`)


def _relu2(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jnp.square(jax.nn.relu(gate)) * up


def _quick_gelu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return gate * jax.nn.sigmoid(1.702 * gate) * up


def _tanh(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jnp.tanh(gate) * up


# grug's activations (`levanter.utils.activation.ActivationFunctionEnum` values), each as
# moejax computes act(gate) * up: a name of `MoEConfig.activation` where moejax has it (the
# kernels' epilogues take those), else a gated function.
ACTIVATIONS: dict[str, str | Callable[[jax.Array, jax.Array], jax.Array]] = {
  "silu": "silu",
  "swish": "silu",
  "gelu": "gelu",
  "gelu_new": "gelu_tanh",
  "relu": "relu",
  "relu2": _relu2,
  "quick_gelu": _quick_gelu,
  "tanh": _tanh,
}
# grug's backends and the moejax exchange that moves the same rows.
DISPATCH_OF = {
  None: "auto",
  "ring": "all_gather",
  "ragged_all_to_all": "all_to_all",
  "deepep": "all_to_all",
  "scatter": "auto",
  "sonic": "auto",
}


def moe_mlp(
  x: jax.Array,
  selected_experts: jax.Array,
  combine_weights: jax.Array,
  w_up_gate: jax.Array,
  w_down: jax.Array,
  *,
  activation: str | Callable[[jax.Array], jax.Array] = "silu",
  implementation: str | None = None,
  mesh: Mesh | AbstractMesh | None = None,
  capacity_factor: float | None = CAPACITY_FACTOR,
  report_capacity_overflow: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """grug's `moe_mlp` on moejax: y[t] = sum_k combine_weights[t, k] *
  (act(x W_gate) * (x W_up)) W_down of expert selected_experts[t, k].

  Args:
    x: [T, D] tokens.
    selected_experts: [T, K] int32 expert ids in [0, E).
    combine_weights: [T, K] their weights, used as given (with their gradient).
    w_up_gate: [E, D, 2I], gate columns first, then up (grug's `w_gate_up`).
    w_down: [E, I, D].
    activation: one of grug's activation names (`ACTIVATIONS`; its enum's values are
      these strings) or a function of the gate, as grug takes: act(gate) * up.
    implementation: grug's backend name, read as the exchange that moves the same rows
      (`DISPATCH_OF`: "ring" all_gather, "ragged_all_to_all" and "deepep" all_to_all), or
      None / a local one: moejax chooses.
    mesh: the mesh, or None for the ambient one (`jax.set_mesh`), else one device.
    capacity_factor: with an expert axis of 2 or more devices, each computes at most
      max(El, ceil(capacity_factor · T_group·K / S)) assignments (grug's ring; 1.25 by
      default, as grug's); None: dropless.
    report_capacity_overflow: also return the number of dropped assignments.

  Returns:
    y [T, D] in x's dtype, or (y, [] int32 dropped assignments summed over the devices)
    with `report_capacity_overflow`.

  Raises:
    ValueError: an activation or implementation grug does not name, or shapes that do not
      agree (named by `moejax.moe_mlp`).
  """
  if implementation not in DISPATCH_OF:
    raise ValueError(
      f"implementation must be one of {sorted(k for k in DISPATCH_OF if k)} or None, got "
      f"{implementation!r}"
    )
  mesh = meshes.of_call(mesh)
  expert_axis, data_axis = meshes.expert_and_token_axes(mesh, EXPERT_AXIS)
  chunk_size, capacity = "auto", None
  if mesh is not None and mesh.shape[expert_axis] > 1 and capacity_factor is not None:
    devices = math.prod(mesh.shape.values())  # one chunk of each device's tokens, as grug's
    chunk_size, capacity = max(x.shape[0] // devices, 1), capacity_factor
  y, aux = moejax_moe_mlp(
    x,
    selected_experts.astype(jnp.int32),
    combine_weights,
    w_up_gate,
    w_down,
    activation=_gated(activation),
    mesh=mesh,
    dispatch=DISPATCH_OF[implementation],
    data_axis=data_axis,
    expert_axis=expert_axis,
    chunk_size=chunk_size,
    capacity_factor=capacity,
  )
  if report_capacity_overflow:
    return y, jnp.sum(aux.dropped_assignments, dtype=jnp.int32)
  return y


def _gated(activation: str | Callable[[jax.Array], jax.Array]):
  """grug's activation as moejax's `MoEConfig.activation`: a name, or one gated function
  per unary function (the same object each call, so that a call compiles once)."""
  if callable(activation) and not isinstance(activation, str):
    return _gated_function(activation)
  name = str(getattr(activation, "value", activation))
  if name not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a function, got {name!r}")
  return ACTIVATIONS[name]


@functools.cache
def _gated_function(act: Callable[[jax.Array], jax.Array]):
  return lambda gate, up: act(gate) * up
