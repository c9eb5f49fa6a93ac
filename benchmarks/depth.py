"""`python -m moejax bench --sections depth`: models of real depth on the 2x4 mesh.

Three tables, float32, `MoETransformer` train steps (masked cross-entropy with the aux
losses, gradient, Adam) on 32 sequences of 16 tokens, E=8, K=2, D=128, F=256:
  stacks    1, 4, 16 blocks unrolled and scanned (`scan_layers`), 32 and 60 scanned: seconds
            to lower and compile the train step (the better of two fresh compiles: one
            varies by ~20 % on a shared machine; also as a multiple of the 1-block model's),
            its time (per block, and scanned over unrolled), and the compiled temp of the
            gradient with its growth per block since the shallower row, without remat and
            with every block rematerialized (`nothing_saveable`)
  policies  4 scanned blocks, each rematerialized by a policy built from
            `moejax.CHECKPOINT_NAMES`, and one layer whose output feeds a nonlinearity
            inside the remat (where saving the layer output matters): compiled temp, FLOPs
            of the compiled gradient, its exchanges (the dispatch's collectives in the
            compiled program), and the largest gradient difference from no remat; the
            dispatched rows' name with `save_dispatched_rows` on (it marks nothing off)
  compile   one layer call against a dense gated MLP of the same width (D -> 2F -> D) on
            the same tokens: seconds to lower and compile the forward pass and the
            gradient (the better of two fresh compiles), and the optimized HLO's lines
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding

from kernels_pallas import autotune
from moejax import CHECKPOINT_NAMES, MoEConfig, moe_apply, param_shapes
from moejax.models import ClusterTask, MoETransformer, TransformerConfig, shard_model
from moejax.remat import DISPATCHED_ROWS
from moejax.sharding import LayerSpecs
from moejax.train import LossWeights, loss_fn, train_step

MOE = MoEConfig(num_experts=8, top_k=2, hidden_size=128, intermediate_size=256)
POLICIES = jax.checkpoint_policies
# (blocks, scanned) of the stacks table, in the order they compile.
STACKS = (
  (1, False),
  (4, False),
  (16, False),
  (1, True),
  (4, True),
  (16, True),
  (32, True),
  (60, True),
)


def _mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)


def _model(
  blocks: int, scanned: bool, policy: Callable | None, mesh, moe: MoEConfig = MOE
) -> MoETransformer:
  config = TransformerConfig(
    vocab_size=64, num_layers=blocks, num_heads=2, moe=moe, scan_layers=scanned, remat_policy=policy
  )
  model = MoETransformer(config, mesh=mesh, rngs=nnx.Rngs(0))
  shard_model(model, mesh)
  return model


def _batch(mesh) -> list[jax.Array]:
  sharding = NamedSharding(mesh, LayerSpecs.from_config(MOE).batch_b)
  return [jax.device_put(a, sharding) for a in ClusterTask().batch(32, 0)]


def _fresh_compile_seconds(jitted: Callable, *args) -> float:
  """Seconds to lower and compile `jitted` on `args` with JAX's caches emptied first (tracing
  included, as in a new process; the persistent compilation cache is off by default)."""
  jax.clear_caches()
  start = time.perf_counter()
  jitted.lower(*args).compile()
  return time.perf_counter() - start


def _gradient_temp_mib(blocks: int, scanned: bool, policy: Callable | None, mesh, batch) -> float:
  """Compiled temp of the loss's gradient: what the backward pass keeps (the train step's own
  temp also holds the optimizer update's buffers, with remat about a block's weights per
  block on XLA:CPU)."""
  graphdef, state = nnx.split(_model(blocks, scanned, policy, mesh))
  loss = lambda state: loss_fn(nnx.merge(graphdef, state), *batch, LossWeights())[0]
  compiled = jax.jit(jax.grad(loss)).lower(state).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def stacks_rows(repeats: int) -> list[dict]:
  mesh = _mesh()
  batch = _batch(mesh)
  _gradient_temp_mib(1, True, None, mesh, batch)  # warm-up: the process's first compiles
  step = lambda model, optimizer: train_step(model, optimizer, *batch)
  rows = []
  for blocks, scanned in STACKS:
    model = _model(blocks, scanned, None, mesh)
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    shard_model(optimizer, mesh)
    seconds = min(_fresh_compile_seconds(train_step, model, optimizer, *batch) for _ in range(2))
    rows.append(
      dict(
        section="depth",
        table="stacks",
        blocks=blocks,
        scanned=scanned,
        compile_s=seconds,
        step_ms=1e3 * autotune.time_call(functools.partial(step, model, optimizer), repeats),
        temp_mib=_gradient_temp_mib(blocks, scanned, None, mesh, batch),
        remat_temp_mib=_gradient_temp_mib(blocks, scanned, POLICIES.nothing_saveable, mesh, batch),
      )
    )
  _derived_columns(rows)
  shapes = param_shapes(MOE)
  local = 4 * (np.prod(shapes["w_gate_up"]) + np.prod(shapes["w_down"])) / 4
  print(f"\nexpert weights of a block on one device (E / 4 experts): {local / 2**20:.2f} MiB")
  return rows


def _derived_columns(rows: list[dict]) -> None:
  """Compile time as a multiple of the 1-block unrolled model's, step time per block and
  scanned over unrolled at equal depth, and temp growth per block since the shallower row."""
  base = rows[0]  # 1 block, unrolled: the plain model
  unrolled = {r["blocks"]: r for r in rows if not r["scanned"]}
  previous: dict[bool, dict] = {}
  for r in rows:
    r["compile_of_1_block"] = r["compile_s"] / base["compile_s"]
    r["ms_per_block"] = r["step_ms"] / r["blocks"]
    same_depth = unrolled.get(r["blocks"]) if r["scanned"] else None
    r["step_of_unrolled"] = "" if same_depth is None else r["step_ms"] / same_depth["step_ms"]
    shallower = previous.get(r["scanned"])
    for key in ("temp_mib", "remat_temp_mib"):  # growth per block since the shallower row
      r[f"{key}_per_block"] = (
        "" if shallower is None else (r[key] - shallower[key]) / (r["blocks"] - shallower["blocks"])
      )
    previous[r["scanned"]] = r


def _policies() -> dict[str, tuple[Callable | None, MoEConfig]]:
  """Policy name -> (policy, the layer's config): `DISPATCHED_ROWS` only names a value with
  `save_dispatched_rows`, so its rows (and the one without remat to compare) turn it on."""
  keeping = dataclasses.replace(MOE, save_dispatched_rows=True)
  only = POLICIES.save_only_these_names
  named = {name: (only(name), MOE) for name in CHECKPOINT_NAMES if name != DISPATCHED_ROWS}
  return {
    "no remat": (None, MOE),
    "nothing_saveable": (POLICIES.nothing_saveable, MOE),
    **named,
    "all CHECKPOINT_NAMES": (only(*CHECKPOINT_NAMES), MOE),
    "no remat, save_dispatched_rows": (None, keeping),
    f"{DISPATCHED_ROWS}, save_dispatched_rows": (only(DISPATCHED_ROWS), keeping),
    "all CHECKPOINT_NAMES, save_dispatched_rows": (only(*CHECKPOINT_NAMES), keeping),
  }


def _exchanges(compiled) -> int:
  """The dispatch's collectives (MOE's "auto": all_gather on a CPU) in a compiled program."""
  return len(re.findall(r" all-gather(?:-start)?\(", compiled.as_text()))


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def _gradient_case(loss: Callable, args: tuple) -> tuple[object, object]:
  """(compiled gradient of `loss`, the gradient it computes on `args`)."""
  grad = jax.jit(jax.grad(loss))
  return grad.lower(*args).compile(), grad(*args)


def _max_difference(a, b) -> float:
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)


def _scanned_blocks_case(policy: Callable | None, moe, mesh, batch, params, x) -> tuple:
  """(loss, its arguments): the 4 scanned blocks, each rematerialized by `policy`."""
  graphdef, state = nnx.split(_model(4, True, policy, mesh, moe))
  loss = lambda state: loss_fn(nnx.merge(graphdef, state), *batch, LossWeights())[0]
  return loss, (state,)


def _layer_under_tanh_case(policy: Callable | None, moe, mesh, batch, params, x) -> tuple:
  """(loss, its arguments): one layer whose output feeds tanh inside the remat."""
  layer = lambda params: jnp.tanh(moe_apply(params, x, config=moe, mesh=mesh)[0])
  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy)
  return (lambda params: jnp.sum(layer(params) ** 2)), (params,)


def policy_rows() -> list[dict]:
  mesh = _mesh()
  batch = _batch(mesh)
  params = moe_layer_params(mesh)
  x = jax.random.normal(jax.random.key(1), (512, MOE.hidden_size))
  cases = {"4 scanned blocks": _scanned_blocks_case, "tanh(layer(x))": _layer_under_tanh_case}
  rows = []
  for model_name, case in cases.items():
    reference = None
    for name, (policy, moe) in _policies().items():
      compiled, grads = _gradient_case(*case(policy, moe, mesh, batch, params, x))
      reference = grads if reference is None else reference
      rows.append(
        dict(
          section="depth",
          table="policies",
          model=model_name,
          policy=name,
          temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20,
          gflops=_flops(compiled) / 1e9,
          exchanges=_exchanges(compiled),
          grad_difference=_max_difference(grads, reference),
        )
      )
  return rows


def moe_layer_params(mesh):
  """One layer's random weights, laid out as `MoELayer` lays them out on `mesh`."""
  model = _model(1, False, None, mesh)
  return model.blocks[0].ffn.moe_params()


def compile_rows() -> list[dict]:
  mesh = _mesh()
  params = moe_layer_params(mesh)
  x = jax.random.normal(jax.random.key(1), (512, MOE.hidden_size))
  f = MOE.intermediate_size
  dense = dict(
    w_gate_up=jax.random.normal(jax.random.key(2), (MOE.hidden_size, 2 * f)) / 12,
    w_down=jax.random.normal(jax.random.key(3), (f, MOE.hidden_size)) / 16,
  )

  def dense_mlp(weights, x):
    gate, up = jnp.split(x @ weights["w_gate_up"], 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ weights["w_down"]

  cases = {
    "MoE layer": (lambda params, x: moe_apply(params, x, config=MOE, mesh=mesh)[0], params),
    "dense MLP": (dense_mlp, dense),
  }
  rows = []
  for name, (forward, weights) in cases.items():
    for what, fn in (
      ("forward", forward),
      ("gradient", jax.grad(lambda w, x, forward=forward: jnp.sum(forward(w, x) ** 2))),
    ):
      seconds = min(_fresh_compile_seconds(jax.jit(fn), weights, x) for _ in range(2))
      compiled = jax.jit(fn).lower(weights, x).compile()
      lines = len(compiled.as_text().splitlines())
      row = dict(case=name, what=what, compile_s=seconds, hlo_lines=lines)
      rows.append(dict(section="depth", table="compile", **row))
  for r in rows:
    dense_row = next(d for d in rows if d["case"] == "dense MLP" and d["what"] == r["what"])
    r["of_dense"] = r["compile_s"] / dense_row["compile_s"]
  return rows


def depth_section(repeats: int, table: Callable[[str, list[dict], list[str]], None]) -> list[dict]:
  """The three tables, printed with `table(title, rows, columns)`; returns their rows."""
  stacks = stacks_rows(repeats)
  table(
    "depth: train steps on the 2x4 mesh, unrolled vs scanned blocks",
    stacks,
    [
      "blocks",
      "scanned",
      "compile_s",
      "compile_of_1_block",
      "step_ms",
      "ms_per_block",
      "step_of_unrolled",
      "temp_mib",
      "temp_mib_per_block",
      "remat_temp_mib",
      "remat_temp_mib_per_block",
    ],
  )
  policies = policy_rows()
  table(
    "depth: remat policies built from moejax.CHECKPOINT_NAMES (gradients)",
    policies,
    ["model", "policy", "temp_mib", "gflops", "exchanges", "grad_difference"],
  )
  compiles = compile_rows()
  table(
    "depth: compile time of one layer call vs a dense MLP of the same width",
    compiles,
    ["case", "what", "compile_s", "of_dense", "hlo_lines"],
  )
  return stacks + policies + compiles
