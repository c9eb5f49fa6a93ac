"""Checkpoints of sharded NNX models with orbax: save a model's state, restore it onto any mesh.

A checkpoint holds the model's parameter state under the parameters' own names (for an
`MoELayer`: router_kernel, w_gate_up, w_down, ...), plus, for resuming training, the
optimizer state and the step. Restoring takes its shardings from a freshly built target,
so a checkpoint written on one mesh shape restores onto another, and reads only what the
targets ask for (the model alone from a training checkpoint).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx

from moejax import files


def save(
  directory: str | Path,
  model: nnx.Module,
  optimizer: nnx.Optimizer | None = None,
  step: int = 0,
  *,
  overwrite: bool = False,
  info: dict | None = None,
) -> Path:
  """Writes the model's state (and the optimizer's, if given) and the step to `directory`.

  The state goes to a new folder inside `directory`, and `meta.json` (the step, and which
  folder holds the state) is replaced atomically once it is whole; the state it replaced is
  deleted after. A save interrupted anywhere leaves the previous checkpoint readable.

  Args:
    directory: the checkpoint folder (created if absent).
    model: the model whose `nnx.state` is saved.
    optimizer: its optimizer, to resume training, or None.
    step: the training step reached.
    overwrite: replace a checkpoint already in `directory` (else an error).
    info: JSON values to keep beside the state (`info_of` reads them), e.g. the flags that
      built the model.

  Returns:
    The checkpoint folder.

  Raises:
    FileExistsError: `directory` holds a checkpoint and not `overwrite`.
  """
  directory = Path(directory).absolute()
  previous = _meta(directory)
  if previous is not None and not overwrite:
    raise FileExistsError(
      f"{directory} holds a checkpoint (step {previous['step']}): pass overwrite=True to "
      "replace it, or save elsewhere"
    )
  directory.mkdir(parents=True, exist_ok=True)
  # A name every process of a multi-process job agrees on, never the one meta.json names now;
  # a folder of that name is what an interrupted save left.
  names = (f"state-{step}", f"state-{step}-next")
  state = names[1] if previous is not None and previous["state"] == names[0] else names[0]
  shutil.rmtree(directory / state, ignore_errors=True)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory / state, _pure(model, optimizer))
  meta = json.dumps({"step": step, "state": state, "info": info or {}})
  files.write_atomically(directory / _META, meta, overwrite=True)
  if previous is not None:
    shutil.rmtree(directory / previous["state"], ignore_errors=True)
  return directory


def exists(directory: str | Path) -> bool:
  """Whether `directory` holds a checkpoint (its `meta.json`)."""
  return _meta(Path(directory)) is not None


def step_of(directory: str | Path) -> int:
  """The training step a checkpoint was saved at.

  Raises:
    FileNotFoundError: `directory` holds no checkpoint.
  """
  meta = _meta(Path(directory))
  if meta is None:
    raise FileNotFoundError(f"{directory} holds no checkpoint (no {_META})")
  return meta["step"]


def info_of(directory: str | Path) -> dict:
  """The `info` a checkpoint was saved with ({} for one saved without, or before there was)."""
  return _meta(Path(directory)).get("info", {})


def holds(directory: str | Path, name: str) -> bool:
  """Whether a checkpoint's model state holds a variable called `name` (at any depth)."""
  directory = Path(directory).absolute()
  with ocp.PyTreeCheckpointer() as checkpointer:
    stored = checkpointer.metadata(directory / _meta(directory)["state"]).item_metadata.tree

  def found(tree) -> bool:
    return isinstance(tree, dict) and any(
      str(key) == name or found(value) for key, value in tree.items()
    )

  return found(stored.get("model", {}))


_META = "meta.json"


def _meta(directory: Path) -> dict | None:
  """meta.json's fields (checkpoints written before the state folder was named: "state"), or
  None without one."""
  path = directory / _META
  if not path.is_file():
    return None
  return {"state": "state", **json.loads(path.read_text())}


def _pure(model: nnx.Module, optimizer: nnx.Optimizer | None) -> dict:
  """Plain nested dicts of arrays: no variable metadata (whose mesh differs between meshes)."""
  state = {"model": nnx.to_pure_dict(nnx.state(model))}
  if optimizer is not None:
    state["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
  return state


def restore(
  directory: str | Path,
  model: nnx.Module,
  optimizer: nnx.Optimizer | None = None,
  *,
  may_lack: tuple[str, ...] = (),
) -> int:
  """Loads a checkpoint into `model` (and `optimizer`), laid out as they are now.

  The targets give shapes, dtypes and shardings: build them on the mesh you want, then
  restore. Only what they hold is read (a model alone from a checkpoint that also holds an
  optimizer). Variables named in `may_lack` that the checkpoint does not hold keep the
  targets' values (state a flag starts afresh). Returns the saved step.

  Raises:
    FileNotFoundError: `directory` holds no checkpoint.
    ValueError: the checkpoint lacks a part the targets hold, or holds it in another shape
      (named, e.g. "model/w_down is (8, 32, 16) in the checkpoint, (8, 64, 16) in the model").
  """
  directory = Path(directory).absolute()
  meta = _meta(directory)
  if meta is None:
    raise FileNotFoundError(f"{directory} holds no checkpoint (no {_META})")
  saved = directory / meta["state"]
  target = _pure(model, optimizer)
  with ocp.PyTreeCheckpointer() as checkpointer:
    stored = checkpointer.metadata(saved).item_metadata.tree
    target = _without_absent(target, stored, may_lack)
    problem = _mismatch(stored, target, ())
    if problem is not None:
      raise ValueError(f"cannot restore {directory} into these targets: {problem}")
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    restored = checkpointer.restore(
      saved,
      args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
    )
  for name, module in (("model", model), ("optimizer", optimizer)):
    if module is not None:
      state = nnx.state(module)
      nnx.replace_by_pure_dict(state, restored[name])
      nnx.update(module, state)
  return meta["step"]


def _without_absent(target: dict, stored, names: tuple[str, ...]) -> dict:
  """`target` less the variables named in `names` that `stored` lacks."""
  stored = {str(key): value for key, value in stored.items()} if isinstance(stored, dict) else {}
  kept = {}
  for key, value in target.items():
    if str(key) not in stored and str(key) in names:
      continue
    kept[key] = (
      _without_absent(value, stored.get(str(key)), names) if isinstance(value, dict) else value
    )
  return kept


def _mismatch(stored, target, path: tuple[str, ...]) -> str | None:
  """The first part of `target` that `stored` (the checkpoint's tree of array metadata) lacks
  or holds in another shape, in words; None if every part fits."""
  where = "/".join(path)
  if isinstance(target, dict):
    if not isinstance(stored, dict):
      return f"{where} is an array in the checkpoint, a group of {sorted(map(str, target))} here"
    stored = {str(key): value for key, value in stored.items()}
    for key, value in target.items():
      if str(key) not in stored:
        return f"the checkpoint has no {'/'.join((*path, str(key)))}"
      problem = _mismatch(stored[str(key)], value, (*path, str(key)))
      if problem is not None:
        return problem
    return None
  if isinstance(stored, dict):
    return f"{where} is a group in the checkpoint, an array here"
  if tuple(stored.shape) != tuple(target.shape):
    whose = "model" if path[0] == "model" else "optimizer"
    return (
      f"{where} is {tuple(stored.shape)} in the checkpoint, {tuple(target.shape)} in the {whose}"
    )
  return None
