"""The notebooks run top to bottom, and are committed with the outputs of one clean run, top
to bottom (`python -m tests.test_notebooks` stores them anew)."""

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
FROM_TRANSFORMERS = "04_from_transformers.ipynb"
CLIENTS = "08_clients.ipynb"  # tunix's and Levanter's models, each where installed
MAXTEXT = "09_maxtext.ipynb"  # needs maxtext (Python >= 3.12: CI's GPU venv runs it)
HAS_HF_EXTRA = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def missing_clients(path: Path) -> list[str]:
  """The clients a notebook trains that are not installed here (the client notebooks print a
  skipped section for each; stored outputs must come from a run with all of them)."""
  needs = {CLIENTS: ("tunix", "levanter"), MAXTEXT: ("maxtext",)}.get(path.name, ())
  return [name for name in needs if importlib.util.find_spec(name) is None]


def run(path: Path, hide_modules: tuple[str, ...] = ()) -> str:
  """Executes the notebook (with `hide_modules` made unimportable first); returns its text
  output, after checking that no cell raised."""
  return text_of(executed(path, hide_modules))


def executed(path: Path, hide_modules: tuple[str, ...] = ()) -> nbformat.NotebookNode:
  """The notebook run top to bottom in a fresh kernel; raises naming the first error."""
  notebook = nbformat.read(path, as_version=4)
  if hide_modules:  # `import torch` raises ImportError, as where the extra is not installed
    hide = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in hide_modules)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(hide))
  NotebookClient(
    notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
  ).execute()
  errors = [o for o in outputs_of(notebook) if o.output_type == "error"]
  assert not errors, errors[0].get("evalue")
  return notebook


def outputs_of(notebook: nbformat.NotebookNode) -> list:
  return [o for c in notebook.cells for o in c.get("outputs", [])]


def text_of(notebook: nbformat.NotebookNode) -> str:
  return "".join(o.get("text", "") for o in outputs_of(notebook) if o.output_type == "stream")


def with_extras_marked(paths: list[Path]) -> list:
  """`paths` as parameters, those that need the hf extra or the clients marked `extras`."""
  extras = pytest.mark.extras
  return [
    pytest.param(p, marks=extras) if p.name in (FROM_TRANSFORMERS, CLIENTS) else p for p in paths
  ]


@pytest.mark.slow
@pytest.mark.parametrize("path", with_extras_marked(NOTEBOOKS), ids=lambda p: p.name)
def test_notebook_runs(path):
  if path.name == MAXTEXT and missing_clients(path):
    pytest.skip("needs maxtext (Python >= 3.12; .ci/run's GPU venv)")
  text = run(path)
  if path.name == FROM_TRANSFORMERS and HAS_HF_EXTRA:
    assert "difference to the transformers block" in text
  if path.name in (CLIENTS, MAXTEXT):  # each client's loss curve with moejax inside is its own
    differences = [float(d) for d in re.findall(r"largest difference: (\S+)", text)]
    assert len(differences) + text.count("section skipped") == (2 if path.name == CLIENTS else 1)
    assert differences and max(differences) < 1e-4, text


@pytest.mark.slow
def test_from_transformers_runs_without_the_hf_extra():
  text = run(Path(NOTEBOOKS[0]).parent / FROM_TRANSFORMERS, hide_modules=("torch", "transformers"))
  assert "difference to moejax.reference_moe" in text
  assert "transformers comparison skipped: pip install" in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_the_outputs_of_a_clean_run(path):
  """Every code cell run once, in order, from a fresh kernel, none with an error."""
  notebook = nbformat.read(path, as_version=4)
  code = [cell for cell in notebook.cells if cell.cell_type == "code"]
  assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), path.name
  assert not [o for o in outputs_of(notebook) if o.output_type == "error"], path.name
  assert text_of(notebook), f"{path.name} has no printed output"


def test_every_notebook_is_listed():
  assert [p.name for p in NOTEBOOKS] == [
    "01_quickstart.ipynb",
    "02_chunking.ipynb",
    "03_training.ipynb",
    FROM_TRANSFORMERS,
    "05_quantized.ipynb",
    "06_load_balancing.ipynb",
    "07_lora.ipynb",
    CLIENTS,
    MAXTEXT,
  ]


if __name__ == "__main__":  # stores each notebook with the outputs of a fresh run
  for path in NOTEBOOKS:
    if missing := missing_clients(path):
      print(f"kept {path.name} as stored: {', '.join(missing)} not installed here")
      continue
    print(f"running {path.name}")
    nbformat.write(executed(path), path)
