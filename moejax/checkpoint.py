"""Checkpoints of sharded NNX models with orbax: save a model's state, restore it onto any mesh.

A checkpoint holds the model's parameter state under the parameters' own names (for an
`MoELayer`: router_kernel, w_gate_up, w_down, ...), plus, for resuming training, the
optimizer state and the step. Restoring takes its shardings from a freshly built target,
so a checkpoint written on one mesh shape restores onto another, and reads only what the
targets ask for (the model alone from a training checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx


def save(
  directory: str | Path, model: nnx.Module, optimizer: nnx.Optimizer | None = None, step: int = 0
) -> Path:
  """Writes `directory`/state (model, and optimizer if given) and `directory`/meta.json.

  Args:
    directory: the checkpoint folder (created; an existing one is overwritten).
    model: the model whose `nnx.state` is saved.
    optimizer: its optimizer, to resume training, or None.
    step: the training step reached.

  Returns:
    The checkpoint folder.
  """
  directory = Path(directory).absolute()
  directory.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory / "state", _pure(model, optimizer), force=True)
  (directory / "meta.json").write_text(json.dumps({"step": step}))
  return directory


def _pure(model: nnx.Module, optimizer: nnx.Optimizer | None) -> dict:
  """Plain nested dicts of arrays: no variable metadata (whose mesh differs between meshes)."""
  state = {"model": nnx.to_pure_dict(nnx.state(model))}
  if optimizer is not None:
    state["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
  return state


def restore(
  directory: str | Path, model: nnx.Module, optimizer: nnx.Optimizer | None = None
) -> int:
  """Loads a checkpoint into `model` (and `optimizer`), laid out as they are now.

  The targets give shapes, dtypes and shardings: build them on the mesh you want, then
  restore. Only what they hold is read (a model alone from a checkpoint that also holds an
  optimizer). Returns the saved step.

  Raises:
    ValueError: the checkpoint lacks a part the targets hold, or holds it in another shape
      (named, e.g. "model/w_down is (8, 32, 16) in the checkpoint, (8, 64, 16) in the model").
  """
  directory = Path(directory).absolute()
  target = _pure(model, optimizer)
  with ocp.PyTreeCheckpointer() as checkpointer:
    stored = checkpointer.metadata(directory / "state").item_metadata.tree
    problem = _mismatch(stored, target, ())
    if problem is not None:
      raise ValueError(f"cannot restore {directory} into these targets: {problem}")
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    restored = checkpointer.restore(
      directory / "state",
      args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
    )
  for name, module in (("model", model), ("optimizer", optimizer)):
    if module is not None:
      state = nnx.state(module)
      nnx.replace_by_pure_dict(state, restored[name])
      nnx.update(module, state)
  return json.loads((directory / "meta.json").read_text())["step"]


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
