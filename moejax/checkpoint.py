"""Checkpoints of sharded NNX models with orbax: save a model's state, restore it onto any mesh.

A checkpoint holds the model's parameter state under the parameters' own names (for an
`MoELayer`: router_kernel, w_gate_up, w_down, ...), plus, for resuming training, the
optimizer state and the step. Restoring takes its shardings from a freshly built target,
so a checkpoint written on one mesh shape restores onto another.
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
  restore. Returns the saved step.
  """
  directory = Path(directory).absolute()
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(directory / "state", _pure(model, optimizer))
  for name, module in (("model", model), ("optimizer", optimizer)):
    if module is not None:
      state = nnx.state(module)
      nnx.replace_by_pure_dict(state, restored[name])
      nnx.update(module, state)
  return json.loads((directory / "meta.json").read_text())["step"]
