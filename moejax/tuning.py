"""Tuning files: which expert path a device measured fastest for each call, and what `auto`
reads to choose (docs/tuning.md holds the format, field by field).

`python -m moejax tune` (`moejax.tuner`) measures the candidate paths of a layer's calls on the
device it runs on and writes one JSON file per device kind into the user's cache folder
(`MOEJAX_CACHE_DIR`, else `$XDG_CACHE_HOME/moejax` or `~/.cache/moejax`). A table shipped
with moejax (`moejax/tuned/`, filled from recorded GPU runs only) has the same format.
`expert_backend="auto"` reads, in order, the user's file for the device kind the call is made
for, the shipped table, else takes the XLA path (`moejax.plan.choose_plan`), and the call
plan names the file it used.

An entry applies to calls of the same case (the config's expert fields, the local experts
and K) whose (row, choice) assignments are within a factor of 2 of the entry's; the nearest
wins. Entries measured with other versions of moejax, JAX, jaxlib, CUDA or the driver are
ignored, with a one-line notice (a machine without a GPU, compiling for one, compares the
versions it knows). A file that cannot be read is an error naming it, never a
silent change of path. In a multi-process job every process uses process 0's file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import itertools
import json
import math
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import jax.extend.backend

from kernels_pallas import platform
from moejax.config import ExpertPath, MoEConfig
from moejax.version import __version__

FORMAT = 1
SHIPPED_DIR = Path(__file__).parent / "tuned"
# A call's entry may be measured at up to this factor fewer or more (row, choice) assignments.
ROWS_FACTOR = 2.0

Status = Literal["passed", "failed", "crashed", "timed_out"]


class TuningFileError(ValueError):
  """A tuning file that cannot be read: its path and what is wrong with it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  """One way to run a case's experts, and what measuring it found.

  Attributes:
    path: the expert path ("tile_loop", "ragged_dot", "pallas").
    backend: the `kernels_pallas` backend of a sorted path ("xla" for ragged_dot), or None.
    status: "passed" (output and gradients within tolerance), "failed" (outside it, or not
      finite), "crashed" (an error; `detail` says which) or "timed_out".
    error: max |candidate - reference| / max |reference| of the output, or None.
    grad_error: the largest over the gradients' leaves (parameters and x), each over its max
      magnitude or a thousandth of the largest leaf's, or None.
    forward_ms: median forward time, or None (not timed: only passing candidates are).
    train_ms: median forward+backward time, or None.
    detail: the error or the reason, for a candidate that did not pass.
    blocks: a kernel's forward block sizes (the fields of its backend's `blocks_type`), or
      None for the blocks `kernels_pallas` picks.
  """

  path: ExpertPath
  backend: str | None = None
  blocks: dict[str, int] | None = None
  status: Status
  error: float | None = None
  grad_error: float | None = None
  forward_ms: float | None = None
  train_ms: float | None = None
  detail: str | None = None

  @property
  def name(self) -> str:
    """'tile_loop', 'ragged_dot', 'ragged_dot:tokamax', 'pallas:mosaic',
    'pallas:mosaic[128x256x64x4]'."""
    if self.path == "ragged_dot":
      return self.path if self.backend in (None, "xla") else f"ragged_dot:{self.backend}"
    if self.path != "pallas":
      return self.path
    blocks = "" if self.blocks is None else "[" + "x".join(map(str, self.blocks.values())) + "]"
    return f"pallas:{self.backend}{blocks}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
  """One measured case: its candidates and the winner.

  Attributes:
    case: the config's expert fields the measurement holds for (`case_of`).
    rows: the (row, choice) assignments of the call measured, N·K.
    objective: "train" (the winner is the fastest forward+backward) or "forward".
    candidates: every candidate tried.
    winner: the winning candidate's `name`, or None if none passed.
    versions: what it was measured with (`versions_now`).
  """

  case: dict[str, Any]
  rows: int
  objective: Literal["train", "forward"]
  candidates: tuple[Candidate, ...]
  winner: str | None
  versions: dict[str, str | None]

  def winning(self) -> Candidate | None:
    return next((c for c in self.candidates if c.name == self.winner), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuningFile:
  """Every entry measured on one device kind."""

  device_kind: str
  entries: tuple[Entry, ...] = ()

  def to_json(self) -> str:
    record = dict(format=FORMAT, **dataclasses.asdict(self))
    return json.dumps(record, indent=1) + "\n"

  @staticmethod
  def from_json(text: str, source: str) -> TuningFile:
    """Parses a tuning file; any malformed part is a `TuningFileError` naming `source`."""
    try:
      record = json.loads(text)
      if record.get("format") != FORMAT:
        raise ValueError(f"format {record.get('format')!r}, expected {FORMAT}")
      entries = tuple(
        Entry(
          **{
            **entry,
            "candidates": tuple(Candidate(**c) for c in entry["candidates"]),
          }
        )
        for entry in record["entries"]
      )
      for entry in entries:
        if entry.winner is not None and entry.winning() is None:
          raise ValueError(f"winner {entry.winner!r} is none of the entry's candidates")
      return TuningFile(device_kind=record["device_kind"], entries=entries)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
      raise TuningFileError(
        f"tuning file {source} cannot be read ({error}); delete it or measure again with "
        "`python -m moejax tune ... --overwrite`"
      ) from error


def cache_dir() -> Path:
  """The user's tuning folder: `MOEJAX_CACHE_DIR`, else `$XDG_CACHE_HOME/moejax`, else
  `~/.cache/moejax`."""
  if folder := os.environ.get("MOEJAX_CACHE_DIR"):
    return Path(folder)
  base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(base) / "moejax"


def file_name(device_kind: str) -> str:
  """'NVIDIA H200' -> 'tuning-nvidia_h200.json'; a device without a kind has no file (a
  ValueError saying so).

  >>> file_name("NVIDIA H200")
  'tuning-nvidia_h200.json'
  """
  slug = re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")
  if not slug:
    raise ValueError(
      f"device_kind={device_kind!r} names no device: tuning files are kept per device kind "
      "(jax.Device.device_kind), which this device does not report"
    )
  return f"tuning-{slug}.json"


def user_file(device_kind: str) -> Path:
  return cache_dir() / file_name(device_kind)


def versions_now() -> dict[str, str | None]:
  """The versions a measurement holds for: moejax (the code that runs, installed or not), JAX,
  jaxlib, and on a GPU its CUDA and driver (JAX's platform version string), else None."""
  return {
    "moejax": __version__,
    "jax": jax.__version__,
    "jaxlib": _installed("jaxlib"),
    "cuda_and_driver": _gpu_platform_version() if platform.platform() == "gpu" else None,
  }


def _gpu_platform_version() -> str | None:
  """The GPU backend's CUDA and driver versions, as JAX reports them; None where no GPU
  backend runs (compile-only GPUs)."""
  try:
    return str(jax.extend.backend.get_backend("gpu").platform_version)
  except RuntimeError:
    return None


def same_versions(measured: dict[str, str | None], now: dict[str, str | None]) -> bool:
  """Whether an entry's versions are today's: every version known now is the entry's (a
  machine without a GPU, compiling for one, knows no CUDA or driver version)."""
  return measured.keys() == now.keys() and all(
    value is None or measured[name] == value for name, value in now.items()
  )


def _installed(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def case_of(config: MoEConfig, local_experts: int) -> dict[str, Any]:
  """The fields of a call an entry must match: what the expert computation is. fp8 compute
  ("compute_quant") and output norms ("expert_output_norm": true) are named only where a
  config has them, so that entries written before they were keys keep their cases."""
  case = {
    "dtype": jax.numpy.dtype(config.dtype).name,
    "param_dtype": jax.numpy.dtype(config.param_dtype).name,
    "activation": config.activation,
    "expert_quant": config.expert_quant,
    "expert_bias": config.expert_bias,
    "lora_rank": config.lora_rank,
    "hidden_size": config.expert_width,  # the experts' rows: L with a latent width
    "intermediate_size": config.intermediate_size,
    "local_experts": local_experts,
    "top_k": config.top_k,
  }
  if config.compute_quant is not None:
    case["compute_quant"] = config.compute_quant
  if config.expert_output_norm_eps is not None:
    case["expert_output_norm"] = True
  return case


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
  """What a tuning table says of a call: the winning candidate and where that was read."""

  candidate: Candidate
  entry: Entry
  source: str

  def reason(self, rows: int) -> str:
    passed = sum(c.status == "passed" for c in self.entry.candidates)
    return (
      f"expert_backend='auto': {self.source} measured {self.candidate.name} fastest of "
      f"{passed} candidate(s) that passed the check, at {self.entry.rows} rows (the call has "
      f"{rows})"
    )


def measured(config: MoEConfig, rows: int, local_experts: int) -> Measured | None:
  """The tuned choice for a call of `rows` (row, choice) assignments on `local_experts`, from
  the user's file for the target device kind, else the shipped table; None if neither has one.

  Raises:
    TuningFileError: a file that exists cannot be read.
  """
  device_kind = platform.target().device_kind
  case = case_of(config, local_experts)
  for source, table in [*_FORCED, *_tables(device_kind)]:
    entry = _nearest(table, case, rows)
    if entry is not None and (candidate := entry.winning()) is not None:
      return Measured(candidate=candidate, entry=entry, source=source)
  return None


def _nearest(table: TuningFile, case: dict[str, Any], rows: int) -> Entry | None:
  near = [
    entry
    for entry in table.entries
    if entry.case == case and abs(math.log(entry.rows / rows)) <= math.log(ROWS_FACTOR)
  ]
  return min(near, key=lambda e: abs(math.log(e.rows / rows)), default=None)


# The candidate `moejax.tuner` is measuring, ahead of every file: (source, one-entry table).
_FORCED: list[tuple[str, TuningFile]] = []


@contextlib.contextmanager
def forcing(case: dict[str, Any], rows: int, candidate: Candidate) -> Iterator[None]:
  """Within the block, calls of `case` at `rows` assignments take `candidate` (what the tuner
  checks and times), whatever the files say."""
  entry = Entry(
    case=case,
    rows=rows,
    objective="train",
    candidates=(candidate,),
    winner=candidate.name,
    versions=versions_now(),
  )
  _FORCED.append(("the candidate being tuned", TuningFile(device_kind="", entries=(entry,))))
  try:
    yield
  finally:
    _FORCED.pop()


def _tables(device_kind: str) -> list[tuple[str, TuningFile]]:
  """(source, table) for the device kind: the user's file, then the shipped one; each without
  the entries of other versions (a notice says how many). None for a device that reports no
  kind: tuning files are kept per kind."""
  if not device_kind:
    return []
  shipped = SHIPPED_DIR / file_name(device_kind)
  found = []
  for path, text in (
    (user_file(device_kind), _user_text(device_kind)),
    (shipped, read_file(shipped)),
  ):
    if text is not None:
      found.append((str(path), _current_entries(text, str(path))))
  return found


def _user_text(device_kind: str) -> str | None:
  """The user's tuning file for `device_kind`, as text (None: none); in a multi-process job,
  process 0's, so that every process plans the same program."""
  text = read_file(user_file(device_kind))
  if jax.process_count() == 1:
    return text
  return _process_zeros(f"moejax/tuning/{file_name(device_kind)}", text)


def read_file(path: Path) -> str | None:
  """A tuning file's text, or None if there is none.

  Raises:
    TuningFileError: it exists but cannot be read.
  """
  try:
    return path.read_text()
  except FileNotFoundError:
    return None
  except OSError as error:
    raise TuningFileError(f"tuning file {path} cannot be read ({error})") from error


@functools.lru_cache(maxsize=16)
def _current_entries(text: str, source: str) -> TuningFile:
  """The table in `text`, without entries of other versions (a one-line notice, once)."""
  table = TuningFile.from_json(text, source)
  now = versions_now()
  kept = tuple(entry for entry in table.entries if same_versions(entry.versions, now))
  if len(kept) < len(table.entries):
    warnings.warn(
      f"moejax: {len(table.entries) - len(kept)} of {len(table.entries)} entries of {source} "
      f"were measured with other versions and are ignored (now {now}); measure again with "
      "`python -m moejax tune`",
      stacklevel=2,
    )
  return dataclasses.replace(table, entries=kept)


# Lookups of the user's file so far: every process makes the same ones in the same order (they
# trace the same programs), so the n-th lookup of each process is process 0's n-th.
_LOOKUPS = itertools.count()


def _process_zeros(name: str, text: str | None) -> str | None:
  """Process 0's `text`, shared through JAX's distributed key-value store (host to host, no
  device program): every process returns it; one whose own differs says so, once."""
  from jax._src import distributed  # the coordinator's key-value store

  client = distributed.global_state.client
  key = f"{name}#{next(_LOOKUPS)}"
  if jax.process_index() == 0:
    client.key_value_set(key, "" if text is None else "1" + text)
  try:
    shared = client.blocking_key_value_get(key, 60_000)
  except jax.errors.JaxRuntimeError as error:
    raise TuningFileError(
      f"process {jax.process_index()} waited 60 s for process 0's tuning file ({key}): in a "
      "multi-process job every process makes the same calls that plan (moe_apply, plan_call, "
      f"layer.plan), in the same order ({error})"
    ) from None
  shared = shared[1:] if shared else None
  if shared != text:
    _say_once(
      "moejax: this process's tuning file differs from process 0's; every process uses "
      "process 0's, so that all compile the same program"
    )
  return shared


@functools.cache
def _say_once(notice: str) -> None:
  warnings.warn(notice, stacklevel=3)
