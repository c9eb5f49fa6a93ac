"""The layer across 2 processes (4 CPU devices each, gloo collectives), as on 2 hosts,
rebalancing its redundant experts there, and tuning files that differ between them."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two processes

WORKER = Path(__file__).parent / "multihost_worker.py"
ROOT = Path(__file__).parent.parent


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(process_ids, port: int, init_timeout: int) -> list[subprocess.Popen]:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  return [
    subprocess.Popen(
      [sys.executable, str(WORKER), str(pid), str(port), str(init_timeout)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      cwd=ROOT,
      env=env,
    )
    for pid in process_ids
  ]


def wait_all(processes: list[subprocess.Popen], deadline_s: float) -> list[tuple[int, str, str]]:
  """Waits for every process until the deadline; kills the rest then (no hang), and reports."""
  end = time.monotonic() + deadline_s
  results = []
  for process in processes:
    try:
      out, err = process.communicate(timeout=max(end - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      for other in processes:
        other.kill()
      out, err = process.communicate()
      err += f"\n[killed after the {deadline_s:.0f} s deadline]"
    results.append((process.returncode, out, err))
  return results


def test_two_processes_run_the_layer_on_a_shared_mesh():
  results = wait_all(launch([0, 1], free_port(), init_timeout=60), deadline_s=300)
  for pid, (code, out, err) in enumerate(results):
    checks = ("all_gather", "all_to_all", "redundant experts", "rebalanced", "tuned")
    ok = all(f"OK process {pid} ({what})" in out for what in checks)
    assert code == 0 and ok, f"process {pid} ({code}):\n{out}\n{err[-3000:]}"
  # Each process re-placed the experts from the load summed over both: the same placement.
  placements = {line for _, out, _ in results for line in out.splitlines() if "placement" in line}
  assert len(placements) == 1, placements


def test_a_missing_peer_fails_in_bounded_time():
  start = time.monotonic()
  ((code, out, _),) = wait_all(launch([0], free_port(), init_timeout=10), deadline_s=120)
  assert code != 0, out
  assert time.monotonic() - start < 120
