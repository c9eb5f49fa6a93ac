"""Measuring a layer's expert paths on the device it runs on: `moejax.tune` and `python -m moejax
tune`.

For each call size the layer makes (a decode-size call, one token per device; and the chunk of
`tokens_per_device` tokens the chunk budget picks), every candidate path the device can run
(the tile loop and ragged_dot everywhere; on a GPU each `kernels_pallas` kernel made for it)
runs the whole layer, forced onto that path: first its output and gradients (x and every float
parameter) are checked against `reference_moe` in float32 on fresh random inputs whose padding
is NaN (within `moejax.testing.RELATIVE_BOUNDS`; with `compute_quant`, against the tile loop's
emulation of the recipe, each other candidate an fp8 kernel that runs it); a candidate that
fails, raises or runs past `timeout_s` is recorded so and never chosen. Then the passing ones
are timed (device-synchronised, the median of `repeats` calls after a warm-up) and the fastest
is the case's winner (forward+backward, or forward with `forward_only`). The entries go to the
device kind's tuning file (`moejax.tuning`), which `expert_backend="auto"` then follows.

A call cannot be interrupted: `timeout_s` bounds a candidate's first (compiling) call after the
fact, and a candidate past it is not timed further.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from kernels_pallas import fused_moe, platform
from kernels_pallas.backends import BACKENDS, REFERENCE, unsupported_reason
from moejax import files, tokamax_experts, tuning
from moejax.call_plan import plan_call
from moejax.config import MoEConfig
from moejax.forward import moe_apply
from moejax.layer import MoELayer
from moejax.plan import expert_case, fp8_kernel_reason, fused_unsupported_reason
from moejax.reference import reference_moe
from moejax.testing import RELATIVE_BOUNDS, poison, rank_mask, relative_error
from moejax.tokamax_experts import TOKAMAX


def tune(
  config: MoEConfig,
  *,
  mesh: Mesh | None = None,
  tokens_per_device: int = 4096,
  repeats: int = 5,
  forward_only: bool = False,
  timeout_s: float = 300.0,
  overwrite: bool = False,
  write: bool = True,
  seed: int = 0,
) -> tuning.TuningFile:
  """Measures the layer's candidate expert paths for its call sizes on `mesh`'s devices (or
  the default device) and records the winners in the device kind's tuning file.

  Args:
    config: the layer's config (its `expert_backend` and `chunk_size` are the tuner's).
    mesh: the mesh the layer runs on, or None for one device.
    tokens_per_device: the tokens a device holds in a full-size call.
    repeats: timed calls per candidate (the median is kept).
    forward_only: choose winners by forward time (inference) instead of forward+backward.
    timeout_s: a candidate whose first call takes longer is recorded "timed_out".
    overwrite: replace entries the file already holds for the same case and size (a file
      that cannot be read is moved aside, to `<name>.unreadable`); without
      it such a file is an error naming them (its other entries are always kept).
    write: write the file (else only return what was measured).
    seed: of the random weights and inputs.

  Returns:
    The tuning file as written: the file's earlier entries and the new ones.

  Raises:
    FileExistsError: the file holds entries for the same cases, and not `overwrite`.
    tuning.TuningFileError: the existing file cannot be read.
    ValueError: the config's activation is a function (a file keys its entries by name).
  """
  if callable(config.activation):
    raise ValueError(
      f"activation={config.activation!r} is a function: tuning files key their entries by "
      "the activation's name, and only the XLA paths run a function (the tile loop here)"
    )
  device_kind = _device_kind(mesh)
  path = tuning.user_file(device_kind)
  if write:
    _check_writable(path.parent)
  text = tuning.read_file(path)
  before = tuning.TuningFile(device_kind=device_kind)
  if text is not None:
    try:
      before = tuning.TuningFile.from_json(text, str(path))
    except tuning.TuningFileError:
      if not (overwrite and write):
        raise
      # --overwrite (what the error advises) measures anew; the unreadable file is kept
      # beside, out of the way of the plans the measuring makes.
      aside = path.with_name(f"{path.name}.unreadable")
      os.replace(path, aside)
      logging.getLogger("moejax").warning(
        "moejax tune: %s cannot be read; moved to %s", path, aside
      )
  sizes = call_sizes(config, mesh, tokens_per_device)
  key = lambda entry: (tuple(sorted(entry.case.items())), entry.rows)
  measuring = {_key_of(config, mesh, per_device) for per_device in sizes}
  clashes = [entry for entry in before.entries if key(entry) in measuring]
  if clashes and not overwrite:
    raise FileExistsError(
      f"{path} already holds {len(clashes)} entr(y/ies) for these cases (rows "
      f"{sorted(entry.rows for entry in clashes)}): pass overwrite=True (--overwrite) to "
      "replace them"
    )
  entries = [
    _measure(config, mesh, per_device, repeats, forward_only, timeout_s, seed)
    for per_device in sizes
  ]
  kept = tuple(entry for entry in before.entries if key(entry) not in measuring)
  table = tuning.TuningFile(device_kind=device_kind, entries=(*kept, *entries))
  if write:
    files.write_atomically(path, table.to_json(), overwrite=True)
  return table


def _check_writable(folder: Path) -> None:
  """Makes the tuning folder; one that cannot be made or written is an error naming it,
  raised before anything is measured."""
  advice = (
    "set MOEJAX_CACHE_DIR to another folder"
    if os.environ.get("MOEJAX_CACHE_DIR")
    else "set MOEJAX_CACHE_DIR to a writable folder"
  )
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    raise OSError(f"the tuning folder {folder} cannot be made ({error}): {advice}") from None
  if not os.access(folder, os.W_OK):
    raise OSError(f"the tuning folder {folder} is not writable: {advice}")


def call_sizes(config: MoEConfig, mesh: Mesh | None, tokens_per_device: int) -> list[int]:
  """Tokens per device of the calls to measure: a decode-size call (1) and the chunk the
  layer's plan takes for `tokens_per_device` (one chunk per device)."""
  devices = 1 if mesh is None else mesh.devices.size
  call = plan_call(config, (devices * tokens_per_device, config.hidden_size), mesh=mesh)
  return sorted({1, call.layout.chunk})


def candidates(config: MoEConfig, mesh: Mesh | None) -> list[tuning.Candidate]:
  """The paths the target device can run the config's experts on (not yet measured): the
  tile loop, ragged_dot where XLA runs the case, and on a GPU each kernel made for it and the
  fused path where it runs the case. With `compute_quant`: the tile loop (the recipe
  emulated) and on a GPU the fp8 kernels that run it (`fp8_candidates`)."""
  case = expert_case(config)
  found = [tuning.Candidate(path="tile_loop", status="passed")]
  if config.compute_quant is not None:
    return found + fp8_candidates(config, mesh)
  with _running_on(mesh):
    if unsupported_reason(REFERENCE, case) is None:
      found.append(tuning.Candidate(path="ragged_dot", backend=REFERENCE, status="passed"))
    if not platform.on_cpu() and tokamax_experts.unsupported_reason(case) is None:
      found.append(tuning.Candidate(path="ragged_dot", backend=TOKAMAX, status="passed"))
    if not platform.on_cpu():
      capability = platform.gpu_compute_capability()
      for name, backend in BACKENDS.items():
        if (
          name != REFERENCE and backend.made_for(capability) and not unsupported_reason(name, case)
        ):
          # the backend's own choice, then each block configuration its registry entry names
          blocks_tried = (None, *map(dataclasses.asdict, backend.candidate_blocks))
          found += [
            tuning.Candidate(path="pallas", backend=name, blocks=blocks, status="passed")
            for blocks in blocks_tried
          ]
      if fused_unsupported_reason(config) is None:
        found.append(tuning.Candidate(path="fused", backend="triton", status="passed"))
  return found


def fp8_candidates(config: MoEConfig, mesh: Mesh | None) -> list[tuning.Candidate]:
  """On a GPU, the kernels that run the config's `compute_quant`: the Hopper fp8 kernels
  (`moejax.plan.fp8_kernel_reason`) and the fused path's (`fused_unsupported_reason`)."""
  found = []
  with _running_on(mesh):
    if not platform.on_cpu():
      if fp8_kernel_reason(config) is None:
        found.append(tuning.Candidate(path="pallas", backend="mosaic", status="passed"))
      if fused_unsupported_reason(config) is None:
        blocks = dataclasses.asdict(fused_moe.FP8_BLOCKS)  # what its plan takes
        found.append(
          tuning.Candidate(path="fused", backend="triton", blocks=blocks, status="passed")
        )
  return found


def _tuned_config(config: MoEConfig, per_device: int) -> MoEConfig:
  """The config a call of `per_device` tokens per device is measured with: one chunk."""
  return dataclasses.replace(config, expert_backend="auto", chunk_size=per_device)


def _case_and_rows(config: MoEConfig, mesh: Mesh | None, per_device: int):
  """(the case, the rows) of that call, as `moejax.tuning` keys it."""
  config = _tuned_config(config, per_device)
  devices = 1 if mesh is None else mesh.devices.size
  call = plan_call(config, (devices * per_device, config.hidden_size), mesh=mesh)
  return (
    tuning.case_of(config, call.exchange.local_experts),
    call.received_rows * config.top_k,
  )


def _key_of(config: MoEConfig, mesh: Mesh | None, per_device: int):
  case, rows = _case_and_rows(config, mesh, per_device)
  return tuple(sorted(case.items())), rows


def _measure(
  config: MoEConfig,
  mesh: Mesh | None,
  per_device: int,
  repeats: int,
  forward_only: bool,
  timeout_s: float,
  seed: int,
) -> tuning.Entry:
  """One case: every candidate checked, the passing ones timed, the winner chosen."""
  case, rows = _case_and_rows(config, mesh, per_device)
  config = _tuned_config(config, per_device)
  devices = 1 if mesh is None else mesh.devices.size
  shape = (devices * per_device, config.hidden_size)
  with _ambient(mesh):
    inputs = _inputs(config, mesh, shape, seed)
  # The float32 reference, on one device (host copies of the inputs); with compute_quant the
  # recipe as the tile loop emulates it (the kernels' numerics, up to rounding flips).
  host_inputs = jax.tree.map(np.asarray, inputs)
  if config.compute_quant is None:
    reference = _outputs(reference_moe, config, None, host_inputs)
  else:
    emulated = dataclasses.replace(config, expert_backend="xla")
    reference = _outputs(moe_apply, emulated, None, host_inputs)
  results = []
  for candidate in candidates(config, mesh):
    with _ambient(mesh), tuning.forcing(case, rows, candidate):
      jax.clear_caches()  # a compiled program of another candidate has the same signature
      results.append(_run(candidate, config, mesh, inputs, reference, repeats, timeout_s))
  passed = [c for c in results if c.status == "passed"]
  time_of = (lambda c: c.forward_ms) if forward_only else (lambda c: c.train_ms)
  winner = min(passed, key=time_of, default=None)
  return tuning.Entry(
    case=case,
    rows=rows,
    objective="forward" if forward_only else "train",
    candidates=tuple(results),
    winner=None if winner is None else winner.name,
    versions=tuning.versions_now(),
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Inputs:
  params: object
  x: jax.Array
  mask: jax.Array
  probe: jax.Array


def _inputs(config: MoEConfig, mesh: Mesh | None, shape: tuple[int, int], seed: int) -> _Inputs:
  """Fresh random weights (as the layer holds them), tokens with about a quarter of every
  device's rows padding, and a random cotangent."""
  keys = jax.random.split(jax.random.key(seed))
  devices = 1 if mesh is None else mesh.devices.size
  per_device = shape[0] // devices
  counts = [max(1, per_device - per_device // 4 - d % 2) for d in range(devices)]
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(seed))
  return _Inputs(
    params=layer.moe_params(),
    x=jax.random.normal(keys[0], shape, jnp.float32).astype(config.dtype),
    mask=rank_mask(counts, per_device),
    probe=jax.random.normal(keys[1], (shape[0], config.hidden_size), jnp.float32),
  )


def _outputs(layer: Callable, config: MoEConfig, mesh: Mesh | None, inputs: _Inputs):
  """`_functions`' (y, gradients) on the inputs."""
  forward, loss = _functions(layer, config, mesh, inputs)
  return jax.block_until_ready((forward(inputs.params, inputs.x), loss(inputs.params, inputs.x)))


def _functions(layer: Callable, config: MoEConfig, mesh: Mesh | None, inputs: _Inputs):
  """(forward, gradient of <y, probe> with respect to x and, for float experts, the
  parameters), jitted; the fast path gets x poisoned where masked."""
  if layer is reference_moe:
    apply = lambda p, x: reference_moe(p, x, config, token_mask=inputs.mask)
  else:
    apply = lambda p, x: moe_apply(
      p, poison(x, inputs.mask), config=config, mesh=mesh, token_mask=inputs.mask
    )[0]
  value = lambda p, x: jnp.sum(
    jnp.where(inputs.mask[:, None], apply(p, x).astype(jnp.float32), 0.0) * inputs.probe
  )
  argnums = (0, 1) if config.expert_quant is None else (1,)  # quantized experts: constants
  return jax.jit(apply), jax.jit(jax.grad(value, argnums=argnums))


def _run(
  candidate: tuning.Candidate,
  config: MoEConfig,
  mesh: Mesh | None,
  inputs: _Inputs,
  reference,
  repeats: int,
  timeout_s: float,
) -> tuning.Candidate:
  """The candidate checked and, if it passes, timed."""
  try:
    taken = plan_call(config, inputs.x, mesh=mesh).expert
    blocks = None if taken.blocks is None else dataclasses.asdict(taken.blocks)
    if (taken.path, taken.backend, blocks) != (candidate.path, candidate.backend, candidate.blocks):
      raise RuntimeError(f"the layer took {taken.path} ({taken.backend}), not the candidate")
    forward, gradient = _functions(moe_apply, config, mesh, inputs)
    start = time.perf_counter()
    y, grads = jax.block_until_ready(
      (forward(inputs.params, inputs.x), gradient(inputs.params, inputs.x))
    )
    first_s = time.perf_counter() - start
  except Exception as error:  # a candidate that raises is recorded, never chosen
    return dataclasses.replace(
      candidate, status="crashed", detail=f"{type(error).__name__}: {error}"[:500]
    )
  error = relative_error(y, reference[0])
  grad_error = _gradient_error(grads, reference[1])
  checked = dataclasses.replace(candidate, error=error, grad_error=grad_error)
  bound = RELATIVE_BOUNDS[jnp.dtype(config.dtype)]
  if not (error <= bound and grad_error <= 2 * bound):
    detail = f"relative error {error:.2g}, gradients {grad_error:.2g}; bounds {bound}, {2 * bound}"
    return dataclasses.replace(checked, status="failed", detail=detail)
  if first_s > timeout_s:
    return dataclasses.replace(checked, status="timed_out", detail=f"first call {first_s:.0f} s")
  return dataclasses.replace(
    checked,
    status="passed",
    forward_ms=_median_ms(forward, inputs, repeats),
    train_ms=_median_ms(gradient, inputs, repeats),
  )


def _gradient_error(grads, reference) -> float:
  """The largest of the leaves' max |a - b| over max(max |b|, a thousandth of the largest
  leaf's max |b|): a leaf whose reference is ~0 (a new adapter's A) is held to the others'
  scale, not to its own rounding. inf where a gradient is not finite."""
  pairs = [
    (np.asarray(a, np.float64), np.asarray(b, np.float64))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True)
  ]
  if not all(np.all(np.isfinite(a)) for a, _ in pairs):
    return float("inf")
  largest = max(float(np.max(np.abs(b))) for _, b in pairs)
  return max(
    float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-3 * largest, 1e-30)
    for a, b in pairs
  )


def _median_ms(fn: Callable, inputs: _Inputs, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(inputs.params, inputs.x))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def _device_kind(mesh: Mesh | None) -> str:
  with _running_on(mesh):
    return platform.target().device_kind


def _ambient(mesh: Mesh | None) -> contextlib.AbstractContextManager:
  """`jax.set_mesh(mesh)`, or nothing for one device."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


@contextlib.contextmanager
def _running_on(mesh: Mesh | None) -> Iterator[None]:
  with platform.running_on(None if mesh is None else mesh.devices.flat[0]):
    yield
