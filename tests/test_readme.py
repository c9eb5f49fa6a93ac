"""The README's example ("Using the layer"), run as a user would: in a fresh process."""

import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import user_env

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
  """The first Python block after the heading "## Using the layer"."""
  section = README.read_text().split("## Using the layer", 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_and_matches_the_reference():
  result = subprocess.run(
    [sys.executable, "-c", readme_example()],
    capture_output=True,
    text=True,
    timeout=300,
    env=user_env("JAX_PLATFORMS"),
  )
  assert result.returncode == 0, result.stderr[-3000:]
  found = re.search(r"max \|y - reference\| = (\S+); y split as (.*)", result.stdout)
  assert found, result.stdout
  assert float(found.group(1)) < 1e-4, result.stdout
  assert found.group(2) == "P('data', None, None)", result.stdout
