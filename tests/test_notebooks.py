"""The notebooks run top to bottom, and are committed without outputs."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


# Notebooks that need the `hf` extra (transformers and torch); skipped without it.
NEEDS_EXTRA = {"04_from_transformers.ipynb": ("torch", "transformers")}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
  for module in NEEDS_EXTRA.get(path.name, ()):
    pytest.importorskip(module)
  notebook = nbformat.read(path, as_version=4)
  NotebookClient(
    notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
  ).execute()
  errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


def test_there_are_four_notebooks():
  assert [p.name for p in NOTEBOOKS] == [
    "01_quickstart.ipynb",
    "02_chunking.ipynb",
    "03_training.ipynb",
    "04_from_transformers.ipynb",
  ]
