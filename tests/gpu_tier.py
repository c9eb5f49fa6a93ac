"""What a GPU-compile test needs: its tier's marks (skipped without JAX's CUDA plugin), and the
persistent compilation cache off (import the fixture: it is autouse)."""

import jax
import pytest

from moejax import targets


def _cuda_plugin_missing() -> str | None:
  """Why compile-only GPU devices cannot be made here (JAX's CUDA plugin absent), or None."""
  try:
    targets.compile_only_devices("h200")
  except RuntimeError as error:
    return str(error)
  return None


# The marks of a GPU-compile test: its tier, skipped without JAX's CUDA plugin.
GPU_COMPILE_TIER = [
  pytest.mark.gpu_compile,
  pytest.mark.skipif(_cuda_plugin_missing() is not None, reason="needs JAX's CUDA plugin"),
]


@pytest.fixture(autouse=True)
def no_persistent_compilation_cache():
  """Off for GPU-compile tests (autouse where imported): a compile-only client cannot read a
  program back from JAX's persistent cache ("PjRtCompiler must be constructed with a Client")."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", enabled)
