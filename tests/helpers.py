"""Shared test helpers: tolerances per dtype, seeded random inputs, meshes, compile counting."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kernels_pallas import compat
from moejax import MoEConfig, MoEParams, param_shapes

# (atol, rtol) per compute dtype; float32 differs from the reference only by summation order.
TOLERANCES = {
  jnp.dtype(jnp.float32): (2e-5, 2e-5),
  jnp.dtype(jnp.bfloat16): (5e-2, 5e-2),
}


def assert_close(actual, expected, dtype=jnp.float32, what: str = "value") -> None:
  """Asserts |actual - expected| <= atol + rtol * |expected| elementwise, with error stats."""
  atol, rtol = TOLERANCES[jnp.dtype(dtype)]
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  error = np.abs(actual - expected)
  bound = atol + rtol * np.abs(expected)
  worst = float(np.max(error / bound)) if error.size else 0.0
  max_abs = float(error.max()) if error.size else 0.0
  max_rel = float(np.max(error / (np.abs(expected) + 1e-30))) if error.size else 0.0
  assert worst <= 1.0, (
    f"{what}: max abs error {max_abs:.3g}, max rel error {max_rel:.3g} "
    f"(atol={atol}, rtol={rtol}, worst ratio {worst:.3g})"
  )


def seed_of(name: str) -> int:
  """A stable seed from a test's name, so each test draws its own inputs."""
  return zlib.crc32(name.encode())


def random_params(config: MoEConfig, key: jax.Array, scale: float = 0.5) -> MoEParams:
  """Random weights of every parameter the config needs, at fan-in scale."""
  shapes = param_shapes(config)
  keys = jax.random.split(key, len(shapes))
  values = {
    name: (
      jax.random.normal(k, shape) * scale / np.sqrt(shape[-2] if len(shape) > 1 else 1)
    ).astype(config.param_dtype)
    for k, (name, shape) in zip(keys, shapes.items(), strict=True)
  }
  return MoEParams(**values)


def mesh_of(data: int, expert: int, axis_names=("data", "expert")) -> Mesh:
  """A (data, expert) mesh of the first data*expert devices, automatic axes."""
  devices = np.array(jax.devices()[: data * expert]).reshape(data, expert)
  return Mesh(devices, axis_names)


def rank_mask(counts, rows_per_rank: int) -> jax.Array:
  """[R * L] bool: rank r's first counts[r] rows valid."""
  counts = np.asarray(counts)
  return jnp.asarray((np.arange(rows_per_rank)[None, :] < counts[:, None]).reshape(-1))


def poison(x: jax.Array, mask: jax.Array) -> jax.Array:
  """x with NaN in every masked-out row."""
  return jnp.where(mask[..., None], x, jnp.nan)


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
  """Collects one entry per XLA backend compilation inside the block."""
  events: list[str] = []

  def listener(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def expect_triton_deprecation() -> contextlib.AbstractContextManager:
  """Expects JAX's Pallas Triton deprecation warning where the installed JAX gives it (0.11+)
  while a Triton kernel is lowered for a GPU."""
  if compat.TRITON_LOWERING_WARNS:
    return pytest.warns(DeprecationWarning, match=compat.TRITON_DEPRECATION_MESSAGE)
  return contextlib.nullcontext()
