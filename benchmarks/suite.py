"""`python -m moejax bench`: the benchmark suite, one process, measured side by side.

Each section prints a table; all rows go to `results/bench.json` (the chunk sweep also to a
PNG). The sections are a registry, `SECTIONS`: a new one is a function and a `Section` row.
What the expert-axis exchange sends (both dispatch schemes) is `benchmarks/dispatch.py`'s.

float32 on simulated CPU devices (the caller sets 8 of them). `--full` runs more shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kernels_pallas.formats import FORMATS
from kernels_pallas.quantized import is_block_scaled
from moejax import MoEConfig, MoEParams, files, lora, moe_apply, plan_call, quant, routing
from moejax.call_record import call_record
from moejax.experts import default_tile_rows, tile_loop_mlp
from moejax.forward import compiled_executables
from moejax.meshes import named_sharding
from moejax.params import ExpertWeights
from moejax.sharding import LayerSpecs
from moejax.testing import abstract_params, random_params

D, F = 256, 512


def best_time(fn, *args, repeats: int) -> float:
  """Minimum wall time of `repeats` calls after a warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def sections_of(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...]) -> list[str]:
  """The comma-separated `--sections` value as a list; a name not in `known` is a usage
  error (exit 2), not a section silently skipped."""
  sections = text.split(",")
  if unknown := sorted(set(sections) - set(known)):
    parser.error(f"--sections: unknown {', '.join(unknown)}; expected some of {','.join(known)}")
  return sections


def interleaved_best(calls: dict[str, tuple], rounds: int) -> dict[str, float]:
  """Minimum wall time of each `name: (fn, *args)` over `rounds` rounds that call every fn
  once each, in turn: a shared, noisy machine slows them alike, so their ratios hold."""
  for fn, *args in calls.values():
    jax.block_until_ready(fn(*args))  # compile
  best = dict.fromkeys(calls, math.inf)
  for _ in range(rounds):
    for name, (fn, *args) in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      best[name] = min(best[name], time.perf_counter() - start)
  return best


def on_mesh(params: MoEParams, config: MoEConfig, mesh: Mesh) -> MoEParams:
  """The parameters laid out on the mesh as the layer wants them (experts split over the
  expert axis), once: left on one device, every call would reshard them first."""
  specs = LayerSpecs.from_config(config).params(params)
  return jax.device_put(params, jax.tree.map(lambda _, s: named_sharding(mesh, s), params, specs))


def config_of(experts: int, top_k: int, chunk: int | str) -> MoEConfig:
  return MoEConfig(
    num_experts=experts, top_k=top_k, hidden_size=D, intermediate_size=F, chunk_size=chunk
  )


def mesh_2x4() -> Mesh:
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))


# ---- baselines: the same layer computed other ways ---------------------------------------


def _mlp(x, w_gate_up, w_down):
  gate, up = jnp.split(x @ w_gate_up, 2, axis=-1)
  return (jax.nn.silu(gate) * up) @ w_down


def _route(params: MoEParams, x, top_k):
  weights, ids = jax.lax.top_k(jax.nn.softmax(x @ params.router_kernel), top_k)
  return ids, weights


def dense_ceiling(params: MoEParams, x, top_k):
  """The active FLOPs as plain matmuls: [T*K, D] through one expert's weights."""
  return _mlp(jnp.repeat(x, top_k, axis=0), params.w_gate_up[0], params.w_down[0])


def every_expert(params: MoEParams, x, top_k):
  """Every expert on every token, then gather the chosen ones (E/K times the FLOPs)."""
  ids, weights = _route(params, x, top_k)
  outs = jax.vmap(_mlp, in_axes=(None, 0, 0))(x, params.w_gate_up, params.w_down)  # [E, T, D]
  chosen = outs[ids, jnp.arange(x.shape[0])[:, None]]  # [T, K, D]
  return jnp.einsum("tk,tkd->td", weights, chosen)


def gshard_einsum(params: MoEParams, x, top_k, capacity_factor=1.25):
  """GShard / T5X dispatch: one-hot [T, E, C] dispatch and combine tensors, capacity 1.25."""
  tokens, experts = x.shape[0], params.router_kernel.shape[1]
  capacity = math.ceil(capacity_factor * tokens * top_k / experts)
  ids, weights = _route(params, x, top_k)
  one_hot = jax.nn.one_hot(ids, experts)  # [T, K, E]
  position = jnp.cumsum(one_hot.reshape(-1, experts), axis=0).reshape(one_hot.shape) - 1
  keep = one_hot * (position < capacity)
  slot = jax.nn.one_hot(jnp.sum(position * keep, axis=-1).astype(jnp.int32), capacity)
  dispatch = jnp.einsum("tke,tkc->tec", keep, slot)  # [T, E, C]
  combine = jnp.einsum("tke,tkc,tk->tec", keep, slot, weights)
  expert_in = jnp.einsum("tec,td->ecd", dispatch, x)
  expert_out = jax.vmap(_mlp)(expert_in, params.w_gate_up, params.w_down)  # [E, C, D]
  return jnp.einsum("tec,ecd->td", combine, expert_out)


def sort_ragged_dot(params: MoEParams, x, top_k):
  """Sort the T*K assignments by expert and run jax.lax.ragged_dot twice."""
  ids, weights = _route(params, x, top_k)
  flat = ids.reshape(-1)
  order = jnp.argsort(flat)
  sizes = jnp.zeros(params.w_gate_up.shape[0], jnp.int32).at[flat].add(1)
  rows = x[order // top_k]
  gate, up = jnp.split(jax.lax.ragged_dot(rows, params.w_gate_up, sizes), 2, axis=-1)
  out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, params.w_down, sizes)
  per_choice = jnp.zeros_like(out).at[order].set(out).reshape(x.shape[0], top_k, -1)
  return jnp.einsum("tk,tkd->td", weights, per_choice)


def per_token_gather(params: MoEParams, x, top_k):
  """Decode baseline: each token gathers its K experts' weights and runs them, one token at a
  time (what a hand-written decode kernel reads: the used experts, once per token)."""
  ids, weights = _route(params, x, top_k)

  def one_token(args):
    x_t, ids_t, weights_t = args
    outs = jax.vmap(_mlp, in_axes=(None, 0, 0))(
      x_t[None], params.w_gate_up[ids_t], params.w_down[ids_t]
    )
    return jnp.einsum("k,kd->d", weights_t, outs[:, 0])

  return jax.lax.map(one_token, (x, ids, weights))


def distinct_experts_once(params: MoEParams, x, top_k):
  """Decode baseline: the batch's distinct experts (at most T*K) gathered once, each run on
  every token, the chosen results combined (reads each used expert once)."""
  ids, weights = _route(params, x, top_k)
  experts = params.router_kernel.shape[1]
  # [U] sorted; fewer distinct ids repeat the largest, a used expert, so the order holds.
  used = jnp.unique(ids, size=min(ids.size, experts), fill_value=jnp.max(ids))
  outs = jax.vmap(_mlp, in_axes=(None, 0, 0))(x, params.w_gate_up[used], params.w_down[used])
  slot = jnp.searchsorted(used, ids)  # [T, K] position of each choice among the used
  chosen = outs[slot, jnp.arange(x.shape[0])[:, None]]  # [T, K, D]
  return jnp.einsum("tk,tkd->td", weights, chosen)


# ---- sections ---------------------------------------------------------------------------


def moejax_forward(config: MoEConfig, mesh: Mesh | None = None):
  """(params, x) -> y through `moe_apply`."""
  return lambda params, x: moe_apply(params, x, config=config, mesh=mesh)[0]


def layer_section(full: bool, repeats: int) -> list[dict]:
  shapes = [(32, 2, 4096)]
  if full:
    shapes += [(8, 2, 4096), (64, 2, 4096), (64, 8, 1024)]
  rows = []
  for experts, top_k, tokens in shapes:
    flops = 2 * tokens * top_k * 3 * D * F
    config = config_of(experts, top_k, chunk=256)
    params = random_params(config, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (tokens, D))
    impls = {
      "dense matmul (ceiling)": functools.partial(dense_ceiling, top_k=top_k),
      "moejax chunk=256": moejax_forward(config),
      f"moejax chunk={tokens}": moejax_forward(config_of(experts, top_k, tokens)),
      "GShard einsum, cf=1.25": functools.partial(gshard_einsum, top_k=top_k),
    }
    if (experts, top_k, tokens) == shapes[0]:  # the slow baselines on the main shape only
      impls["every expert, dense"] = functools.partial(every_expert, top_k=top_k)
      impls["sort + ragged_dot"] = functools.partial(sort_ragged_dot, top_k=top_k)
    for name, fn in impls.items():
      forward = jax.jit(fn)
      grad = jax.jit(jax.grad(lambda p, x, f=forward: jnp.sum(f(p, x) ** 2), argnums=(0, 1)))
      slow = "ragged" in name or "every" in name
      fwd_s = best_time(forward, params, x, repeats=1 if slow else repeats)
      bwd_s = best_time(grad, params, x, repeats=1 if slow else repeats)
      rows.append(
        dict(
          section="layer",
          E=experts,
          K=top_k,
          T=tokens,
          name=name,
          fwd_ms=fwd_s * 1e3,
          fwd_bwd_ms=bwd_s * 1e3,
          fwd_gflops=flops / fwd_s / 1e9,
          fwd_bwd_gflops=3 * flops / bwd_s / 1e9,
        )
      )
  for row in rows:
    ceiling = next(
      r
      for r in rows
      if r["name"].startswith("dense matmul")
      and r["E"] == row["E"]
      and r["K"] == row["K"]
      and r["T"] == row["T"]
    )
    row["fwd_of_ceiling"] = row["fwd_gflops"] / ceiling["fwd_gflops"]
    row["fwd_bwd_of_ceiling"] = row["fwd_bwd_gflops"] / ceiling["fwd_bwd_gflops"]
  _table(
    "layer: forward and forward+backward (float32, one device; backward counted as 2x FLOPs)",
    rows,
    ["E", "K", "T", "name", "fwd_ms", "fwd_of_ceiling", "fwd_bwd_ms", "fwd_bwd_of_ceiling"],
  )
  return rows


def peak_temp_bytes(fn, *args) -> int:
  """XLA's compiled temporary buffer size: the peak beyond arguments and outputs."""
  return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def chunk_section(full: bool, repeats: int) -> list[dict]:
  token_counts = (512, 2048, 8192) + ((16384,) if full else ())
  rows = []
  for mesh_name, mesh in (("1 device", None), ("2x4 mesh", mesh_2x4())):
    for chunk in (64, 256, 1024):
      config = config_of(32, 2, chunk)
      params = random_params(config, jax.random.key(0))
      fn = jax.jit(moejax_forward(config, mesh))
      for tokens in token_counts:
        x = jax.random.normal(jax.random.key(2), (tokens, D))
        rows.append(
          dict(
            section="chunks",
            mesh=mesh_name,
            chunk=chunk,
            T=tokens,
            ms=best_time(fn, params, x, repeats=repeats) * 1e3,
            temp_mib=peak_temp_bytes(fn, params, x) / 2**20,
          )
        )
  _table(
    "chunks: time and compiled peak temporary memory (E=32, K=2)",
    rows,
    ["mesh", "chunk", "T", "ms", "temp_mib"],
  )
  return rows


DECODE_TOKENS = (1, 2, 8, 32, 128)  # per device
DECODE_SHAPE = dict(num_experts=32, top_k=2, hidden_size=1024, intermediate_size=2048)
# Above this many tokens the baselines are not decode-sized any more (T*U expert MLPs).
DECODE_BASELINE_MAX_TOKENS = 32


def decode_section(repeats: int) -> list[dict]:
  """Decode-size calls (E=32, K=2, D=1024, F=2048, float32): the layer against two baselines
  that read only the used experts, on one device; and the layer on the 2x4 mesh."""
  config = MoEConfig(**DECODE_SHAPE, chunk_size=256)
  params = random_params(config, jax.random.key(0))
  itemsize = 4
  expert_bytes = 3 * config.hidden_size * config.intermediate_size * itemsize
  rows = []
  for tokens in DECODE_TOKENS:
    x = jax.random.normal(jax.random.key(tokens), (tokens, config.hidden_size))
    calls = {"layer": (jax.jit(moejax_forward(config)), params, x)}
    if tokens <= DECODE_BASELINE_MAX_TOKENS:
      calls["per-token gather"] = (jax.jit(per_token_gather, static_argnums=2), params, x, 2)
      calls["distinct experts once"] = (
        jax.jit(distinct_experts_once, static_argnums=2),
        params,
        x,
        2,
      )
      want = calls["layer"][0](params, x)
      for name in ("per-token gather", "distinct experts once"):  # the same layer
        fn, *args = calls[name]
        np.testing.assert_allclose(fn(*args), want, atol=2e-4, rtol=2e-4, err_msg=name)
    best = interleaved_best(calls, rounds=5 * repeats)
    ids = np.asarray(_route(params, x, 2)[0])
    used = len(np.unique(ids))
    baselines = [best[n] for n in best if n != "layer"]
    rows.append(
      dict(
        section="decode",
        mesh="1 device",
        T=tokens,
        used_experts=used,
        floor_mib=used * expert_bytes / 2**20,
        layer_ms=best["layer"] * 1e3,
        per_token_gather_ms=best.get("per-token gather", math.nan) * 1e3,
        distinct_once_ms=best.get("distinct experts once", math.nan) * 1e3,
        layer_of_best=best["layer"] / min(baselines) if baselines else math.nan,
      )
    )
  _table(
    "decode: one device, E=32, K=2, D=1024, F=2048, f32 (interleaved; floor = used experts' "
    "weight bytes)",
    rows,
    ["T", "used_experts", "floor_mib", "layer_ms", "per_token_gather_ms", "distinct_once_ms",
     "layer_of_best"],
  )  # fmt: skip
  return (
    rows
    + decode_cost_rows(config, params, repeats)
    + decode_mesh_rows(config, params, repeats, rows)
  )


def decode_cost_rows(config: MoEConfig, params: MoEParams, repeats: int) -> list[dict]:
  """Where a T=1 call's time goes: the floor (one read of its two experts' weights, sliced
  beforehand: the bytes it must read), the router and top-k, the expert path alone
  (sort, tile metadata, tile loop), and the whole layer (plus flattening, padding, the chunk
  loop and the output)."""
  x = jax.random.normal(jax.random.key(1), (1, config.hidden_size))
  ids = _route(params, x, config.top_k)[0][0]
  sliced = (params.w_gate_up[ids], params.w_down[ids])  # [K, D, 2F], [K, F, D]
  mask = jnp.ones(1, bool)

  def route_only(params, x):
    logits = routing.router_logits(x, params.router_kernel)
    return routing.route(logits, mask, config, None)

  def experts_only(params, x, ids, weights):
    return tile_loop_mlp(
      x, ids, weights, ExpertWeights(params.w_gate_up, params.w_down),
      activation=config.gated_activation, tile_rows=default_tile_rows(ids.size, 32),
    )  # fmt: skip

  def floor(w_gate_up, w_down):  # reads the used experts' weight bytes once, nothing else
    return jnp.sum(w_gate_up) + jnp.sum(w_down)

  route = route_only(params, x)
  floor_name = "floor: read the 2 used experts' weights (48 MiB)"
  calls = {
    floor_name: (jax.jit(floor), *sliced),
    "router + top-k": (jax.jit(route_only), params, x),
    "expert path (sort, tiles, tile loop)": (
      jax.jit(experts_only),
      params,
      x,
      route.expert_ids,
      route.weights,
    ),
    "whole layer": (jax.jit(moejax_forward(config)), params, x),
  }
  best = interleaved_best(calls, rounds=10 * repeats)
  rows = [
    dict(section="decode_cost", part=name, ms=seconds * 1e3, of_floor=seconds / best[floor_name])
    for name, seconds in best.items()
  ]
  _table("decode: where a T=1 call's time goes (one device)", rows, ["part", "ms", "of_floor"])
  return rows


def decode_mesh_rows(config: MoEConfig, params: MoEParams, repeats: int, single: list[dict]):
  """The layer at decode sizes on the 2x4 mesh, both schemes: T per device as on one device."""
  mesh = mesh_2x4()
  params = on_mesh(params, config, mesh)
  rows = []
  for tokens, one_device in zip(DECODE_TOKENS, single, strict=True):
    x = jax.random.normal(jax.random.key(tokens), (8 * tokens, config.hidden_size))
    calls = {
      scheme: (
        jax.jit(moejax_forward(dataclasses.replace(config, dispatch=scheme), mesh)),
        params,
        x,
      )
      for scheme in ("all_gather", "all_to_all")
    }
    best = interleaved_best(calls, rounds=3 * repeats)
    rows.append(
      dict(
        section="decode",
        mesh="2x4 mesh",
        T=tokens,
        all_gather_ms=best["all_gather"] * 1e3,
        all_to_all_ms=best["all_to_all"] * 1e3,
        one_device_ms=one_device["layer_ms"],
      )
    )
  _table(
    "decode: 2x4 mesh (8 simulated devices on this CPU's cores), T per device",
    rows,
    ["T", "all_gather_ms", "all_to_all_ms", "one_device_ms"],
  )
  return rows


AUTO_TOKENS = (256, 512, 4096, 32768, 65536)  # per device
AUTO_FIXED = (256, 1024, 4096)


def auto_section(repeats: int) -> list[dict]:
  """`chunk_size="auto"` vs fixed chunks: one device's forward time (interleaved per T) and
  the compiled temp on one device and on the 2x4 mesh (T tokens per device)."""
  if len(jax.devices("cpu")) > 1 and jax.default_backend() == "cpu":
    rows = one_device_process("auto", repeats)
    mesh = mesh_2x4()
    for row in rows:
      config = config_of(32, 2, row["T"] if row["chunk"] == "one" else row["chunk"])
      x = jax.ShapeDtypeStruct((row["T"] * 8, D), jnp.float32)
      row["mesh_temp_mib"] = _temp_mib(config, x, mesh)
    _auto_table(rows)
    return rows
  rows = []
  for tokens in AUTO_TOKENS:
    x = jax.random.normal(jax.random.key(7), (tokens, D))
    configs = {"auto": config_of(32, 2, "auto"), "one": config_of(32, 2, tokens)}
    configs |= {c: config_of(32, 2, c) for c in AUTO_FIXED if c < tokens}
    params = random_params(configs["auto"], jax.random.key(0))
    calls = {name: (jax.jit(moejax_forward(c)), params, x) for name, c in configs.items()}
    best = interleaved_best(calls, rounds=repeats)
    fastest = min(best.values())
    for name, config in configs.items():
      call = plan_call(config, x)
      rows.append(
        dict(
          section="auto", T=tokens, chunk=name, C=call.layout.chunk, path=call.expert.path,
          ms=best[name] * 1e3,
          of_best=best[name] / fastest, temp_mib=_temp_mib(config, x, None),
        )
      )  # fmt: skip
  return rows


def _temp_mib(config: MoEConfig, x, mesh: Mesh | None) -> float:
  params = abstract_params(config)
  return peak_temp_bytes(jax.jit(moejax_forward(config, mesh)), params, x) / 2**20


def _auto_table(rows: list[dict]) -> None:
  _table(
    "auto: chunk_size='auto' (default budget) vs fixed chunks, E=32, K=2; time on one device "
    "(interleaved), compiled temp on one device and on the 2x4 mesh (T per device)",
    rows,
    ["T", "chunk", "C", "ms", "of_best", "temp_mib", "mesh_temp_mib"],
  )


STEP_TOKENS = 4096
STEP_CHUNKS = (1, 8, 32)


def one_device_process(section: str, repeats: int) -> list[dict]:
  """Runs `section` in a child process that has one CPU device; returns its rows.

  Simulated devices share this machine's cores, and with more of them than cores XLA:CPU's
  multithreaded matmuls slow down: on 2 cores a loop step of one [32, 256] x [256, 1024] dot
  takes ~44 us with 1 or 2 simulated devices and ~70 us with 8 (docs/measurements.md, "Chunk
  loop"). A program on one device in an 8-device process pays that per matmul, which no
  one-device machine does, and more so the smaller its matmuls are.
  """
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
  env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
  with tempfile.TemporaryDirectory() as out:
    command = [sys.executable, __file__, f"--sections={section}", f"--repeats={repeats}"]
    subprocess.run([*command, f"--out={out}"], env=env, check=True)
    return json.loads((Path(out) / "bench.json").read_text())


def steps_section(repeats: int) -> list[dict]:
  """The chunk loop's cost per step: one device, T=4096 as 1, 8 and 32 chunks, interleaved."""
  if len(jax.devices("cpu")) > 1 and jax.default_backend() == "cpu":
    return one_device_process("steps", repeats)
  calls = {}
  x = jax.random.normal(jax.random.key(6), (STEP_TOKENS, D))
  params = random_params(config_of(32, 2, STEP_TOKENS), jax.random.key(0))
  for chunks in STEP_CHUNKS:
    forward = jax.jit(moejax_forward(config_of(32, 2, STEP_TOKENS // chunks)))
    grad = jax.jit(jax.grad(lambda p, x, f=forward: jnp.sum(f(p, x) ** 2), argnums=(0, 1)))
    calls[chunks, "fwd"] = (forward, params, x)
    calls[chunks, "fwd+bwd"] = (grad, params, x)
  best = interleaved_best(calls, rounds=3 * repeats)
  rows = []
  for chunks in STEP_CHUNKS:
    row = dict(section="steps", chunks=chunks, C=STEP_TOKENS // chunks)
    for kind in ("fwd", "fwd+bwd"):
      row[f"{kind}_ms"] = best[chunks, kind] * 1e3
      row[f"{kind}_of_1_chunk"] = best[chunks, kind] / best[1, kind]
      # What each extra step costs beyond the one-chunk program, in ms.
      extra = (best[chunks, kind] - best[1, kind]) / max(chunks - 1, 1)
      row[f"{kind}_ms_per_extra_step"] = extra * 1e3
    rows.append(row)
  _table(
    f"steps: one device, T={STEP_TOKENS}, E=32, K=2 as 1, 8, 32 chunks (interleaved, min of "
    f"{3 * repeats})",
    rows,
    ["chunks", "C", "fwd_ms", "fwd_of_1_chunk", "fwd+bwd_ms", "fwd+bwd_of_1_chunk",
     "fwd_ms_per_extra_step", "fwd+bwd_ms_per_extra_step"],
  )  # fmt: skip
  return rows


QUANT_TOKENS = (512, 4096)


def quant_section(repeats: int) -> list[dict]:
  """Quantized experts vs float32 ones on one device (E=32, K=2, C=512): forward time, timed
  interleaved, weight bytes and compiled temporaries."""
  config = config_of(32, 2, 512)
  params = random_params(config, jax.random.key(0))
  layers = {"float32": (params, config)}
  for expert_quant in FORMATS:  # each in its own default block
    layers[expert_quant] = quant.quantize_experts(params, config, expert_quant)
  bits = lambda tree: sum(a.size * jax.dtypes.itemsize_bits(a.dtype) for a in jax.tree.leaves(tree))
  rows, calls = [], {}
  for tokens in QUANT_TOKENS:
    x = jax.random.normal(jax.random.key(7), (tokens, D))
    for name, (p, c) in layers.items():
      calls[tokens, name] = (jax.jit(moejax_forward(c)), p, x)
  best = interleaved_best(calls, rounds=3 * repeats)
  for (tokens, name), (fn, p, x) in calls.items():
    rows.append(
      dict(
        section="quant",
        T=tokens,
        experts=name,
        fwd_ms=best[tokens, name] * 1e3,
        time_of_float32=best[tokens, name] / best[tokens, "float32"],
        weight_mb=bits((p.w_gate_up, p.w_down)) / 8 / 2**20,
        temp_mb=peak_temp_bytes(fn, p, x) / 2**20,
      )
    )
  _table(
    f"quant: one device, E=32, K=2, C=512, float32 compute (interleaved, min of {3 * repeats})",
    rows,
    ["T", "experts", "fwd_ms", "time_of_float32", "weight_mb", "temp_mb"],
  )
  return rows


LORA_RANKS = (8, 16, 64)


def lora_section(repeats: int) -> list[dict]:
  """LoRA adapters against the same layer without them, one device (E=32, K=2, T=4096,
  C=512), float32 and fp8_block bases: the forward pass, and the forward + backward that
  training runs (the adapters' gradients; without adapters every float parameter's), timed
  interleaved; the trained bytes and Adam's state for them."""
  config = config_of(32, 2, 512)
  x = jax.random.normal(jax.random.key(8), (4096, D))
  bases = {"float32": (random_params(config, jax.random.key(0)), config)}
  bases["fp8_block"] = quant.quantize_experts(*bases["float32"], "fp8_block")
  calls, trained = {}, {}
  for base_name, (params, base) in bases.items():
    for rank in (0, *LORA_RANKS):
      adapted = dataclasses.replace(base, lora_rank=rank)
      forward = moejax_forward(adapted)
      if rank:
        adapters = _random_adapters(adapted)
        with_adapters = params._replace(lora=adapters)
        train = jax.grad(lambda a, p, x, f=forward: jnp.sum(f(p._replace(lora=a), x) ** 2))
        calls[base_name, rank, "forward"] = (jax.jit(forward), with_adapters, x)
        calls[base_name, rank, "train"] = (jax.jit(train), adapters, params, x)
        trained[base_name, rank] = adapters
      else:
        train = jax.grad(lambda p, x, f=forward: jnp.sum(f(p, x) ** 2))
        calls[base_name, rank, "forward"] = (jax.jit(forward), params, x)
        calls[base_name, rank, "train"] = (jax.jit(train), params, x)
        trained[base_name, rank] = [  # quantized experts are constants
          value for value in params if value is not None and not is_block_scaled(value)
        ]
  best = interleaved_best(calls, rounds=2 * repeats)
  megabytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree)) / 2**20
  rows = []
  for base_name in bases:
    for rank in (0, *LORA_RANKS):
      forward, train = (best[base_name, rank, what] for what in ("forward", "train"))
      rows.append(
        dict(
          section="lora",
          base=base_name,
          r=rank,
          fwd_ms=forward * 1e3,
          fwd_of_no_adapters=forward / best[base_name, 0, "forward"],
          train_ms=train * 1e3,
          train_of_float_full=train / best["float32", 0, "train"],
          trained_mb=megabytes(trained[base_name, rank]),
          adam_state_mb=2 * megabytes(trained[base_name, rank]),
        )
      )
  _table(
    f"lora: one device, E=32, K=2, T=4096, C=512, float32 compute (interleaved, min of "
    f"{2 * repeats}); r=0: no adapters, training every float parameter",
    rows,
    [
      "base",
      "r",
      "fwd_ms",
      "fwd_of_no_adapters",
      "train_ms",
      "train_of_float_full",
      "trained_mb",
      "adam_state_mb",
    ],
  )
  return rows


def _random_adapters(config: MoEConfig):
  """Adapters with non-zero A and B (a trained adapter's cost, not a new one's zeros)."""
  expected = call_record(config).lora
  keys = jax.random.split(jax.random.key(9), len(expected))
  return lora.ExpertLoRA(
    *(0.05 * jax.random.normal(k, e.shape) for k, e in zip(keys, expected, strict=True))
  )


def padding_section(repeats: int) -> list[dict]:
  tokens = 8192
  config = config_of(32, 2, 256)
  params = random_params(config, jax.random.key(0))
  x = jax.random.normal(jax.random.key(3), (tokens, D))
  rows = []
  for mesh_name, mesh in (("1 device", None), ("2x4 mesh", mesh_2x4())):
    fn = jax.jit(
      lambda p, x, m, c=config, mesh=mesh: moe_apply(p, x, config=c, mesh=mesh, token_mask=m)[0]
    )
    patterns = {
      f"{int(f * 100)}% valid (random)": jax.random.bernoulli(jax.random.key(4), f, (tokens,))
      for f in (1.0, 0.5, 0.1, 0.0)
    }
    if mesh is not None:
      busy = np.zeros((8, tokens // 8), bool)
      busy[5] = True  # one full rank among idle ones
      patterns["one busy rank of 8"] = jnp.asarray(busy.reshape(-1))
    full_ms = None
    for name, mask in patterns.items():
      ms = best_time(fn, params, x, mask, repeats=repeats) * 1e3
      full_ms = full_ms or ms
      rows.append(
        dict(section="padding", mesh=mesh_name, pattern=name, ms=ms, of_full=ms / full_ms)
      )
  _table(
    "padding: time vs the share of valid tokens (T=8192, E=32, K=2, C=256)",
    rows,
    ["mesh", "pattern", "ms", "of_full"],
  )
  return rows


def compile_section() -> list[dict]:
  config = config_of(8, 2, 64)
  params = random_params(config, jax.random.key(0))
  x = jax.random.normal(jax.random.key(5), (1024, D))
  mesh = mesh_2x4()
  before = compiled_executables()
  for i in range(20):
    counts = np.random.default_rng(i).integers(0, 129, size=8)
    mask = jnp.asarray((np.arange(128)[None, :] < counts[:, None]).reshape(-1))
    jax.block_until_ready(moe_apply(params, x, config=config, mesh=mesh, token_mask=mask))
  rows = [dict(section="compiles", patterns=20, executables=compiled_executables() - before)]
  _table("compiles: 20 token-count patterns, 2x4 mesh", rows, ["patterns", "executables"])
  return rows


# ---- output ----------------------------------------------------------------------------


def _table(title: str, rows: list[dict], columns: list[str]) -> None:
  print(f"\n{title}")
  widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns}
  print("  ".join(c.rjust(widths[c]) for c in columns))
  for r in rows:
    print("  ".join(_fmt(r[c]).rjust(widths[c]) for c in columns))


def _fmt(value) -> str:
  return f"{value:.3g}" if isinstance(value, float) else str(value)


def plot_chunks(rows: list[dict], path: Path) -> None:
  import matplotlib  # imported here: only the plot needs it

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
  for mesh_name, style in (("1 device", "-o"), ("2x4 mesh", "--s")):
    for chunk in sorted({r["chunk"] for r in rows}):
      sel = [r for r in rows if r["mesh"] == mesh_name and r["chunk"] == chunk]
      tokens = [r["T"] for r in sel]
      ax_time.plot(tokens, [r["ms"] for r in sel], style, label=f"{mesh_name}, C={chunk}")
      ax_mem.plot(tokens, [r["temp_mib"] for r in sel], style, label=f"{mesh_name}, C={chunk}")
  for ax, label in ((ax_time, "time (ms)"), (ax_mem, "compiled peak temp memory (MiB)")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("total tokens T")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  ax_mem.legend(fontsize=7)
  fig.suptitle("moejax chunk sweep (E=32, K=2, D=256, F=512, float32, CPU)")
  fig.tight_layout()
  with files.atomic_path(path, overwrite=True) as temporary:
    fig.savefig(temporary, dpi=120)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Section:
  """One section of the suite: its name (`--sections`), what it measures, how it runs (the
  parsed flags -> its rows) and whether a plain run includes it."""

  name: str
  summary: str
  run: Callable[[argparse.Namespace], list[dict]]
  default: bool = True


def _chunks_with_plot(args: argparse.Namespace) -> list[dict]:
  rows = chunk_section(args.full, args.repeats)
  plot_chunks(rows, Path(args.out) / "chunk_sweep.png")
  return rows


def _beside(module: str):
  """A benchmark module beside this file (`benchmarks/depth.py`, `benchmarks/mesh.py`)."""
  sys.path.insert(0, str(Path(__file__).parent))
  return importlib.import_module(module)


# In the order they run.
SECTIONS = {
  section.name: section
  for section in (
    Section(
      name="layer",
      summary="forward and forward+backward vs a dense matmul of the same active FLOPs (the "
      "ceiling), every expert on every token, GShard one-hot einsums (capacity 1.25) and "
      "sort + jax.lax.ragged_dot",
      run=lambda args: layer_section(args.full, args.repeats),
    ),
    Section(
      name="chunks",
      summary="time and compiled peak temporary memory vs total tokens, per chunk size, on one "
      "device and on the 2x4 mesh",
      run=_chunks_with_plot,
    ),
    Section(
      name="decode",
      summary="decode-size calls (T per device 1 ... 128, E=32, K=2, D=1024, F=2048) against "
      "two baselines that read only the used experts, and on the 2x4 mesh (both schemes)",
      run=lambda args: decode_section(args.repeats),
    ),
    Section(
      name="auto",
      summary='chunk_size="auto" (the default) against fixed chunks of 256, 1024, 4096 and '
      "one chunk: forward time on one device (T = 256 ... 65,536, interleaved, in a process "
      "of its own) and compiled temp on one device and the 2x4 mesh",
      run=lambda args: auto_section(args.repeats),
    ),
    Section(
      name="steps",
      summary="the chunk loop's cost per step: T=4096 on one device as 1, 8 and 32 chunks, "
      "forward and forward+backward, timed interleaved in a process of its own that has one "
      "CPU device (see `one_device_process`)",
      run=lambda args: steps_section(args.repeats),
    ),
    Section(
      name="padding",
      summary="100 / 50 / 10 / 0 % valid tokens, and one busy rank among idle ones",
      run=lambda args: padding_section(args.repeats),
    ),
    Section(
      name="quant",
      summary="fp8_block, mxfp4, int4_group and nvfp4 experts vs float32 ones (T=512 and "
      "4096, one device): time ratio, expert-weight bytes at each format's bit width and the "
      "compiled temporaries (no dequantized copy of all experts)",
      run=lambda args: quant_section(args.repeats),
    ),
    Section(
      name="compiles",
      summary="executables compiled across 20 token-count patterns (must be 1)",
      run=lambda args: compile_section(),
    ),
    Section(
      name="lora",
      summary="LoRA adapters (r = 8, 16, 64) against the same layer without them, float32 and "
      "fp8_block experts: forward, training's forward + backward (adapters only), trained "
      "bytes and Adam's state",
      run=lambda args: lora_section(args.repeats),
    ),
    Section(
      name="depth",
      summary="scanned and unrolled stacks of blocks, remat policies of the layer's checkpoint "
      "names, and the layer's compile time against a dense MLP (benchmarks/depth.py; several "
      "minutes)",
      run=lambda args: _beside("depth").depth_section(args.repeats, _table),
      default=False,
    ),
    Section(
      name="invariance",
      summary="batch_invariant=True against the default: forward and forward+backward time "
      "ratios, T = 1, 64, 4096, one device and the 2x4 mesh (benchmarks/rl.py)",
      run=lambda args: _beside("rl").invariance_section(args.repeats, interleaved_best, _table),
      default=False,
    ),
    Section(
      name="balancing",
      summary="the aux-loss-free bias update on a skewed synthetic router: max/mean expert "
      "load over 200 steps with and without it (benchmarks/rl.py)",
      run=lambda args: _beside("rl").balancing_section(_table),
      default=False,
    ),
    Section(
      name="mesh",
      summary="expert weights split over data (`expert_fsdp`) vs replicated, an expert group "
      "(expert, tensor) on a (2, 2, 2) mesh vs (2, 4), and DeepSeek-V3's weight bytes per "
      "device by expert parallelism and FSDP (benchmarks/mesh.py)",
      run=lambda args: _beside("mesh").mesh_section(args.repeats, _table),
      default=False,
    ),
  )
}


def _sections_help() -> str:
  wrap = lambda text: textwrap.fill(text, 96, initial_indent="  ", subsequent_indent="  ")
  return "sections:\n" + "\n".join(
    f"{section.name}{'' if section.default else ' (not in a plain run)'}\n{wrap(section.summary)}"
    for section in SECTIONS.values()
  )


def parser() -> argparse.ArgumentParser:
  """The suite's command line (`python -m moejax bench --help`)."""
  parser = argparse.ArgumentParser(
    prog="python -m moejax bench",
    description=__doc__,
    epilog=_sections_help(),
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--full", action="store_true", help="more shapes and token counts")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per case (default 3)")
  parser.add_argument("--out", default="results", help="folder for bench.json and the plot")
  parser.add_argument("--overwrite", action="store_true", help="replace earlier results in --out")
  defaults = [name for name, section in SECTIONS.items() if section.default]
  parser.add_argument(
    "--sections",
    default=",".join(defaults),
    help=f"comma-separated, of: {','.join(SECTIONS)} (default: {','.join(defaults)})",
  )
  return parser


def main(argv: list[str] | None = None) -> None:
  flags = parser()
  args = flags.parse_args(argv)
  chosen = sections_of(flags, args.sections, tuple(SECTIONS))
  start = time.perf_counter()
  print(
    f"moejax bench: {jax.devices()[0].device_kind}, {len(jax.devices())} devices, "
    f"JAX {jax.__version__}, D={D}, F={F}, float32"
  )
  out = Path(args.out)
  if not args.overwrite:
    try:
      files.refuse_existing([out / "bench.json", out / "chunk_sweep.png"], how="pass --overwrite")
    except FileExistsError as error:  # a sentence, not a traceback, before any measuring
      raise SystemExit(f"moejax bench: {error}") from None
  rows = [row for name, section in SECTIONS.items() if name in chosen for row in section.run(args)]
  files.write_atomically(out / "bench.json", json.dumps(rows, indent=1), overwrite=True)
  print(f"\nwrote {out / 'bench.json'} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
