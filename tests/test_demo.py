"""The README's main command, `python -m moejax demo`, run as a user would."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the demo in a subprocess


def run_demo(*flags: str) -> str:
  result = subprocess.run(
    [sys.executable, "-m", "moejax", "demo", *flags],
    capture_output=True,
    text=True,
    timeout=300,
    env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_demo_checks_against_reference_and_skips_chunks():
  out = run_demo("--mesh", "2x4", "--experts", "8", "--hidden", "32", "--intermediate", "64")
  error = float(re.search(r"max \|y - reference\| = (\S+)", out).group(1))
  assert error < 1e-4, out
  assert "padding rows all zero: True" in out
  rows = re.findall(r"^\s+(\d+)\s+\((\d),(\d)\)\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.M)
  assert len(rows) == 8, out
  assert int(rows[0][3]) == 0 and int(rows[1][3]) == 96, "rank 0 empty, rank 1 full"
  assert any(int(row[5]) > 0 for row in rows), "the default chunk size skips a chunk"
  assert "chunks run [0, 0, 0, 0, 0, 0, 0, 0]" in out
  assert "compiled executables for the 3 token-count patterns: 1" in out


def test_demo_rejects_a_bad_mesh_flag():
  result = subprocess.run(
    [sys.executable, "-m", "moejax", "demo", "--mesh", "two-by-four"],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert result.returncode != 0 and "--mesh must look like DATAxEXPERT" in result.stderr
