"""The packages' import graph has no cycle: every module can be read before the modules it is
imported by (function-level imports count too)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
  """The package modules `path` imports (`from a import b` counts a.b where b is a module)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for alias in node.names:
        submodule = f"{node.module}.{alias.name}"
        found.add(submodule if submodule in modules else node.module)
  return (found & modules) - {module_name(path)}


def cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
  """A path of imports from `start` back to `start`, or None."""
  stack, seen = [(start, [start])], set()
  while stack:
    module, path = stack.pop()
    for imported in sorted(graph[module]):
      if imported == start:
        return [*path, start]
      if imported not in seen:
        seen.add(imported)
        stack.append((imported, [*path, imported]))
  return None


@pytest.mark.parametrize("package", ["moejax", "kernels_pallas"])
def test_no_import_cycle(package):
  files = {module_name(path): path for path in (ROOT / package).rglob("*.py")}
  graph = {name: imported_modules(path, set(files)) for name, path in files.items()}
  cycles = [cycle for name in sorted(graph) if (cycle := cycle_from(name, graph))]
  assert not cycles, " -> ".join(cycles[0])
