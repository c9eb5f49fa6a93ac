"""What the `python -m moejax` commands build from their flags: the mesh and the MoEConfig.

Imported by the commands only after `moejax.apps.cli` has set the simulated device count.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

import jax
from jax.sharding import Mesh

from moejax.call_record import call_record
from moejax.config import MoEConfig
from moejax.inputs import check_mesh

T = TypeVar("T")


def layer_mesh(args: argparse.Namespace, shape: tuple[int, int], config: MoEConfig) -> Mesh:
  """A (data, expert) mesh of the first data*expert devices, explicit axes as
  `jax.make_mesh` makes them by default; a --mesh
  the layer cannot use (too few devices, experts that do not split over it) exits with its
  message."""
  devices = len(jax.devices())
  if devices < shape[0] * shape[1]:
    raise SystemExit(
      f"moejax {args.command}: --mesh {shape[0]}x{shape[1]}: a {shape[0]}x{shape[1]} mesh "
      f"needs {shape[0] * shape[1]} devices, found {devices}"
    )
  mesh = jax.make_mesh(shape, ("data", "expert"))
  try:
    check_mesh(call_record(config, mesh))
  except ValueError as error:
    raise SystemExit(f"moejax {args.command}: --mesh {shape[0]}x{shape[1]}: {error}") from None
  return mesh


def moe_config(args: argparse.Namespace, **overrides) -> MoEConfig:
  """The MoEConfig of the --experts, --top-k, --hidden, --intermediate, --chunk-size flags;
  flags that make no valid config exit with its message."""
  return from_flags(
    args,
    MoEConfig,
    num_experts=args.experts,
    top_k=args.top_k,
    hidden_size=args.hidden,
    intermediate_size=args.intermediate,
    chunk_size=args.chunk_size,
    **overrides,
  )


def from_flags(args: argparse.Namespace, build: Callable[..., T], **fields) -> T:
  """`build(**fields)`, for a config made of flags: one they make invalid exits with its
  message (naming the field), not a traceback."""
  try:
    return build(**fields)
  except (TypeError, ValueError) as error:
    raise SystemExit(f"moejax {args.command}: {error}") from None
