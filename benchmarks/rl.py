"""`python -m moejax bench --sections invariance,balancing`: what RL training asks of the layer.

invariance  `batch_invariant=True` against the default: forward and forward+backward times
            and their ratio, one device and the 2x4 mesh, T = 1, 64 and 4096 (E=8, K=2,
            D=256, F=512, one shared expert, float32), timed interleaved
balancing   the aux-loss-free bias update (`moejax.balancing`) on a skewed synthetic
            router: the max/mean expert load over 200 steps with and without it (E=64,
            K=8, sigmoid scores, 16384 fresh tokens a step, every expert's logit offset by
            a fixed draw of standard deviation 0.5, rate 3e-3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from moejax import MoEConfig, balancing, moe_apply, routing
from moejax.testing import random_params

CONFIG = MoEConfig(
  num_experts=8,
  top_k=2,
  hidden_size=256,
  intermediate_size=512,
  num_shared_experts=1,
  shared_intermediate_size=512,
)
SIZES = (1, 64, 4096)


def invariance_rows(repeats: int, interleaved_best: Callable) -> list[dict]:
  """Times of the default layer and the batch-invariant one, interleaved per case."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
  rows = []
  for mesh_name, on in (("1 device", None), ("2x4 mesh", mesh)):
    for tokens in SIZES:
      x = jax.random.normal(jax.random.key(tokens), (tokens, CONFIG.hidden_size))
      calls = {}
      for mode in ("default", "invariant"):
        config = dataclasses.replace(CONFIG, batch_invariant=mode == "invariant")
        params = random_params(config, jax.random.key(0))
        forward = jax.jit(lambda p, x, c=config, m=on: moe_apply(p, x, config=c, mesh=m)[0])
        loss = lambda p, x, c=config, m=on: jnp.sum(moe_apply(p, x, config=c, mesh=m)[0] ** 2)
        calls[f"{mode} forward"] = (forward, params, x)
        calls[f"{mode} gradient"] = (jax.jit(jax.grad(loss)), params, x)
      best = interleaved_best(calls, repeats)
      for kind in ("forward", "gradient"):
        default_ms, invariant_ms = (
          best[f"{mode} {kind}"] * 1e3 for mode in ("default", "invariant")
        )
        rows.append(
          dict(
            section="invariance",
            mesh=mesh_name,
            tokens=tokens,
            pass_=kind,
            default_ms=default_ms,
            invariant_ms=invariant_ms,
            ratio=invariant_ms / default_ms,
          )
        )
  return rows


BALANCING = MoEConfig(
  num_experts=64,
  top_k=8,
  hidden_size=32,
  intermediate_size=8,
  scoring="sigmoid",
  use_routing_bias=True,
  router_bias=True,
)
BALANCING_TOKENS = 16384
STEPS = 200
RATE = 3e-3
SKEW = 0.5  # standard deviation of the fixed per-expert logit offsets


def balancing_rows() -> list[dict]:
  """max/mean load at chosen steps, with the update at `RATE` and without it. Each step
  routes its tokens as the layer does (`moejax.routing`, whose counts are the layer's
  `expert_counts`) and skips the experts, whose outputs move no load."""
  params = random_params(BALANCING, jax.random.key(0))
  skew = SKEW * jax.random.normal(jax.random.key(1), (BALANCING.num_experts,))
  every_token = jnp.ones(BALANCING_TOKENS, bool)

  @jax.jit
  def step(bias, key, rate):
    x = jax.random.normal(key, (BALANCING_TOKENS, BALANCING.hidden_size))
    logits = routing.router_logits(x, params.router_kernel, skew)
    counts = routing.router_stats(
      logits, routing.route(logits, every_token, BALANCING, bias), every_token
    ).expert_counts[: BALANCING.num_experts]
    moved = balancing.bias_update(bias, counts, rate=rate, num_experts=BALANCING.num_experts)
    return moved, routing.load_max_over_mean(counts)

  loads = {}
  for name, rate in (("without", 0.0), ("with", RATE)):
    bias, trace = jnp.zeros(BALANCING.num_experts), []
    for i in range(STEPS):
      bias, load = step(bias, jax.random.key(100 + i), rate)
      trace.append(float(load))
    loads[name] = trace
  first = next((i for i, v in enumerate(loads["with"]) if v <= 1.10), None)
  last = lambda trace: sum(trace[-50:]) / 50
  rows = [
    dict(
      section="balancing",
      step=i,
      without_update=loads["without"][i],
      with_update=loads["with"][i],
    )
    for i in (0, 10, 25, 50, 100, 150, STEPS - 1)
  ]
  rows.append(
    dict(
      section="balancing",
      step="mean of the last 50",
      without_update=last(loads["without"]),
      with_update=last(loads["with"]),
      first_step_at_most_1_10=first,
    )
  )
  return rows


def invariance_section(repeats: int, interleaved_best: Callable, table: Callable) -> list[dict]:
  rows = invariance_rows(repeats, interleaved_best)
  table(
    "invariance: batch_invariant=True vs the default (E=8, K=2, D=256, F=512, a shared expert)",
    rows,
    ["mesh", "tokens", "pass_", "default_ms", "invariant_ms", "ratio"],
  )
  return rows


def balancing_section(table: Callable) -> list[dict]:
  rows = balancing_rows()
  table(
    f"balancing: max/mean expert load, skewed router (E=64, K=8, {BALANCING_TOKENS} tokens a "
    f"step), bias update rate {RATE} vs none; at most 1.10 from step "
    f"{rows[-1]['first_step_at_most_1_10']}",
    rows,
    ["step", "without_update", "with_update"],
  )
  return rows
