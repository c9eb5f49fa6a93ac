"""A commit measured beside this checkout in one run: the benchmark script runs, as its own
process, in a temporary `git worktree` of the commit and in this checkout, so that a busy
machine or another JAX cache affects both alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def checkouts(against: str | None) -> Iterator[dict[str, Path]]:
  """{name: checkout}: a worktree of the commit `against` first, if given (removed on exit),
  then "this checkout"."""
  with tempfile.TemporaryDirectory() as scratch:
    if against is None:
      yield {"this checkout": ROOT}
      return
    base = Path(scratch) / "base"
    subprocess.run(
      ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), against],
      check=True,
      capture_output=True,
    )
    try:
      yield {against: base, "this checkout": ROOT}
    finally:
      subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)])


def measured_in(checkout: Path, script: str, *args: str) -> dict:
  """The JSON line `benchmarks/<script> --json *args` prints last, run by `checkout`'s code in
  a process of its own."""
  done = subprocess.run(
    [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json"],
    cwd=checkout,
    env={**os.environ, "PYTHONPATH": str(checkout)},
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(done.stdout.splitlines()[-1])


def table(columns: dict[str, dict[str, float]], cell: str) -> str:
  """Rows of `columns` ({column: {row: value}}), one column each, and with two columns the
  ratio of the last to the first; `cell` formats a value (a format spec, 14 wide)."""
  names = list(columns)
  two = len(names) > 1
  lines = [f"{'row':24}" + "".join(f"{name[:14]:>16}" for name in names) + "  ratio" * two]
  for row in columns[names[-1]]:
    cells = "".join(f"{format(columns[name][row], cell):>16}" for name in names)
    ratio = f"  {columns[names[-1]][row] / columns[names[0]][row]:.2f}" if two else ""
    lines.append(f"{row:24}{cells}{ratio}")
  return "\n".join(lines)
