"""tokamax's ragged_dot (openxla/tokamax: Mosaic GPU and Triton kernels, forward and
backward, its own choice of kernel per device) as the grouped matmul of the layer's sorted
path: `ExpertPlan(path="ragged_dot", backend="tokamax")`, a candidate of `moejax.tune` where
the optional `tokamax` extra is installed (Python >= 3.12, JAX >= 0.11.1).

Nothing chooses it but a tuning file: `tune` checks it against the reference on the device
before it can win, like every candidate.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

# The backend name of tokamax's ragged_dot on the layer's sorted path.
TOKAMAX = "tokamax"


def installed() -> bool:
  return importlib.util.find_spec("tokamax") is not None


def unsupported_reason(case) -> str | None:
  """Why the sorted path cannot run `case` (a `kernels_pallas.backends.Case`) on tokamax,
  or None."""
  if not installed():
    return "tokamax is not installed (pip install 'moejax[tokamax]', Python >= 3.12)"
  if case.rhs_format is not None:
    return f"{case.rhs_format} experts (the path takes float ones)"
  if case.biases:
    return "expert biases"
  return None


def ragged_dot(
  lhs: jax.Array, rhs: jax.Array, *, group_sizes: jax.Array, preferred_element_type=None
) -> jax.Array:
  """`jax.lax.ragged_dot`'s contract on tokamax: rows past the groups' sum are 0 (where, so
  that whatever tokamax leaves there never reaches the output)."""
  import tokamax

  out = tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
  filled = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(filled[:, None], out, 0)
