"""The peers' own MoE modules (Levanter grug's, tunix's Qwen3), for the tests and benchmarks
that compare against them; each imported without its package's `__init__`, which pulls in a
trainer stack the comparison does not need."""

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType


def _import_without_package_init(package: str, *modules: str) -> tuple[ModuleType, ...] | None:
  """`modules` of `package`, its `__init__` skipped (an empty package module stands in), or
  None where the package is not installed or a module fails to import."""
  if package not in sys.modules:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
      return None
    stand_in = importlib.util.module_from_spec(
      importlib.machinery.ModuleSpec(package, None, is_package=True)
    )
    stand_in.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = stand_in
  try:
    with warnings.catch_warnings():  # haliax reads JAX names deprecated since 0.8
      warnings.simplefilter("ignore", DeprecationWarning)
      return tuple(importlib.import_module(f"{package}.{module}") for module in modules)
  except ImportError:
    return None


def grug_modules():
  """`levanter.grug.grug_moe` and grug's activation enum, or Nones where marin-levanter is
  not installed."""
  found = _import_without_package_init("levanter", "grug.grug_moe", "utils.activation")
  if found is None:
    return None, None
  grug_moe, activation = found
  return grug_moe, activation.ActivationFunctionEnum


def tunix_qwen3():
  """`tunix.models.qwen3.model`, or None where google-tunix is not installed. Importing it
  turns flax's `flax_always_shard_variable` off for the whole process (tunix's env_utils):
  restored here, or every later layer of the run would be laid out otherwise."""
  import flax

  always_shard = flax.config.flax_always_shard_variable
  found = _import_without_package_init("tunix", "models.qwen3.model")
  flax.config.update("flax_always_shard_variable", always_shard)
  return None if found is None else found[0]


@contextlib.contextmanager
def flax_as_tunix_runs() -> Iterator[None]:
  """flax's `flax_always_shard_variable` off, as tunix's own import sets it (its layers
  build their parameters without a mesh only so), restored on leaving."""
  import flax

  always_shard = flax.config.flax_always_shard_variable
  flax.config.update("flax_always_shard_variable", False)
  try:
    yield
  finally:
    flax.config.update("flax_always_shard_variable", always_shard)
