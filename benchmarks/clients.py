"""The clients' own MoE code beside moejax's drop-ins, on the same work, in one process: forward
and forward+backward times and their ratios (moejax / the client's; below 1: moejax faster).

- Levanter grug: `grug_moe.moe_mlp(..., implementation="scatter")` (its local backend) vs
  `moejax.integrations.levanter.moe_mlp`, on [T, D] tokens with the same routing and weights;
- tunix Qwen3: its `MoELayer(use_megablox=False)` (the dense path it runs off TPU) vs
  `moejax.integrations.tunix.MoELayer`, both from one seed, on [B, T, D];
- MaxText: its `RoutedMoE` on its fastest path here (`sparse_matmul=True, megablox=False`:
  `jax.lax.ragged_dot`; the dense one is slower) vs `on_moejax(RoutedMoE)`, both from one seed,
  on [B, T, D] (maxtext needs Python >= 3.12).

One device, float32, the best of `--repeats` device-synchronised calls after a compile call.
A client that is not installed is a row saying so (they are test dependencies, `.ci/run`'s
CLIENT_TESTS).

  python benchmarks/clients.py [--tokens 2048] [--smoke] [--out results]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kernels_pallas.autotune import time_call  # noqa: E402
from moejax import files  # noqa: E402
from moejax.integrations import levanter, tunix  # noqa: E402
from tests.peers import flax_as_tunix_runs, grug_modules, maxtext_pair, tunix_qwen3  # noqa: E402

E, K, D, F = 16, 2, 256, 512  # experts, top k, model width, expert width


def _forward_backward(fn: Callable, *args):
  """A function of `args` returning fn's output and its pullback of a fixed cotangent."""
  cotangent = jax.random.normal(jax.random.key(9), jax.eval_shape(fn, *args).shape)

  def run(*args):
    out, pullback = jax.vjp(fn, *args)
    return out, pullback(cotangent)

  return run


def _times(name: str, theirs: Callable, ours: Callable, args: tuple, repeats: int) -> dict:
  """Forward and forward+backward of both on `args`, and moejax's over the client's."""
  row = dict(client=name)
  for label, wrap in (("forward", lambda f: f), ("train", lambda f: _forward_backward(f, *args))):
    for who, fn in (("client", theirs), ("moejax", ours)):
      call = jax.jit(wrap(fn))
      row[f"{who}_{label}_ms"] = 1e3 * time_call(lambda call=call: call(*args), repeats)
    row[f"{label}_ratio"] = row[f"moejax_{label}_ms"] / row[f"client_{label}_ms"]
  return row


def grug_row(tokens: int, repeats: int) -> dict:
  grug_moe, activation = grug_modules()
  if grug_moe is None:
    return dict(client="levanter grug scatter", skipped="marin-levanter is not installed")
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (tokens, D))
  weights, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(keys[1], (tokens, E))), K)
  w_up_gate = jax.random.normal(keys[2], (E, D, 2 * F)) / D**0.5
  w_down = jax.random.normal(keys[3], (E, F, D)) / F**0.5
  theirs = lambda x, w, wug, wd: grug_moe.moe_mlp(
    x, ids, w, wug, wd, activation=activation.silu, implementation="scatter"
  )
  ours = lambda x, w, wug, wd: levanter.moe_mlp(x, ids, w, wug, wd, activation="silu")
  with jax.numpy_rank_promotion("allow"):  # grug's code broadcasts implicitly
    return _times("levanter grug scatter", theirs, ours, (x, weights, w_up_gate, w_down), repeats)


def tunix_row(tokens: int, repeats: int) -> dict:
  qwen3 = tunix_qwen3()
  if qwen3 is None:
    return dict(client="tunix qwen3 dense", skipped="google-tunix is not installed")
  config = qwen3.ModelConfig(
    num_layers=1, vocab_size=32, embed_dim=D, hidden_dim=F, num_heads=2, head_dim=8,
    num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6, num_experts=E, num_experts_per_tok=K,
  )  # fmt: skip
  with flax_as_tunix_runs():
    layers = {
      who: nnx.split(make(config, rngs=nnx.Rngs(0)))
      for who, make in (("client", qwen3.MoELayer), ("moejax", tunix.MoELayer))
    }
  x = jax.random.normal(jax.random.key(1), (tokens // 256, 256, D))

  def apply(who: str, **kwargs) -> Callable:
    graph, _ = layers[who]
    return lambda params, x: nnx.merge(graph, params)(x, **kwargs)

  params = layers["client"][1]
  theirs, ours = apply("client", use_megablox=False), apply("moejax")
  return _times("tunix qwen3 dense", theirs, ours, (params, x), repeats)


def maxtext_row(tokens: int, repeats: int) -> dict:
  name = "maxtext routedmoe ragged_dot"
  with jax.numpy_rank_promotion("allow"):  # MaxText's routing broadcasts
    layers = maxtext_pair((E, K, D, F), sparse_matmul=True, megablox=False)
    if layers is None:
      return dict(client=name, skipped="maxtext is not installed (it needs Python >= 3.12)")
    x = jax.random.normal(jax.random.key(1), (tokens // 256, 256, D))

    def apply(layer) -> Callable:
      graph, _, rest = nnx.split(layer, nnx.Param, ...)  # rest: its random streams
      return lambda params, x: nnx.merge(graph, params, rest)(x)[0]

    params = nnx.state(layers[0], nnx.Param)  # one seed: the same in both
    return _times(name, *map(apply, layers), (params, x), repeats)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=2048)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--smoke", action="store_true", help="256 tokens, one repeat")
  parser.add_argument("--out", default="results", help="folder for clients.json")
  parser.add_argument("--overwrite", action="store_true", help="replace earlier results in --out")
  args = parser.parse_args()
  out = Path(args.out) / "clients.json"
  if not args.overwrite:
    files.refuse_existing([out], how="pass --overwrite")
  tokens, repeats = (256, 1) if args.smoke else (args.tokens, args.repeats)
  print(f"E={E} K={K} D={D} F={F}, {tokens} tokens, float32, {jax.devices()[0].device_kind}")
  with warnings.catch_warnings():  # the clients' own deprecated calls
    warnings.simplefilter("ignore", DeprecationWarning)
    rows = [grug_row(tokens, repeats), tunix_row(tokens, repeats), maxtext_row(tokens, repeats)]
  for row in rows:
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
  files.write_atomically(out, json.dumps(rows, indent=1), overwrite=True)


if __name__ == "__main__":
  main()
