"""The docs cannot drift from the code: every dotted name, file path and command-line flag the
README and docs/ mention exists, and the guide's code blocks run (at the guide's own small
sizes, in a namespace that gives their free names values: `GUIDE_SETUP`)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys
from pathlib import Path

import pytest

from moejax.apps import cli
from tests.gpu_tier import GPU_COMPILE_TIER, no_persistent_compilation_cache  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

DOTTED_NAME = re.compile(r"\b(?:moejax|kernels_pallas)(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"\b(?:moejax|kernels_pallas|tests|benchmarks|docs|notebooks)/[\w./-]*\w/?")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
# Flags the docs show that are not moejax's: XLA's (`--xla_...`, in XLA_FLAGS), and a user's
# own training script's (docs/multihost.md).
OTHER_FLAGS = {"--coordinator", "--num-processes", "--process-id"}


def mentions(pattern: re.Pattern) -> dict[str, list[str]]:
  """{what the docs mention: the files that mention it}."""
  found: dict[str, list[str]] = {}
  for doc in DOCS:
    for name in pattern.findall(doc.read_text()):
      found.setdefault(name.rstrip("."), []).append(doc.name)
  return found


def resolves(dotted: str) -> bool:
  """Whether `a.b.c` names a module, or an attribute of the longest module prefix."""
  parts = dotted.split(".")
  for split in range(len(parts), 0, -1):
    try:
      value = importlib.import_module(".".join(parts[:split]))
    except ImportError:
      continue
    try:
      for part in parts[split:]:
        value = getattr(value, part)
    except AttributeError:
      return False
    return True
  return False


def short_names() -> dict[str, list[str]]:
  """Names the docs write in backticks from a module of either package down (`hf.load_layer`,
  `platform.Target`), spelled out in full (`moejax.hf.load_layer`)."""
  modules = {
    info.name: f"{package}.{info.name}"
    for package in ("kernels_pallas", "moejax")
    for info in pkgutil.iter_modules([str(ROOT / package)])
  }
  found: dict[str, list[str]] = {}
  for doc in DOCS:
    for name in re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`", doc.read_text()):
      first, rest = name.split(".", 1)
      if first in modules and rest != "py":  # `tiles.py`: the file exists
        found.setdefault(f"{modules[first]}.{rest}", []).append(doc.name)
  return found


def test_every_dotted_name_in_the_docs_resolves():
  names = mentions(DOTTED_NAME) | short_names()
  assert len(names) > 50  # the check reads the docs
  missing = {name: docs for name, docs in names.items() if not resolves(name)}
  assert not missing, f"names the docs mention that do not exist: {missing}"


def test_every_path_in_the_docs_exists():
  paths = mentions(PATH)
  assert len(paths) > 20
  missing = {path: docs for path, docs in paths.items() if not (ROOT / path).exists()}
  assert not missing, f"paths the docs mention that do not exist: {missing}"


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
  """Every flag of `parser` and of its subcommands."""
  flags = set()
  for action in parser._actions:
    flags.update(action.option_strings)
    if isinstance(action, argparse._SubParsersAction):
      for sub in action.choices.values():
        flags |= option_strings(sub)
  return flags


def defined_flags() -> set[str]:
  """The flags moejax's command line, the benchmark suite, the benchmark scripts and the test
  tiers define."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import suite

  flags = option_strings(cli.parser()) | option_strings(suite.parser())
  for script in (*(ROOT / "benchmarks").glob("*.py"), ROOT / "tests" / "conftest.py"):
    flags.update(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", script.read_text()))
  return flags


def test_every_flag_in_the_docs_exists():
  flags = mentions(FLAG)
  assert len(flags) > 20
  known = defined_flags() | OTHER_FLAGS
  missing = {
    flag: docs
    for flag, docs in flags.items()
    if flag not in known and not flag.startswith("--xla_")
  }
  assert not missing, f"flags the docs mention that no command defines: {missing}"


SECTION_REFERENCE = re.compile(r"((?:docs/)?\w+\.md)`?,? \(?\"([^\"]+)\"")


def headings(doc: Path) -> list[str]:
  return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")]


def test_every_section_a_doc_or_comment_points_to_exists():
  """`docs/performance.md, "GPU"` in the docs or the code: the file has a heading that
  starts so."""
  sources = [
    *DOCS,
    *(
      path
      for package in ("moejax", "kernels_pallas", "benchmarks", "tests")
      for path in (ROOT / package).rglob("*.py")
    ),
  ]
  found, missing = 0, {}
  for source in sources:
    for name, section in SECTION_REFERENCE.findall(source.read_text()):
      doc = ROOT / name if name.startswith("docs/") or name == "README.md" else ROOT / "docs" / name
      found += 1
      section = " ".join(section.replace("#", " ").split())  # a comment wrapped mid-name
      if not doc.exists() or not any(h.startswith(section) for h in headings(doc)):
        missing.setdefault(f"{name}: {section!r}", []).append(source.name)
  assert found > 10
  assert not missing, f"sections pointed to that do not exist: {missing}"


def test_the_docs_checks_fail_on_a_wrong_name():
  """The checks can fail: a planted wrong name of each kind is caught."""
  assert resolves("moejax.plan_call") and not resolves("moejax.plan_calls")
  assert resolves("moejax.apps.fit.PRESETS") and not resolves("moejax.fit.PRESET")
  assert "--chunk-size" in defined_flags() and "--chunk-sise" not in defined_flags()


def guide_blocks() -> list[str]:
  """The guide's Python code blocks, in order."""
  return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "guide.md").read_text(), re.S)


# The values of the guide's free names: a small layer on the 2x4 mesh, its tokens and
# weights, and a tiny Qwen3-MoE checkpoint (layer 3) with a PEFT adapter beside it.
GUIDE_SETUP = """
import dataclasses
import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moejax
from moejax import hf
from moejax.testing import rank_mask
from tests import hf_checkpoints
from tests.helpers import random_adapters

mesh = jax.make_mesh((2, 4), ("data", "expert"))
config = moejax.MoEConfig(
  num_experts=16, top_k=4, hidden_size=64, intermediate_size=128, chunk_size=16
)
D = config.hidden_size
x = jax.random.normal(jax.random.key(0), (64, D))
mask = rank_mask([8, 0, 5, 8, 8, 8, 3, 8], 8)
batches = [x, x[::-1]]
layer = moejax.MoELayer(config, mesh=mesh, rngs=nnx.Rngs(0))
params = layer.moe_params()
num_layers = 2
loss = lambda layer: jnp.mean(layer(x) ** 2)
step = lambda params, x: moejax.moe_apply(params, x, config=config, mesh=mesh)[0]
"""
HF_SETUP = """
path = model_path = folder / "model"
path.mkdir()
hf_checkpoints.write_checkpoint(path, "qwen3_moe", layer=3)
written = json.loads((path / "config.json").read_text())  # 4 layers, the last one MoE
written.update(num_hidden_layers=4, mlp_only_layers=[0, 1, 2])
(path / "config.json").write_text(json.dumps(written))
config = hf.config_from_hf(path)
x = jax.random.normal(jax.random.key(1), (64, config.hidden_size))
adapted = dataclasses.replace(config, lora_rank=4)
adapters = random_adapters(adapted, jax.random.key(2))
trained = hf.load_layer(path, 3, config)._replace(lora=adapters[0], shared_lora=adapters[1])
adapter_path, out_path = folder / "adapter", folder / "exported"
hf.save_lora(adapter_path, {3: trained}, adapted, model_type="qwen3_moe")
"""


def run_guide_block(block: str, folder: Path) -> None:
  namespace = {"folder": folder}
  exec(GUIDE_SETUP, namespace)
  if "hf." in block:
    exec(HF_SETUP, namespace)
  exec(block, namespace)


@pytest.mark.slow
def test_the_guides_code_blocks_run(tmp_path):
  blocks = [block for block in guide_blocks() if "target_mesh" not in block]
  assert len(blocks) >= 8
  for index, block in enumerate(blocks):
    folder = tmp_path / str(index)
    folder.mkdir()
    try:
      run_guide_block(block, folder)
    except Exception as error:
      raise AssertionError(f"the guide's block\n{block}\nfailed: {error!r}") from error


@GPU_COMPILE_TIER[0]
@GPU_COMPILE_TIER[1]
def test_the_guides_compile_only_block_compiles(tmp_path):
  (block,) = [block for block in guide_blocks() if "target_mesh" in block]
  run_guide_block(block, tmp_path)
