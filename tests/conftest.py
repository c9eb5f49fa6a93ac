"""Test set-up: 8 simulated CPU devices and quick compiles (set before JAX is imported),
strict JAX checks, a compilation cache for the run, and the test tiers.

Tiers: `python -m pytest` runs the fast tier, every behavior once on small shapes; tests
marked `slow` (subprocess runs, transformers and PEFT comparisons, extra meshes, kernel
sweeps) and `gpu_compile` (XLA's GPU compiler on compile-only GPUs: needs JAX's CUDA plugin,
skipped without it) run with `--all` (or when a `-m` expression selects them). `-n auto`
spreads them over the cores (pytest-xdist).
"""

import atexit
import gc
import os
import shutil
import tempfile
from importlib.metadata import version

from packaging.version import Version

# The suite compiles thousands of small programs and runs each a few times: XLA:CPU's LLVM
# optimizations cost more compile time than they save (a third of the suite's time), and
# change no number (no fast-math at any level). On JAX 0.10 its loop emitters compile in about
# half the time of its fusion emitters (a layer's gradient on a 2x4 mesh: 8-10 s against 17-19
# s; the fast tier on 2 cores: 21 min against 30); the one number found to differ is their
# float32 -> float4_e2m1fn conversion, which quantizing does not rely on
# (`kernels_pallas.formats`). Later JAX has no such flag (0.12's XLA, 0.11's CUDA plugin,
# which reads the same XLA_FLAGS, abort on it) and compiles with the fusion emitters.
# Subprocesses that run as a user would (`tests.helpers.user_env`) keep XLA's defaults (or,
# where they mostly compile, take these but the device count); the notebooks add theirs to
# these.
os.environ["XLA_FLAGS"] = " ".join(
  [
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    *(
      ["--xla_cpu_use_fusion_emitters=false"]
      if Version(version("jaxlib")) < Version("0.11")
      else []
    ),
  ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", False)

# A compilation cache for this run only: the same programs recur across test classes (each
# ends by clearing JAX's in-memory caches, below), and are then read back, not recompiled.
# pytest-xdist's workers inherit the environment of the process that made it, and share it;
# that process removes it at exit.
_CACHE_VARIABLE = "MOEJAX_TESTS_COMPILATION_CACHE"
if _CACHE_VARIABLE not in os.environ:
  os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="moejax-tests-compilation-cache-")
  atexit.register(shutil.rmtree, os.environ[_CACHE_VARIABLE], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])
# Tuning files (`moejax.tuning`) from an empty folder of the run's own: the user's measured
# paths never change what a test plans. Tests that tune set their own folder.
os.environ["MOEJAX_CACHE_DIR"] = os.path.join(os.environ[_CACHE_VARIABLE], "tuning")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Workers of `pytest -n auto` (pytest-xdist): one per core, at most this many (each holds
# about 3 GB at its peak).
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
  return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption(
    "--all", action="store_true", help="run every tier: the fast one, slow and gpu_compile"
  )


# The tiers past the fast one: their markers.
TIERS = ("slow", "gpu_compile")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  """Deselects the tiers past the fast one unless `--all` or a `-m` expression asks
  otherwise."""
  if config.getoption("--all") or config.getoption("markexpr"):
    return
  later = lambda item: any(item.get_closest_marker(tier) for tier in TIERS)
  deselected = [item for item in items if later(item)]
  if deselected:
    config.hook.pytest_deselected(items=deselected)
    items[:] = [item for item in items if not later(item)]


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
