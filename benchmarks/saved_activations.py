"""What the layer's gradient keeps between its forward and backward passes: the bytes its
pullback holds beyond the weights, per token, at DeepSeek-V3's expert shard (32 local experts,
K = 8, D = 7168, F = 2048; 4096 bf16 tokens).

  python benchmarks/saved_activations.py [--against REV] [--out results]

Rows: the layer on one device with bf16 experts on the tile loop ("xla") and on the kernels
("pallas"), the same with compute_quant="fp8_deepseek", and bf16 on a 2x4 (data, expert) mesh
of simulated CPU devices (all_to_all; the tokens over all 8 devices, the experts over 4). Each
gives the kept bytes per token and that over the token's own bf16 bytes (2 D): 1.0 is one
copy of the tokens. Nothing is computed: the pullback's arrays are traced
(`jax.eval_shape`), so the figures are exact and the same on any machine.

The chunk loop recomputes every chunk in the backward pass from its inputs
(`moejax.chunking`), so no expert's activations are kept, with or without fp8. With
`--against REV` the same rows come from the commit REV (a `git worktree` of it) beside this
checkout, with the ratio (this checkout / REV). Rows go to `OUT/saved_activations.json`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import collections
import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
from commits import compare_main

from moejax import MoEConfig, moe_apply
from moejax.testing import random_params

CONFIG = MoEConfig(
  num_experts=32, top_k=8, hidden_size=7168, intermediate_size=2048, chunk_size=1024,
  dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
)  # fmt: skip
TOKENS = 4096
ROWS = {
  "bf16 xla": dict(expert_backend="xla"),
  "bf16 pallas": dict(expert_backend="pallas"),
  "fp8_deepseek xla": dict(expert_backend="xla", compute_quant="fp8_deepseek"),
  "fp8_deepseek pallas": dict(expert_backend="pallas", compute_quant="fp8_deepseek"),
  "bf16 2x4 mesh": dict(num_experts=128, dispatch="all_to_all"),  # 32 local experts
}


def kept_bytes_per_token(config: MoEConfig, mesh: jax.sharding.Mesh | None) -> float:
  """Bytes of the layer's pullback arrays, less one of each weight's, per token."""
  params = jax.eval_shape(lambda: random_params(config, jax.random.key(0)))
  x = jax.ShapeDtypeStruct((TOKENS, config.hidden_size), config.dtype)
  layer = lambda params, x: moe_apply(params, x, config=config, mesh=mesh)[0]
  with warnings.catch_warnings():  # an interpreted kernel's warning (a CPU)
    warnings.simplefilter("ignore")
    pullback = jax.eval_shape(lambda params, x: jax.vjp(layer, params, x)[1], params, x)
  kind = lambda a: (a.shape, str(a.dtype))
  kept = collections.Counter(kind(a) for a in jax.tree.leaves(pullback))
  kept -= collections.Counter(kind(a) for a in jax.tree.leaves(params))
  size = lambda shape, dtype: jnp.dtype(dtype).itemsize * math.prod(shape)
  return sum(size(*k) * n for k, n in kept.items()) / TOKENS


def measure() -> dict[str, float]:
  """Each row's kept bytes per token, and that over 2 D (rows "... / tokens")."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rows = {}
  for name, fields in ROWS.items():
    config = dataclasses.replace(CONFIG, **fields)
    kept = kept_bytes_per_token(config, mesh if "mesh" in name else None)
    rows[f"{name} B/token"] = kept
    rows[f"{name} / tokens"] = kept / (2 * config.hidden_size)
  return rows


def main() -> None:
  compare_main("saved_activations.py", measure, __doc__.split("\n")[0], ".2f")


if __name__ == "__main__":
  main()
