"""The peers' own MoE modules (Levanter grug's, tunix's Qwen3, MaxText's RoutedMoE), for the
tests and benchmarks that compare against them; Levanter's and tunix's imported without their
package's `__init__`, which pulls in a trainer stack the comparison does not need."""

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from types import ModuleType

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from moejax.integrations.maxtext import on_moejax


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


def maxtext_pair(
  shape: tuple[int, int, int, int], mesh_sizes: dict[str, int] | None = None, **overrides
) -> tuple[nnx.Module, nnx.Module] | None:
  """MaxText's `RoutedMoE` and moejax's drop-in (`on_moejax(RoutedMoE)`), both from one seed,
  of `shape` (experts, top k, model width, expert width): float32, MaxText's dense path,
  dropless, a load-balance loss, then `overrides` of MaxText's config; on a mesh of MaxText's
  axes, `mesh_sizes` where given and 1 elsewhere. None where maxtext is not installed (it
  needs Python >= 3.12). Build and call them with rank promotion allowed: MaxText broadcasts.

  Raises:
    ValueError: a setting the drop-in does not take (from building moejax's).
  """
  try:
    from maxtext.configs import pyconfig
    from maxtext.layers import initializers, moe
  except ImportError:
    return None
  experts, top_k, width, expert_width = shape
  settings = dict(
    run_name="moejax", enable_checkpointing=False, skip_jax_distributed_system=True,
    base_output_directory=os.path.join(tempfile.gettempdir(), "maxtext_output"),  # unwritten
    base_emb_dim=width, base_mlp_dim=expert_width, base_moe_mlp_dim=expert_width,
    num_experts=experts, num_experts_per_tok=top_k, sparse_matmul=False, capacity_factor=-1,
    dtype="float32", weight_dtype="float32", matmul_precision="highest",
    load_balance_loss_weight=0.01,
  )  # fmt: skip
  base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
  config = pyconfig.initialize([None, base], **settings | overrides)
  sizes = [(mesh_sizes or {}).get(name, 1) for name in config.mesh_axes]
  devices = np.array(jax.devices()[: int(np.prod(sizes))]).reshape(sizes)
  mesh = Mesh(devices, config.mesh_axes)
  build = lambda cls: cls(
    config=config, num_experts=experts, num_experts_per_tok=top_k, mesh=mesh,
    kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
    kernel_axes=("embed", None), intermediate_dim=expert_width, rngs=nnx.Rngs(0),
  )  # fmt: skip
  return build(moe.RoutedMoE), build(on_moejax(moe.RoutedMoE))
