"""The expert-axis exchange: the ragged_all_to_all drop-in, both dispatch schemes on every mesh,
the adversarial full buffer, the traffic count and the pipelined loop's structure."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.extend.core import Literal
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moejax import MoEConfig, dispatch, moe_apply
from moejax.collectives import ragged_all_to_all
from moejax.testing import random_params, rank_mask
from tests.helpers import BASE, RICH, SCHEMES, mesh_of, seed_of

ROWS_PER_RANK = 10
CONFIG = MoEConfig(**{**BASE, **RICH})  # grouped top-k, bias, sigmoid, a shared expert


# --- The drop-in against ragged_all_to_all's documented semantics --------------------------


def ragged_plan(rng: np.random.Generator, devices: int, per_device: int, max_rows: int):
  """Random consistent operands for every device: sizes (zeros included), offsets, buffers."""
  slices = devices * per_device
  send_sizes = rng.integers(0, max_rows + 1, size=(devices, slices))
  send_sizes[rng.random(send_sizes.shape) < 0.3] = 0
  input_offsets = np.zeros_like(send_sizes)
  output_offsets = np.zeros_like(send_sizes)
  recv_sizes = np.zeros_like(send_sizes)
  for src in range(devices):  # each sender packs its slices in a random order, with gaps
    cursor = 0
    for i in rng.permutation(slices):
      cursor += rng.integers(0, 2)
      input_offsets[src, i] = cursor
      cursor += send_sizes[src, i]
  for dst in range(devices):  # each receiver places the slices it gets, with gaps
    cursor = 0
    for src in rng.permutation(devices):
      for k in range(per_device):
        i = dst * per_device + k
        cursor += rng.integers(0, 2)
        output_offsets[src, i] = cursor
        recv_sizes[dst, src * per_device + k] = send_sizes[src, i]
        cursor += send_sizes[src, i]
  return input_offsets, send_sizes, output_offsets, recv_sizes


def numpy_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets):
  """The op's documented SEND/RECEIVE loop, over all devices at once ([devices, ...] arrays)."""
  devices, slices = send_sizes.shape
  per_device = slices // devices
  result = output.copy()
  for src in range(devices):
    for i in range(slices):
      start, size, at = input_offsets[src, i], send_sizes[src, i], output_offsets[src, i]
      result[i // per_device, at : at + size] = operand[src, start : start + size]
  return result


@pytest.mark.parametrize("per_device", [1, 2])
def test_drop_in_matches_the_documented_semantics(per_device, request):
  rng = np.random.default_rng(seed_of(request.node.name))
  devices, max_rows = 4, 3
  mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
  for _ in range(3):
    plan = ragged_plan(rng, devices, per_device, max_rows)
    in_rows = int(max(plan[0].max(), 0) + max_rows + 1)
    out_rows = int((plan[2] + plan[1]).max() + 2)
    operand = rng.standard_normal((devices, in_rows, 2)).astype(np.float32)
    output = rng.standard_normal((devices, out_rows, 2)).astype(np.float32)

    def exchange(operand, output, *plan):  # [1, ...] per device
      got = ragged_all_to_all(
        operand[0],
        output[0],
        *[a[0] for a in plan],
        axis="x",
        max_slice_rows=max_rows,
        ragged=False,
      )
      return got[None]

    got = jax.shard_map(exchange, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(
      operand, output, *[jnp.asarray(a, jnp.int32) for a in plan]
    )
    chex.assert_trees_all_equal(
      np.asarray(got), numpy_ragged_all_to_all(operand, output, *plan[:3])
    )


def test_ragged_path_lowers_for_cuda(monkeypatch):
  """The GPU's path (jax.lax.ragged_all_to_all inside the layer), lowered on this CPU host."""
  monkeypatch.setattr(dispatch, "platform_has_ragged_all_to_all", lambda: True)
  # A config no other test runs: the patched platform must not reach their cached traces.
  config = dataclasses.replace(CONFIG, dispatch="all_to_all", chunk_size=3)
  params = random_params(config, jax.random.key(0))
  x = jax.ShapeDtypeStruct((8 * ROWS_PER_RANK, 16), jnp.float32)
  mask = jax.ShapeDtypeStruct((8 * ROWS_PER_RANK,), jnp.bool_)
  layer = lambda p, x, m: moe_apply(p, x, config=config, mesh=mesh_of(2, 4), token_mask=m)[0]
  lower = lambda fn: export.export(
    jax.jit(fn),
    platforms=["cuda"],
    disabled_checks=[export.DisabledSafetyCheck.custom_call("ragged_all_to_all")],
  )(params, x, mask)
  calls = lambda fn: lower(fn).mlir_module().count("stablehlo.custom_call @ragged_all_to_all(")
  assert calls(layer) == 2 * 3 + 1, "rows, ids, weights sent before and in the loop; rows returned"
  # The backward recomputes a chunk's rows out and back and transposes both (XLA drops what
  # the gradient does not read).
  assert calls(jax.grad(lambda p, x, m: jnp.sum(layer(p, x, m)))) >= 4


def test_auto_picks_all_to_all_only_where_measured_faster(monkeypatch):
  for platform_name in ("cpu", "gpu", "tpu"):  # nothing recorded: all_gather everywhere
    assert dispatch.resolve_dispatch("auto", 8, platform_name) == "all_gather"
  assert dispatch.resolve_dispatch("all_to_all", 8, "cpu") == "all_to_all"  # by name, anywhere
  monkeypatch.setattr(dispatch, "ALL_TO_ALL_FASTER_FROM_AXIS", {"gpu": 4})
  assert dispatch.resolve_dispatch("auto", 8, "gpu") == "all_to_all"
  assert dispatch.resolve_dispatch("auto", 2, "gpu") == "all_gather"  # smaller than measured
  assert dispatch.resolve_dispatch("auto", 8, "tpu") == "all_gather"


# --- Both schemes against the reference ------------------------------------------------------


def layer_inputs(config: MoEConfig, name: str):
  key = jax.random.key(seed_of(name))
  params = random_params(config, key)
  if config.use_routing_bias:
    params = params._replace(routing_bias=0.1 * jax.random.normal(jax.random.fold_in(key, 1), 8))
  x = jax.random.normal(jax.random.fold_in(key, 2), (8 * ROWS_PER_RANK, config.hidden_size))
  return params, x


def numpy_rows_sent(ids: np.ndarray, mask: np.ndarray, experts_per_device: int) -> np.ndarray:
  """[ranks] distinct devices over each rank's valid rows' chosen experts."""
  per_row = [len(set(row // experts_per_device)) for row in ids]
  per_row = np.where(mask, per_row, 0)
  return per_row.reshape(-1, ROWS_PER_RANK).sum(axis=1)


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dispatch_rows_counts_the_traffic(mesh_shape, request):
  config = MoEConfig(num_experts=8, top_k=3, hidden_size=16, intermediate_size=24, chunk_size=4)
  params, x = layer_inputs(config, request.node.name)
  mask = rank_mask([0, 3, 10, 7, 0, 1, 0, 9], ROWS_PER_RANK)
  mesh = mesh_of(*mesh_shape)
  expert_axis = mesh_shape[1]
  logits = np.asarray(x, np.float64) @ np.asarray(params.router_kernel, np.float64)
  ids = np.argsort(-logits, axis=-1, kind="stable")[:, : config.top_k]
  _, aux = moe_apply(
    params, x, config=dataclasses.replace(config, dispatch="all_to_all"), mesh=mesh, token_mask=mask
  )
  chex.assert_trees_all_equal(
    np.asarray(aux.dispatch_rows), numpy_rows_sent(ids, np.asarray(mask), 8 // expert_axis)
  )
  _, aux = moe_apply(
    params, x, config=dataclasses.replace(config, dispatch="all_gather"), mesh=mesh, token_mask=mask
  )
  chunk = config.chunk_size
  chex.assert_trees_all_equal(
    np.asarray(aux.dispatch_rows), np.asarray(aux.chunks_run) * chunk * expert_axis
  )


# --- The pipelined loop ------------------------------------------------------------------------


def nested_jaxprs(eqn):
  for param in eqn.params.values():
    for inner in param if isinstance(param, tuple | list) else (param,):
      inner = getattr(inner, "jaxpr", inner)
      if hasattr(inner, "eqns"):
        yield inner


def walk(jaxpr):
  """(enclosing jaxpr, equation) for every equation of `jaxpr`, nested ones included."""
  for eqn in jaxpr.eqns:
    yield jaxpr, eqn
    for inner in nested_jaxprs(eqn):
      yield from walk(inner)


def contains(eqn, primitive: str) -> bool:
  return any(e.primitive.name == primitive for inner in nested_jaxprs(eqn) for _, e in walk(inner))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_next_chunk_is_sent_while_this_chunk_computes(scheme):
  config = dataclasses.replace(CONFIG, dispatch=scheme)
  params = random_params(config, jax.random.key(0))
  x = jnp.ones((8 * ROWS_PER_RANK, 16))
  mesh = mesh_of(2, 4)
  jaxpr = jax.make_jaxpr(lambda p, x: moe_apply(p, x, config=config, mesh=mesh)[0])(params, x)
  exchange = "all_gather" if scheme == "all_gather" else "all_to_all"
  # The chunk loop: the scan whose body holds conds that run the exchange.
  (outer, loop), *others = [
    (outer, eqn)
    for outer, eqn in walk(jaxpr.jaxpr)
    if eqn.primitive.name == "scan"
    and any(e.primitive.name == "cond" and contains(e, exchange) for e in eqn.params["jaxpr"].eqns)
  ]
  assert not others, "one chunk loop"
  body = loop.params["jaxpr"].jaxpr
  conds = [eqn for eqn in body.eqns if eqn.primitive.name == "cond"]
  (compute,) = [eqn for eqn in conds if contains(eqn, "dot_general")]
  (send,) = [eqn for eqn in conds if contains(eqn, exchange) and not contains(eqn, "dot_general")]
  # Everything in the body that depends on the compute cond's outputs...
  tainted = set(compute.outvars)
  for eqn in body.eqns:
    if any(v in tainted for v in eqn.invars if not isinstance(v, Literal)):
      tainted.update(eqn.outvars)
  # ...does not reach the next chunk's send, and no collective runs per step outside the conds.
  assert not any(v in tainted for v in send.invars if not isinstance(v, Literal))
  collective = lambda name: name.startswith("psum") or name.endswith(("all_gather", "all_to_all"))
  assert not any(collective(eqn.primitive.name) for eqn in body.eqns)
  # The skip decisions: one psum of per-chunk counts before the loop.
  before = outer.eqns[: outer.eqns.index(loop)]
  chunks = loop.params["length"]
  psums = [e for e in before if e.primitive.name.startswith("psum")]  # psum_invariant on 0.10
  assert any(e.invars[0].aval.shape == (chunks,) for e in psums)


@pytest.mark.parametrize("mesh_shape", [None, (8, 1)], ids=["no mesh", "8x1"])
def test_nothing_to_overlap_runs_one_cond_per_step(mesh_shape):
  """Without an exchange across devices the loop is not pipelined: each step is one cond that
  runs both stages of its chunk, and no in-flight buffer is carried."""
  params = random_params(CONFIG, jax.random.key(0))
  x = jnp.ones((8 * ROWS_PER_RANK, 16))
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
  jaxpr = jax.make_jaxpr(lambda p, x: moe_apply(p, x, config=CONFIG, mesh=mesh)[0])(params, x)
  # The chunk loop: the first scan in the program whose body has a cond running experts.
  loop = next(
    eqn
    for _, eqn in walk(jaxpr.jaxpr)
    if eqn.primitive.name == "scan"
    and any(
      e.primitive.name == "cond" and contains(e, "dot_general") for e in eqn.params["jaxpr"].eqns
    )
  )
  assert contains(loop, "scan"), "the chunk loop holds the tile loop"
  conds = [e for e in loop.params["jaxpr"].jaxpr.eqns if e.primitive.name == "cond"]
  assert len(conds) == 1 and len(loop.outvars) == 1, "one cond, no carried in-flight buffer"
