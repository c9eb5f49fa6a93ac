"""Programs lowered for a CUDA GPU without one (`jax.export`), abstract quantized weights to
lower them with, and the collectives a compiled program runs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from kernels_pallas.compat import cuda_target
from kernels_pallas.formats import FORMATS
from kernels_pallas.quantized import BlockScaled


def cuda_custom_calls(fn, *shapes, disabled=(), device_kind="NVIDIA H100") -> str:
  """The MLIR text of `fn` exported for CUDA at `shapes` (abstract arguments), on a target of
  `device_kind`: its custom calls name the kernels it lowered to."""
  exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=list(disabled))
  with cuda_target(device_kind):
    return exported(*shapes).mlir_module()


def block_scaled_spec(shape: tuple[int, ...], rhs_format: str) -> BlockScaled:
  """Abstract `BlockScaled` weights [G, in, out] in a format (its default block; int4_group in
  groups of 128, which the kernels take as 32-row blocks)."""
  form = FORMATS[rhs_format]
  block = form.block or ((128, 1) if rhs_format == "int4_group" else form.default_block)
  scales = (shape[0], -(-shape[1] // block[0]), -(-shape[2] // block[1]))
  spec = jax.ShapeDtypeStruct
  global_scale = spec((shape[0], shape[2]), jnp.float32) if form.global_scale else None
  return BlockScaled(spec(shape, form.values), spec(scales, form.scales), block, global_scale)


_COMPUTATION = re.compile(r"^(ENTRY )?%?(\S+) .*\{$")
_COLLECTIVE = re.compile(r"= (.+?) (all-reduce|reduce-scatter|all-gather)(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, int, bool]]:
  """(op, bytes of its result, whether in the entry computation) of each all-reduce,
  reduce-scatter and all-gather in a compiled program's text (`Compiled.as_text()`)."""
  found, in_entry = [], False
  for line in hlo_text.splitlines():
    if computation := _COMPUTATION.match(line):
      in_entry = computation.group(1) is not None
    for result, op in _COLLECTIVE.findall(line):
      arrays = _ARRAY.findall(result)
      found.append((op, sum(_bytes(dtype, dims) for dtype, dims in arrays), in_entry))
  return found


def _bytes(dtype: str, dims: str) -> int:
  itemsize = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype)) // 8
  return itemsize * int(np.prod([int(d) for d in dims.split(",") if d]))


_BRANCHES = re.compile(r"(?:true|false)_computation=%([^,\s}]+)|branch_computations=\{([^}]*)\}")
_CALLS = re.compile(r"(?:calls|body|condition|to_apply)=%([^,\s}]+)")


def instructions(hlo_text: str) -> list[tuple[str, str]]:
  """(computation name, instruction line) of each instruction in a compiled program's text."""
  found, computation = [], None
  for line in hlo_text.splitlines():
    if header := _COMPUTATION.match(line):
      computation = header.group(2)
    elif computation is not None and "=" in line:
      found.append((computation, line.strip()))
  return found


def branch_depths(hlo_text: str) -> dict[str, int]:
  """How many `conditional` branches deep each computation runs (the most over the ways it is
  reached from the entry): 0 for code that always runs, 2 for a branch inside a branch."""
  edges = {}
  for computation, line in instructions(hlo_text):
    callees = edges.setdefault(computation, [])
    for single, listed in _BRANCHES.findall(line):
      names = [single] if single else [name.strip().lstrip("%") for name in listed.split(",")]
      callees += [(name, 1) for name in names]
    callees += [(name, 0) for name in _CALLS.findall(line)]
  depths = {name: 0 for name in _entries(hlo_text)}
  frontier = list(depths)
  while frontier:
    computation = frontier.pop()
    for callee, step in edges.get(computation, ()):
      if depths.get(callee, -1) < depths[computation] + step:
        depths[callee] = depths[computation] + step
        frontier.append(callee)
  return depths


def _entries(hlo_text: str) -> list[str]:
  """The names of a program's entry computations."""
  headers = (_COMPUTATION.match(line) for line in hlo_text.splitlines())
  return [header.group(2) for header in headers if header and header.group(1)]
