"""A commit measured beside this checkout in one run: the benchmark script runs, as its own
process, in a temporary `git worktree` of the commit and in this checkout, so that a busy
machine or another JAX cache affects both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from moejax import files

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _checkouts(against: str | None) -> Iterator[dict[str, Path]]:
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


def _measured_in(checkout: Path, script: str) -> dict:
  """The JSON line `benchmarks/<script> --json` (this checkout's script) prints last, run on
  `checkout`'s library in a process of its own."""
  done = subprocess.run(
    [sys.executable, str(ROOT / "benchmarks" / script), "--json"],
    cwd=checkout,
    env={**os.environ, "PYTHONPATH": str(checkout)},
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(done.stdout.splitlines()[-1])


def _table(columns: dict[str, dict[str, float]], cell: str) -> str:
  """Rows of `columns` ({column: {row: value}}), one column each, and with two columns the
  ratio of the last to the first; `cell` formats a value (a format spec; 16 wide)."""
  names = list(columns)
  two = len(names) > 1
  lines = [f"{'row':24}" + "".join(f"{name[:14]:>16}" for name in names) + "  ratio" * two]
  for row in columns[names[-1]]:
    cells = "".join(f"{format(columns[name][row], cell):>16}" for name in names)
    ratio = f"  {columns[names[-1]][row] / columns[names[0]][row]:.2f}" if two else ""
    lines.append(f"{row:24}{cells}{ratio}")
  return "\n".join(lines)


def compare_main(
  script: str,
  measure: Callable[[], dict[str, float]],
  description: str,
  cell: str,
  rounds: int | None = None,
) -> None:
  """A comparing benchmark's command line: `--json` prints `measure()`'s rows as one JSON
  line (what `_measured_in` reads); else each checkout (this one, and `--against REV`'s) runs
  `script --json`, `--rounds` times where `rounds` gives a default (each row's smallest kept,
  the checkouts alternating), and the table is printed and written to OUT/<script>.json,
  which an earlier run's file blocks (before anything is measured) unless `--overwrite`."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--against", metavar="REV", help="also measure this commit")
  if rounds is not None:
    parser.add_argument("--rounds", type=int, default=rounds, help="alternating rounds")
  parser.add_argument("--out", type=Path, default=Path("results"))
  parser.add_argument("--overwrite", action="store_true", help="replace OUT/<script>.json")
  parser.add_argument("--json", action="store_true", help="print one JSON line of the rows")
  args = parser.parse_args()
  if args.json:
    print(json.dumps(measure()))
    return
  written = args.out / f"{Path(script).stem}.json"
  if not args.overwrite:  # before the measuring, which takes minutes
    files.refuse_existing([written], how="pass --overwrite")
  with _checkouts(args.against) as measured:
    best: dict[str, dict[str, float]] = {name: {} for name in measured}
    for _ in range(getattr(args, "rounds", 1)):
      for name, checkout in measured.items():
        for row, value in _measured_in(checkout, script).items():
          best[name][row] = min(best[name].get(row, math.inf), value)
  print(_table(best, cell))
  args.out.mkdir(parents=True, exist_ok=True)
  files.write_atomically(written, json.dumps(best, indent=1), overwrite=args.overwrite)
