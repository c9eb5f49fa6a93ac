"""Levanter grug's MoE modules, for the tests and benchmarks that compare against them."""

import importlib.machinery
import importlib.util
import sys
import warnings


def grug_modules():
  """`levanter.grug.grug_moe` and grug's activation enum, imported without running
  `levanter/__init__.py` (which pulls in the trainer stack), or Nones where marin-levanter
  is not installed."""
  if "levanter" not in sys.modules:
    spec = importlib.util.find_spec("levanter")
    if spec is None or spec.submodule_search_locations is None:
      return None, None
    package = importlib.util.module_from_spec(
      importlib.machinery.ModuleSpec("levanter", None, is_package=True)
    )
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["levanter"] = package
  try:
    with warnings.catch_warnings():  # haliax reads JAX names deprecated since 0.8
      warnings.simplefilter("ignore", DeprecationWarning)
      from levanter.grug import grug_moe
      from levanter.utils.activation import ActivationFunctionEnum
  except ImportError:
    return None, None
  return grug_moe, ActivationFunctionEnum
