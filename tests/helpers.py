"""Shared test helpers: tolerances per dtype, seeded random inputs, meshes, compile counting."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kernels_pallas import compat
from moejax import MoEConfig, MoEParams, eplb, moe_apply, reference_moe
from moejax.call_record import call_record
from moejax.testing import poison, tolerance

# The meshes (data, expert) and dispatch schemes every layer contract runs on; None: no mesh.
MESHES = (None, (1, 8), (2, 4), (4, 2), (8, 1))
SCHEMES = ("all_gather", "all_to_all")

# A small layer every contract starts from.
BASE = dict(num_experts=8, top_k=2, hidden_size=16, intermediate_size=24, chunk_size=4)
# Grouped top-k with a selection bias, sigmoid scores of soft-capped logits and a scaled
# shared expert: the richest routing.
RICH = dict(
  top_k=3,
  scoring="sigmoid",
  router_logit_softcap=2.0,
  renormalize=True,
  use_routing_bias=True,
  num_expert_groups=4,
  topk_groups=2,
  num_shared_experts=1,
  shared_intermediate_size=8,
  shared_scaling_factor=0.5,
  output_bias=True,
)
# Routing and model-family options, each a set of MoEConfig fields over BASE.
OPTIONS = {
  "softmax": {},
  "sigmoid-renorm-scaled": dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5),
  "grouped": dict(num_expert_groups=4, topk_groups=2, top_k=3),
  "gelu-top1": dict(activation="gelu", top_k=1),
  "all-experts": dict(top_k=8, chunk_size=3),
  "gelu_tanh": dict(activation="gelu_tanh"),
  "gpt_oss": dict(
    activation="swiglu_oai",
    swiglu_limit=1.0,  # small enough that the clamps bind on these inputs
    swiglu_alpha=1.3,  # not GPT-OSS's: MiniMax-M3 reads its own
    expert_bias=True,
    router_bias=True,
    renormalize=True,
  ),
  "llama4": dict(top_k=1, apply_router_weight_on_input=True, scoring="sigmoid"),
  "phimoe": dict(scoring="sparsemixer", sparsemixer_eps=0.2),
  "qwen2_moe": dict(num_shared_experts=1, shared_intermediate_size=12, shared_expert_gate=True),
  "longcat": dict(num_zero_experts=3, use_routing_bias=True, top_k=3, routed_scaling_factor=1.5),
  # latent experts (8 of D = 16), squared-ReLU as "relu" with gate = up, a shared expert
  "nemotron_h": dict(
    latent_size=8,
    activation="relu",
    scoring="sigmoid",
    use_routing_bias=True,
    renormalize=True,
    num_shared_experts=1,
    shared_intermediate_size=8,
  ),
  # Muse Spark's: latent experts between two RMS norms, the latent rows' and each expert
  # output's
  "muse_spark": dict(
    latent_size=8,
    latent_norm_eps=1e-5,
    expert_output_norm_eps=1e-6,
    scoring="sigmoid",
    use_routing_bias=True,
    renormalize=True,
    routed_scaling_factor=1.5,
  ),
  # Inkling's: two shared experts scored by the router, renormalized with the chosen ones
  "inkling": dict(
    scoring="sigmoid",
    use_routing_bias=True,
    renormalize=True,
    routed_scaling_factor=1.5,
    num_shared_experts=2,
    shared_intermediate_size=16,
    shared_expert_scores=True,
  ),
}


# A small layer with a shared expert, chunked: the configs of the misuse and mesh-kind tests
# (one config, so their compiled programs are shared).
SMALL_SHARED = MoEConfig(
  num_experts=8,
  top_k=2,
  hidden_size=16,
  intermediate_size=32,
  chunk_size=4,
  num_shared_experts=1,
  shared_intermediate_size=8,
)


def slow(*values, **kwargs):
  """A `pytest.param` in the slow tier (tests/conftest.py)."""
  return pytest.param(*values, marks=pytest.mark.slow, **kwargs)


def assert_close(
  actual,
  expected,
  dtype=jnp.float32,
  what: str = "value",
  *,
  comparison: str = "layer",
  atol: float | None = None,
  rtol: float | None = None,
) -> None:
  """Asserts |actual - expected| <= atol + rtol * |expected| elementwise, and actual finite;
  a failure prints the max abs and rel errors. The bounds are `TOLERANCES[comparison,
  dtype]`'s, or `atol` / `rtol` where given."""
  table = tolerance(dtype, comparison)
  atol = table["atol"] if atol is None else atol
  rtol = table["rtol"] if rtol is None else rtol
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  error = np.abs(actual - expected)
  bound = atol + rtol * np.abs(expected)
  worst = float(np.max(error / bound)) if error.size else 0.0
  max_abs = float(error.max()) if error.size else 0.0
  max_rel = float(np.max(error / (np.abs(expected) + 1e-30))) if error.size else 0.0
  assert worst <= 1.0, (
    f"{what}: max abs error {max_abs:.3g}, max rel error {max_rel:.3g} "
    f"(atol={atol}, rtol={rtol}, worst ratio {worst:.3g})"
  )


def seed_of(name: str) -> int:
  """A stable seed from a test's name, so each test draws its own inputs."""
  return zlib.crc32(name.encode())


def random_adapters(config: MoEConfig, key: jax.Array, scale: float = 0.1):
  """(ExpertLoRA, SharedLoRA or None) of the config's rank, every entry random (B too: a
  trained adapter, not PEFT's zero-B start), `scale` times standard normal."""
  draw = lambda expected, key: (
    None
    if expected is None
    else type(expected)(
      *(
        scale * jax.random.normal(k, e.shape)
        for k, e in zip(jax.random.split(key, len(expected)), expected, strict=True)
      )
    )
  )
  record = call_record(config)
  return (
    draw(record.lora, jax.random.fold_in(key, 1)),
    draw(record.shared_lora, jax.random.fold_in(key, 2)),
  )


def mesh_of(data: int, expert: int, axis_names=("data", "expert")) -> Mesh:
  """A (data, expert) mesh of the first data*expert devices, automatic axes."""
  devices = np.array(jax.devices()[: data * expert]).reshape(data, expert)
  return Mesh(devices, axis_names)


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
  """Collects one entry per executable built inside the block: compiled by XLA, or read back
  from the run's compilation cache (tests/conftest.py; JAX times both as a backend compile)."""
  events: list[str] = []

  def listener(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def expect_triton_deprecation() -> contextlib.AbstractContextManager:
  """Expects JAX's Pallas Triton deprecation warning where the installed JAX gives it (0.11+)
  while a Triton kernel is lowered for a GPU."""
  if compat.TRITON_LOWERING_WARNS:
    return pytest.warns(DeprecationWarning, match=compat.TRITON_DEPRECATION_MESSAGE)
  return contextlib.nullcontext()


def mesh_id(shape: tuple[int, int] | None) -> str:
  """A test id for a mesh shape: "2x4", or "no mesh"."""
  return "no mesh" if shape is None else f"{shape[0]}x{shape[1]}"


Layer = Callable[[Any, jax.Array, jax.Array], jax.Array]  # (params, x [T, D], mask [T]) -> y


@functools.partial(jax.jit, static_argnums=0)
def output(layer: Layer, params, x: jax.Array, mask: jax.Array) -> jax.Array:
  """layer(params, x, mask), compiled."""
  return layer(params, x, mask)


@functools.partial(jax.jit, static_argnums=0)
def output_and_gradients(layer: Layer, params, x: jax.Array, mask: jax.Array, probe: jax.Array):
  """y = layer(params, x, mask) and the gradients (params, x) of sum(sin(y) * probe), from
  one `jax.vjp` in one compiled program. A probe of random signs and sizes makes every
  output's cotangent differ, so no gradient can pass by symmetry.

  Args:
    layer: (params, x, mask) -> y [T, D]; hashable (the jit cache keys on it).
    params: a pytree of arrays (integer leaves get float0 cotangents).
    x: [T, D] tokens.
    mask: [T] bool.
    probe: [T, D] float32.
  """
  y, pullback = jax.vjp(lambda p, x: layer(p, x, mask), params, x)
  cotangent = jnp.cos(y.astype(jnp.float32)) * probe  # d sum(sin(y) * probe) / dy
  return y, pullback(cotangent.astype(y.dtype))


def check_layer(
  ours: Layer,
  theirs: Layer,
  params,
  x: jax.Array,
  mask: jax.Array,
  *,
  seed: int,
  dtype=jnp.float32,
  reference_params=None,
  gradients_of: Callable | None = None,
  gradients: bool = True,
) -> None:
  """`ours` against `theirs` on NaN-poisoned padding: y (exactly 0 on padding) and, with
  `gradients`, those of every parameter and of x (0 on padding), at `tolerance(dtype)`.

  Args:
    ours: the layer under test, (params, x, mask) -> y [T, D].
    theirs: the reference, (reference_params, x, mask) -> y [T, D] float32.
    params: ours' parameters (those it is differentiated by).
    x: [T, D] tokens (float32 or the compute dtype).
    mask: [T] bool.
    seed: draws the probe of the gradients' loss, sum(sin(y) * probe).
    dtype: the compute dtype, which sets the tolerance.
    reference_params: theirs' parameters (default: `params`).
    gradients_of: maps ours' parameter gradients onto theirs' (e.g. summing replicas).
    gradients: also compare gradients.
  """
  reference = params if reference_params is None else reference_params
  if not gradients:
    y, want_y = output(ours, params, poison(x, mask), mask), output(theirs, reference, x, mask)
  else:
    probe = jax.random.normal(jax.random.key(seed), x.shape)
    y, (got, got_x) = output_and_gradients(ours, params, poison(x, mask), mask, probe)
    want_y, (want, want_x) = output_and_gradients(theirs, reference, x, mask, probe)
  assert_close(y, want_y, dtype, "y")
  padding = ~np.asarray(mask)
  assert np.all(np.asarray(y, np.float32)[padding] == 0), "padding rows not zero"
  if not gradients:
    return
  assert np.all(np.asarray(got_x, np.float32)[padding] == 0), "gradient leaked into padding"
  assert_close(got_x, want_x, dtype, "d x")
  got = got if gradients_of is None else gradients_of(got)
  assert_trees_close(got, want, dtype, "d params")


def assert_trees_close(actual, expected, dtype=jnp.float32, what: str = "value") -> None:
  """`assert_close` leaf by leaf, each named by its path; the trees' structures must match."""
  structures = jax.tree.structure(actual), jax.tree.structure(expected)
  assert structures[0] == structures[1], f"{what}: tree {structures[0]} != {structures[1]}"
  paths = jax.tree_util.tree_flatten_with_path(expected)[0]
  for (path, want), got in zip(paths, jax.tree.leaves(actual), strict=True):
    assert_close(got, want, dtype, f"{what}{jax.tree_util.keystr(path)}")


def check_against_reference(
  params: MoEParams,
  x: jax.Array,
  config: MoEConfig,
  mesh: Mesh | None,
  mask: jax.Array,
  *,
  seed: int,
  placement: eplb.Placement | None = None,
  expert_ids: jax.Array | None = None,
) -> None:
  """The layer against `reference_moe` (`check_layer`).

  With a `placement` the layer runs on physical weights (`eplb.place`), and the gradients of
  its expert weights, summed over replicas (`eplb.sum_replicas`), must be the reference's.

  Args:
    params: the layer's parameters (logical experts [E, ...] with a placement).
    x: [T, D] tokens (float32 or the compute dtype).
    config: the layer's config.
    mesh: a (data, expert) mesh, or None.
    mask: [T] bool.
    seed: draws the probe of the gradients' loss.
    placement: with `config.num_redundant_experts`, the layer's placement.
    expert_ids: [T, K] ids both layers route to (routing replay), or None.
  """
  physical = params if placement is None else eplb.place(params, placement, config)
  logical = dataclasses.replace(config, num_redundant_experts=0)
  ours, theirs = _moe_layer(config, mesh), _reference_layer(logical)
  if expert_ids is not None:
    ours = lambda p, x, mask: moe_apply(
      p[0], x, config=config, mesh=mesh, token_mask=mask, placement=p[1], expert_ids=expert_ids
    )[0]
    theirs = lambda p, x, mask: reference_moe(p, x, logical, mask, expert_ids=expert_ids)
  check_layer(
    ours,
    theirs,
    (physical, placement),
    x,
    mask,
    seed=seed,
    dtype=config.dtype,
    reference_params=params,
    gradients_of=lambda g: g[0] if placement is None else eplb.sum_replicas(g[0], placement),
  )


@functools.cache
def _moe_layer(config: MoEConfig, mesh: Mesh | None) -> Layer:
  """`moe_apply`'s y as a `Layer` of (params, placement), one per (config, mesh): a test
  class's cases that share them share its compiled programs (placements included)."""
  return lambda p, x, mask: moe_apply(
    p[0], x, config=config, mesh=mesh, token_mask=mask, placement=p[1]
  )[0]


@functools.cache
def _reference_layer(config: MoEConfig) -> Layer:
  """`reference_moe` as a `Layer`, one per config."""
  return lambda p, x, mask: reference_moe(p, x, config, mask)


def user_env(*drop: str, quick_compile: bool = False) -> dict[str, str]:
  """The environment for a subprocess that runs as a user would: without the test run's
  XLA_FLAGS (and the `drop`ped variables), but with its compilation cache, so that a program
  one subprocess compiled the next reads back. With `quick_compile`, the run's compile-time
  flags but its device count: for a subprocess that mostly compiles (they change no number,
  tests/conftest.py, but make compute-bound programs slower)."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", *drop)}
  if quick_compile:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
    env["XLA_FLAGS"] = " ".join(flags.split())
  return env | {
    "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
  }
