"""Test set-up: 8 simulated CPU devices and quick compiles (set before JAX is imported),
strict JAX checks and a compilation cache for the run."""

import atexit
import gc
import os
import shutil
import tempfile

# The suite compiles thousands of small programs and runs each a few times: XLA:CPU's LLVM
# optimizations cost more compile time than they save (a third of the suite's time), and
# change no number (no fast-math at any level). Subprocesses that run as a user would
# (`tests.helpers.user_env`) keep XLA's defaults; the notebooks add theirs to these.
os.environ["XLA_FLAGS"] = " ".join(
  [
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
  ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)

# A compilation cache for this run only: the same programs recur across test classes (each
# ends by clearing JAX's in-memory caches, below), and are then read back, not recompiled.
_compilation_cache = tempfile.mkdtemp(prefix="moejax-tests-compilation-cache-")
atexit.register(shutil.rmtree, _compilation_cache, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _compilation_cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="class")
def release_compiled_programs():
  """Frees every compiled program after each test class (each module, for tests outside one).

  XLA:CPU maps memory for each executable it compiles, and one process running the whole
  suite compiles thousands: left alive they pass the kernel's limit on memory maps
  (vm.max_map_count, 65530 by default), and compilation then crashes the process.
  """
  yield
  jax.clear_caches()
  gc.collect()
