"""The packages' import graph: no cycle (every module can be read before the modules it is
imported by; function-level imports count too), the library never imports its applications,
and the oracle shares no code with the fast path."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def public_names() -> tuple[str, ...]:
  """`moejax.apps.PUBLIC_NAMES`, read without importing the package (which may be broken)."""
  for node in ast.parse((ROOT / "moejax" / "apps" / "__init__.py").read_text()).body:
    if isinstance(node, ast.Assign) and node.targets[0].id == "PUBLIC_NAMES":
      return ast.literal_eval(node.value)
  raise AssertionError("moejax/apps/__init__.py defines no PUBLIC_NAMES")


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


def import_graph(package: str) -> dict[str, set[str]]:
  """{module: the package modules it imports}."""
  files = {module_name(path): path for path in (ROOT / package).rglob("*.py")}
  return {name: imported_modules(path, set(files)) for name, path in files.items()}


def reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
  """Every module `start` imports, directly or through others."""
  seen, stack = set(), [start]
  while stack:
    for imported in graph[stack.pop()] - seen:
      seen.add(imported)
      stack.append(imported)
  return seen


@pytest.mark.parametrize("package", ["moejax", "kernels_pallas"])
def test_no_import_cycle(package):
  graph = import_graph(package)
  cycles = [cycle for name in sorted(graph) if (cycle := cycle_from(name, graph))]
  assert not cycles, " -> ".join(cycles[0])


def test_the_library_never_imports_its_applications():
  """Only `moejax.apps` (and the modules that give its parts their public names, and
  `python -m moejax`'s entry) import it: the library's modules reach none of it."""
  graph = import_graph("moejax")
  applications = {name for name in graph if name.startswith("moejax.apps")}
  aliases = {f"moejax.{name}" for name in public_names()} | {"moejax.__main__"}
  library = set(graph) - applications - aliases
  assert library and applications
  reaching = {name: sorted(reachable(name, graph) & applications) for name in sorted(library)}
  assert not any(reaching.values()), {k: v for k, v in reaching.items() if v}


def test_the_oracle_does_not_import_the_fast_path():
  graph = import_graph("moejax")
  assert "moejax.forward" not in reachable("moejax.reference", graph)


def test_pytest_skips_the_public_names_of_application_modules():
  """The root conftest.py names the same modules as `moejax.apps.PUBLIC_NAMES` (collecting
  both spellings of one module fails pytest's import check)."""
  namespace = {}
  exec((ROOT / "conftest.py").read_text(), namespace)
  assert namespace["collect_ignore"] == [f"moejax/{name}.py" for name in public_names()]
