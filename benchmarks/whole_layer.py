"""The whole MoE layer, route to combine, on one device: every expert path and the peers that
import, against a dense matmul of the same FLOPs, forward and forward+backward, and where the
time goes.

Per shape and token count, one row per path, each time the median of device-synchronised calls
after a compile call, all in one process:

- layer_ms, train_ms: `moe_apply` (router, top-k, the expert path, the combine), forward and
  forward+backward (the pullback of a random cotangent), the path forced as `moejax.tune`
  forces a candidate;
- dense_fraction, train_dense_fraction: a dense chain of the same FLOPs ([T*K, D] @ [D, 2F],
  the activation, @ [F, D]) over the layer's time: 1.0 is the speed of its matmuls;
- stages (forward): experts_ms, the expert path alone on the same ids and weights; routing_ms
  = layer - experts (the router, top-k, the layer's own work around the experts); glue_ms =
  experts - dense (all the path does beyond its matmuls at the dense rate).

Peers, on the same ids and weights (their expert MLP; routing_ms, forward, is moejax's router
and top-k, added to both of their times): JAX's
`ragged_dot_mgpu` (sort, two grouped matmuls, scatter; Hopper), and Levanter grug's `moe_mlp`
("scatter" and "sonic"), each where it imports, else a row saying why. The clients whose MoE
is a layer with its own router, whole (their router and top-k included; no stages): tunix's
Qwen3 `MoELayer` (its dense path: its megablox kernel is TPU-only) and MaxText's `RoutedMoE`
(`sparse_matmul`, `jax.lax.ragged_dot`), each where installed, else a row saying why.

FP8 (`measure_fp8`, DeepSeek-V3's shard at 4096 tokens): the layer with
compute_quant="fp8_deepseek" beside the bf16 layer on expert_backend "xla" (the tile loop's
emulation), "pallas" (the Hopper fp8 kernels) and "fused" (the fused path's Triton kernels on
e4m3 operands), forward and forward+backward, and fp8's speedup over bf16 on each.

  python benchmarks/whole_layer.py [--smoke]        # or gpu_check.py's `whole_layer` part
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from gpu_kernels import forward_backward, median_seconds  # noqa: E402

from kernels_pallas.platform import on_cpu  # noqa: E402
from moejax import MoEConfig, moe_apply, tuning  # noqa: E402
from moejax.experts import routed_mlp  # noqa: E402
from moejax.params import ExpertWeights  # noqa: E402
from moejax.plan import ExpertPlan  # noqa: E402
from moejax.testing import random_params  # noqa: E402
from moejax.tuner import candidates  # noqa: E402
from tests.peers import flax_as_tunix_runs, grug_modules, maxtext_pair, tunix_qwen3  # noqa: E402

# name -> (local experts, K, D, F): one GPU's expert shard.
SHAPES = {
  "Mixtral-8x7B": (8, 2, 4096, 14336),
  "DeepSeek-V3 shard": (32, 8, 7168, 2048),
}
TOKENS = (4096, 16384)
SMOKE_SHAPES = {"smoke": (4, 2, 32, 32)}
SMOKE_TOKENS = (64,)
FP8_SMOKE_SHAPES = {"smoke fp8": (4, 2, 128, 128)}  # fp8_deepseek's groups of 128


def _config(shape: tuple[int, int, int, int], tokens: int) -> MoEConfig:
  experts, top_k, d, f = shape
  return MoEConfig(
    num_experts=experts, top_k=top_k, hidden_size=d, intermediate_size=f, chunk_size=tokens,
    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
  )  # fmt: skip


# XLA's ragged_dot expands densely over the local experts on a GPU (`moejax.plan`): timed only
# up to this many (row, choice) assignments times local experts.
RAGGED_DOT_MAX_ROW_EXPERTS = 1 << 18


def paths(config: MoEConfig, rows: int) -> list[tuning.Candidate]:
  """The candidates `moejax.tune` would time at `rows` assignments (each kernel once, at its
  own blocks; XLA's ragged_dot where it stays small), and on a CPU the kernels in their
  interpreter."""
  found = [c for c in candidates(config, None) if c.blocks is None]
  if rows * config.num_experts > RAGGED_DOT_MAX_ROW_EXPERTS and not on_cpu():
    found = [c for c in found if c.name != "ragged_dot"]
  if on_cpu():
    found += [
      tuning.Candidate(path="pallas", backend="triton", status="passed"),
      tuning.Candidate(path="fused", backend="triton", status="passed"),
    ]
  return found


def _dense(config: MoEConfig, x_rows, w_gate_up, w_down):
  gate, up = jnp.split(x_rows @ w_gate_up, 2, axis=-1)
  return (config.gated_activation(gate, up).astype(x_rows.dtype)) @ w_down


def _routing(params, x, top_k: int):
  logits = x.astype(jnp.float32) @ params.router_kernel.astype(jnp.float32)
  weights, ids = jax.lax.top_k(jax.nn.softmax(logits), top_k)
  return ids.astype(jnp.int32), weights


def _peers(config: MoEConfig) -> dict[str, Callable | str]:
  """Peer expert MLPs (x, ids, weights, w_gate_up, w_down) -> [T, D], or why each is absent."""
  found: dict[str, Callable | str] = {}
  if on_cpu():
    found["jax ragged_dot_mgpu"] = "needs a Hopper GPU"
  else:
    from gpu_kernels import upstream_ragged_dot

    def mgpu(x, ids, weights, w_gate_up, w_down):
      top_k, f = ids.shape[1], w_down.shape[1]
      order = jnp.argsort(ids.reshape(-1))
      sizes = jnp.bincount(ids.reshape(-1), length=w_down.shape[0]).astype(jnp.int32)
      gate_up = upstream_ragged_dot(x[order // top_k], w_gate_up, sizes)
      hidden = config.gated_activation(gate_up[:, :f], gate_up[:, f:]).astype(x.dtype)
      out = upstream_ragged_dot(hidden, w_down, sizes)
      unsorted = jnp.zeros_like(out).at[order].set(out).reshape(*ids.shape, -1)
      return jnp.einsum("tk,tkd->td", weights, unsorted.astype(jnp.float32))

    found["jax ragged_dot_mgpu"] = mgpu
  grug_moe, activation = grug_modules()
  for implementation in ("scatter", "sonic"):
    name = f"levanter grug {implementation}"
    if grug_moe is None:
      found[name] = "marin-levanter is not installed"
      continue
    found[name] = lambda x, ids, w, wgu, wd, impl=implementation: grug_moe.moe_mlp(
      x, ids, w, wgu, wd, activation=activation.silu, implementation=impl
    )
  return found


def _client_layers(config: MoEConfig) -> dict[str, tuple[Callable, Any] | str]:
  """The clients' own MoE layers of `config`'s shape in bfloat16, router included: name ->
  (fn(params, x [T, D]) -> [T, D], params), or why each is absent."""
  e, k, d, f = config.num_experts, config.top_k, config.hidden_size, config.intermediate_size
  found: dict[str, tuple[Callable, Any] | str] = {}
  qwen3 = tunix_qwen3()
  if qwen3 is None:
    found["tunix qwen3 dense"] = "google-tunix is not installed"
  else:
    tunix_config = qwen3.ModelConfig(
      num_layers=1, vocab_size=32, embed_dim=d, hidden_dim=f, num_heads=1, head_dim=8,
      num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6, num_experts=e, num_experts_per_tok=k,
      dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
    )  # fmt: skip
    with flax_as_tunix_runs():
      graph, params = nnx.split(qwen3.MoELayer(tunix_config, rngs=nnx.Rngs(0)))
    apply = lambda params, x: nnx.merge(graph, params)(x[None], use_megablox=False)[0]
    found["tunix qwen3 dense"] = (apply, params)
  with jax.numpy_rank_promotion("allow"):  # MaxText broadcasts
    layers = maxtext_pair(
      (e, k, d, f), sparse_matmul=True, megablox=False, dtype="bfloat16",
      weight_dtype="bfloat16", matmul_precision="default", load_balance_loss_weight=0.0,
    )  # fmt: skip
  if layers is None:
    found["maxtext routedmoe ragged_dot"] = "maxtext is not installed (Python >= 3.12)"
  else:
    graph, params, rest = nnx.split(layers[0], nnx.Param, ...)

    def apply(params, x):
      with jax.numpy_rank_promotion("allow"):
        return nnx.merge(graph, params, rest)(x[None])[0][0]

    found["maxtext routedmoe ragged_dot"] = (apply, params)
  return found


def _inputs(config: MoEConfig, tokens: int) -> tuple:
  """(params, x [T, D] bf16, a float32 cotangent of x's shape), drawn afresh per token count."""
  keys = jax.random.split(jax.random.key(tokens), 3)
  x = jax.random.normal(keys[1], (tokens, config.hidden_size), jnp.bfloat16)
  return random_params(config, keys[0]), x, jax.random.normal(keys[2], x.shape, jnp.float32)


def measure(shape_name: str, tokens: int, smoke: bool, record: Callable[[dict], None]) -> None:
  """Every path and peer at one shape and token count; one row each, handed to `record`."""
  config = _config((SMOKE_SHAPES | SHAPES)[shape_name], tokens)
  repeats = 1 if smoke else 5
  params, x, cotangent = _inputs(config, tokens)
  ids, weights = _routing(params, x, config.top_k)
  rows = tokens * config.top_k
  time = functools.partial(median_seconds, repeats=repeats)
  x_rows = jnp.repeat(x, config.top_k, axis=0)
  dense = functools.partial(_dense, config)
  dense_ms = time(jax.jit(dense), x_rows, params.w_gate_up[0], params.w_down[0]) * 1e3
  dense_train_ms = 1e3 * time(
    jax.jit(forward_backward(dense)), x_rows, params.w_gate_up[0], params.w_down[0],
    jnp.repeat(cotangent, config.top_k, axis=0),
  )  # fmt: skip
  base = dict(shape=shape_name, tokens=tokens, dense_ms=dense_ms, dense_train_ms=dense_train_ms)
  case = tuning.case_of(config, config.num_experts)

  def row(name: str, layer_ms: float, train_ms: float, experts_ms: float | None) -> dict:
    stages = {}  # none for a client layer timed whole
    if experts_ms is not None:
      stages = dict(experts_ms=experts_ms, routing_ms=layer_ms - experts_ms,
                    glue_ms=experts_ms - dense_ms)  # fmt: skip
    return dict(
      base, path=name, layer_ms=layer_ms, train_ms=train_ms, dense_fraction=dense_ms / layer_ms,
      train_dense_fraction=dense_train_ms / train_ms, **stages,
    )  # fmt: skip

  layer = lambda p, x: moe_apply(p, x, config=config)[0]
  for candidate in paths(config, rows):
    plan = ExpertPlan(path=candidate.path, backend=candidate.backend, interpret=on_cpu())
    experts = functools.partial(_expert_path, config, plan)
    try:
      with tuning.forcing(case, rows, candidate):
        jax.clear_caches()  # a program of another path has the same signature
        layer_ms = time(jax.jit(layer), params, x) * 1e3
        train_ms = time(jax.jit(forward_backward(layer)), params, x, cotangent) * 1e3
      experts_ms = time(jax.jit(experts), x, ids, weights, params) * 1e3
      record(row(candidate.name, layer_ms, train_ms, experts_ms))
    except Exception as error:  # a path that fails here is a result, with its reason
      record(dict(base, path=candidate.name, error=f"{type(error).__name__}: {error}"[:300]))
  for name, peer in _peers(config).items():
    if isinstance(peer, str):
      record(dict(base, path=name, skipped=peer))
      continue
    try:
      args = (x, ids, weights, params.w_gate_up, params.w_down)
      peer_ms = time(jax.jit(peer), *args) * 1e3
      trained = lambda x, weights, w_gate_up, w_down, peer=peer: peer(
        x, ids, weights, w_gate_up, w_down
      )
      train_args = (x, weights, params.w_gate_up, params.w_down, cotangent)
      peer_train_ms = time(jax.jit(forward_backward(trained)), *train_args) * 1e3
      routing_ms = time(jax.jit(lambda p, x: _routing(p, x, config.top_k)), params, x) * 1e3
      record(row(name, routing_ms + peer_ms, routing_ms + peer_train_ms, peer_ms))
    except ImportError as error:  # a backend needing what is not installed (grug's sonic)
      record(dict(base, path=name, skipped=str(error)[:300]))
    except Exception as error:
      record(dict(base, path=name, error=f"{type(error).__name__}: {error}"[:300]))
  for name, client in _client_layers(config).items():
    if isinstance(client, str):
      record(dict(base, path=name, skipped=client))
      continue
    apply, client_params = client
    try:
      layer_ms = time(jax.jit(apply), client_params, x) * 1e3
      train_ms = time(jax.jit(forward_backward(apply)), client_params, x, cotangent) * 1e3
      record(row(name, layer_ms, train_ms, experts_ms=None))
    except Exception as error:
      record(dict(base, path=name, error=f"{type(error).__name__}: {error}"[:300]))


def measure_fp8(shape_name: str, tokens: int, smoke: bool, record: Callable[[dict], None]) -> None:
  """The layer with compute_quant="fp8_deepseek" beside the bf16 layer, on the same
  expert_backend: "xla" (the tile loop emulates the recipe: numerics, no speed), "pallas"
  (the Hopper fp8 kernels) and "fused" (its kernels on e4m3 operands; both interpreted on a
  CPU). One row per backend: both layers' forward and forward+backward times, and fp8's
  speedup over bf16 (bf16 time / fp8 time)."""
  bf16 = _config((FP8_SMOKE_SHAPES | SHAPES)[shape_name], tokens)
  repeats = 1 if smoke else 5
  params, x, cotangent = _inputs(bf16, tokens)
  time = lambda fn, *args: median_seconds(jax.jit(fn), *args, repeats=repeats) * 1e3
  for backend in ("xla", "pallas", "fused"):
    row = dict(shape=shape_name, tokens=tokens, path=f"fp8_deepseek {backend}")
    try:
      for name, config in (
        ("bf16", dataclasses.replace(bf16, expert_backend=backend)),
        ("fp8", dataclasses.replace(bf16, expert_backend=backend, compute_quant="fp8_deepseek")),
      ):
        layer = lambda p, x, config=config: moe_apply(p, x, config=config)[0]
        jax.clear_caches()  # the other config's program has the same signature
        row[f"{name}_layer_ms"] = time(layer, params, x)
        row[f"{name}_train_ms"] = time(forward_backward(layer), params, x, cotangent)
      row["speedup"] = row["bf16_layer_ms"] / row["fp8_layer_ms"]
      row["train_speedup"] = row["bf16_train_ms"] / row["fp8_train_ms"]
    except Exception as error:  # a path that fails here is a result, with its reason
      row["error"] = f"{type(error).__name__}: {error}"[:300]
    record(row)


def _expert_path(config: MoEConfig, plan: ExpertPlan, x, ids, weights, params):
  experts = ExpertWeights(params.w_gate_up, params.w_down)
  return routed_mlp(x, ids, weights, experts, config=config, plan=plan)


def run(smoke: bool, record: Callable[[dict], None]) -> None:
  """Every shape and token count (the smoke run's one on a CPU), DeepSeek-V3's first."""
  shapes = SMOKE_SHAPES if smoke else dict(reversed(SHAPES.items()))
  for shape_name in shapes:
    for tokens in SMOKE_TOKENS if smoke else TOKENS:
      measure(shape_name, tokens, smoke, record)
  for shape_name in FP8_SMOKE_SHAPES if smoke else ("DeepSeek-V3 shard",):
    measure_fp8(shape_name, SMOKE_TOKENS[0] if smoke else TOKENS[0], smoke, record)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a tiny shape (CPU)")
  args = parser.parse_args()
  run(args.smoke, lambda row: print(json.dumps(row), flush=True))


if __name__ == "__main__":
  main()
