"""Writing files without losing what was there: nothing a user owns is replaced unless the
caller says so, and a write interrupted midway leaves the previous version whole (the new
bytes go to a temporary name in the same folder, then `os.replace` swaps them in: one atomic
rename on POSIX and Windows alike).

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "notes.txt"
>>> write_atomically(path, "first", overwrite=False)
>>> write_atomically(path, "second", overwrite=False)
Traceback (most recent call last):
...
FileExistsError: ... exists: pass overwrite=True to replace it
>>> write_atomically(path, "second", overwrite=True); path.read_text()
'second'
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def refuse_existing(paths: Iterable[str | Path], *, how: str = "pass overwrite=True") -> None:
  """Raises FileExistsError naming the first of `paths` that exists, and `how` to replace it
  (a command passes its flag: "pass --overwrite")."""
  for path in paths:
    if Path(path).exists():
      raise FileExistsError(f"{path} exists: {how} to replace it")


@contextlib.contextmanager
def atomic_path(path: str | Path, *, overwrite: bool, how: str = "pass overwrite=True"):
  """A temporary path beside `path` to write to; on a clean exit it replaces `path` whole,
  on an error it is removed and `path` is untouched.

  Raises:
    FileExistsError: `path` exists and not `overwrite` (before anything is written).
  """
  path = Path(path)
  if not overwrite:
    refuse_existing([path], how=how)
  path.parent.mkdir(parents=True, exist_ok=True)
  handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
  os.close(handle)
  try:
    yield Path(temporary)
    os.replace(temporary, path)
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(temporary)


def write_atomically(
  path: str | Path, data: str | bytes, *, overwrite: bool, how: str = "pass overwrite=True"
) -> None:
  """Writes `data` (text as UTF-8) to `path` through `atomic_path`."""
  with atomic_path(path, overwrite=overwrite, how=how) as temporary:
    if isinstance(data, str):
      temporary.write_text(data, encoding="utf-8")
    else:
      temporary.write_bytes(data)
