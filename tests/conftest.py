"""Test set-up: 8 simulated CPU devices (set before JAX is imported) and strict JAX checks."""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)
