"""What each dispatch scheme sends, and what the all-to-all packing costs on a CPU.

  python benchmarks/dispatch.py [--sections hlo,scaling,time] [--tokens 4096] [--out results]
  python benchmarks/dispatch.py --sections timing   # on a multi-GPU machine

Sections (each prints a table; rows go to `OUT/dispatch.json`, the scaling plot to
`OUT/dispatch_scaling.png`):
  hlo      the collective buffers of one chunk, read off the compiled CPU program (all_gather
           vs the all_to_all drop-in) and off the program lowered for CUDA (ragged_all_to_all),
           expert axis 2, 4, 8. Static buffer sizes: what the ragged op really sends depends on
           the routing, which the scaling section measures.
  fp8      the outbound all-gathers of one chunk in bf16, with and without dispatch_quant="fp8"
           (rows as fp8 values and 1x128 float32 scales), off the program lowered for CUDA
  scaling  bytes sent per token per layer vs expert-axis size for Mixtral-8x7B and DeepSeek-V3,
           balanced and skewed routers: the layer's own routing (`moejax.routing.route`) and
           packing (`moejax.dispatch.pack_pairs`) on synthetic logits, against the physical floor
           (one copy of a token per distinct remote device holding one of its experts, counted
           in NumPy). Rows of D bf16 values, out and back; the K ids and weights that travel
           with each row (8K bytes) are left out of all three.
  time     CPU time of both schemes on the 2x4 mesh. XLA:CPU has no ragged all-to-all, so
           both move the same static buffers: the ratio is the packing overhead.
  timing   for the first multi-GPU machine: forward and forward+backward time of both schemes
           with every device on the expert axis, T per device 256 ... 16384, bf16, a
           DeepSeek-V2-Lite-sized layer (E=64, K=6, D=2048, F=1408). Its rows are what
           `moejax.dispatch.ALL_TO_ALL_FASTER_FROM_AXIS` must be based on before "auto"
           picks all_to_all.

Needs 8 simulated devices for `hlo` and `time`: run as a script (it sets them) or with
XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from suite import best_time, sections_of  # benchmarks/suite.py, beside this script

from moejax import MoEConfig, dispatch, files, moe_apply, routing
from moejax.testing import random_params

BF16_BYTES = 2
SCALING_AXES = (8, 16, 32, 64, 128, 256)
MODELS = {
  "Mixtral-8x7B": MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
  "DeepSeek-V3": MoEConfig(
    num_experts=256,
    top_k=8,
    hidden_size=7168,
    intermediate_size=2048,
    scoring="sigmoid",
    renormalize=True,
    num_expert_groups=8,
    topk_groups=4,
    routed_scaling_factor=2.5,
  ),
}
# The targets: all_to_all bytes as a fraction of all_gather's.
TARGETS = {("Mixtral-8x7B", 8): 0.3, ("DeepSeek-V3", 64): 0.15}


def mesh_of(data: int, expert: int) -> Mesh:
  return Mesh(np.array(jax.devices()[: data * expert]).reshape(data, expert), ("data", "expert"))


# ---- hlo ------------------------------------------------------------------------------------

_ITEMSIZE = {"f32": 4, "s32": 4, "bf16": 2, "pred": 1, "i32": 4, "f8e4m3fn": 1}
_HLO_COLLECTIVE = re.compile(r"= (\(?[^=]*?) (all-gather|reduce-scatter|all-to-all)(?:-start)?\(")
_HLO_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_RAGGED_OPERAND = re.compile(r"custom_call @ragged_all_to_all\(.*? : \(tensor<([\dx]+)x(\w+)>")


# Of a collective's result, the part one device sends over the axis of S devices: all-gather
# and all-to-all keep 1/S locally; reduce-scatter's result is 1/S of what each device sends.
_SENT_FRACTION = {
  "all-gather": lambda s: (s - 1) / s,
  "all-to-all": lambda s: (s - 1) / s,
  "reduce-scatter": lambda s: s - 1,
}


def _bytes(dims: list[int], dtype: str) -> int:
  return math.prod(dims) * _ITEMSIZE.get(dtype, 4)


def chunk_exchange(config: MoEConfig, mesh: Mesh):
  """One chunk through the config's exchange and back (`send`, then `combine`), jitted."""
  axis_size = mesh.shape["expert"]
  scheme = dispatch.scheme_of(config, axis_size)
  exchange = dispatch.make_exchange(config, ("expert",), axis_size, scheme)

  def one_chunk(rows, expert_ids, weights):
    sent = exchange.send(rows, expert_ids, weights)
    # A stand-in for the experts that reads all that arrived (unread buffers would be cut).
    choices = jnp.sum(sent.weights * sent.local_ids, axis=-1, keepdims=True)
    return exchange.combine(sent.rows * choices, sent)

  tokens = P(("data", "expert"))
  return jax.jit(jax.shard_map(one_chunk, mesh=mesh, in_specs=tokens, out_specs=tokens))


_TENSOR = re.compile(r"tensor<([\dx]+)x(\w+)>")
_MLIR_ITEMSIZE = {"bf16": 2, "f32": 4, "i32": 4, "f8E4M3FN": 1}


def _all_gather_bytes(mlir_module: str) -> int:
  """Bytes of the results of a lowered module's `stablehlo.all_gather`s, in the dtypes the
  program sends (XLA:CPU's compiled collectives run in float32 whatever they carry)."""
  return sum(
    math.prod(int(d) for d in dims.split("x")) * _MLIR_ITEMSIZE[dtype]
    for line in mlir_module.splitlines()
    if "stablehlo.all_gather" in line
    for dims, dtype in _TENSOR.findall(line.split("->")[-1])
  )


def fp8_exchange_section(chunk: int = 256) -> list[dict]:
  """The all-gathers of one chunk's outbound exchange in bf16, with and without
  `dispatch_quant="fp8"` (rows as fp8 values and 1x128 scales; ids and weights as before),
  off the program lowered for CUDA."""
  config = MoEConfig(
    num_experts=32, top_k=2, hidden_size=256, intermediate_size=512, dtype=jnp.bfloat16
  )
  rows = []
  for expert_axis in (2, 4, 8):
    mesh = mesh_of(8 // expert_axis, expert_axis)
    args = (
      jnp.zeros((8 * chunk, config.hidden_size), jnp.bfloat16),
      jnp.zeros((8 * chunk, config.top_k), jnp.int32),
      jnp.zeros((8 * chunk, config.top_k)),
    )
    sent = {
      quant: _all_gather_bytes(
        export.export(
          chunk_exchange(dataclasses.replace(config, dispatch_quant=quant), mesh),
          platforms=["cuda"],
        )(*args).mlir_module()
      )
      for quant in (None, "fp8")
    }
    rows.append(
      dict(section="fp8", S=expert_axis, bf16=sent[None], fp8=sent["fp8"],
           ratio=sent["fp8"] / sent[None])
    )  # fmt: skip
  _table(
    f"fp8: one chunk's outbound all-gathers, C={chunk}, D=256, K=2, bf16 rows vs fp8 rows\n"
    "  with their scales (both with the K ids and weights)",
    rows,
    ["S", "bf16", "fp8", "ratio"],
  )
  return rows


def hlo_section(chunk: int = 256) -> list[dict]:
  """Collective buffer bytes of one chunk's exchange, per scheme and expert-axis size."""
  config = MoEConfig(num_experts=32, top_k=2, hidden_size=256, intermediate_size=512)
  rows = []
  for expert_axis in (2, 4, 8):
    mesh = mesh_of(8 // expert_axis, expert_axis)
    args = (
      jnp.zeros((8 * chunk, config.hidden_size)),
      jnp.zeros((8 * chunk, config.top_k), jnp.int32),
      jnp.zeros((8 * chunk, config.top_k)),
    )
    for scheme in ("all_gather", "all_to_all"):
      exchange = chunk_exchange(dataclasses.replace(config, dispatch=scheme), mesh)
      hlo = re.sub(r"/\*.*?\*/", "", exchange.lower(*args).compile().as_text())
      buffers = sent = 0
      for result, kind in _HLO_COLLECTIVE.findall(hlo):  # result: an array or a tuple
        size = sum(
          _bytes([int(d) for d in dims.split(",") if d], dtype)
          for dtype, dims in _HLO_SHAPE.findall(result)
        )
        buffers += size
        sent += size * _SENT_FRACTION[kind](expert_axis)
      rows.append(
        dict(
          section="hlo",
          S=expert_axis,
          scheme=scheme,
          program="XLA:CPU",
          buffers=buffers,
          sent=int(sent),
        )
      )
    # The GPU's program: lowered for CUDA on this host with the ragged op.
    with mock.patch.object(dispatch, "platform_has_ragged_all_to_all", lambda: True):
      exchange = chunk_exchange(dataclasses.replace(config, dispatch="all_to_all"), mesh)
    exported = export.export(
      exchange,
      platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call("ragged_all_to_all")],
    )(*args)
    operands = _RAGGED_OPERAND.findall(exported.mlir_module())
    ragged = sum(_bytes([int(d) for d in dims.split("x")], dtype) for dims, dtype in operands)
    rows.append(
      dict(
        section="hlo",
        S=expert_axis,
        scheme="all_to_all",
        program="CUDA (ragged)",
        buffers=ragged,
        sent=ragged,
      )
    )
  unit = chunk * config.hidden_size * 4
  for row in rows:
    row["sent_rows"] = row["sent"] / unit
  _table(
    f"hlo: one chunk's exchange, out and back, C={chunk}, D=256, K=2, f32.\n"
    "  buffers: the collectives' results (ragged: its send operands); sent: bytes one device\n"
    "  sends (ragged: an upper bound, the real volume is routing's); sent_rows: in C rows of D",
    rows,
    ["S", "scheme", "program", "buffers", "sent", "sent_rows"],
  )
  return rows


# ---- scaling --------------------------------------------------------------------------------


def router_logits(config: MoEConfig, tokens: int, skewed: bool, seed: int) -> jax.Array:
  """[T, E] synthetic logits; skewed: per-expert offsets N(0, 1.5^2) shared by all tokens."""
  key, offsets_key = jax.random.split(jax.random.key(seed))
  logits = jax.random.normal(key, (tokens, config.num_experts))
  if skewed:
    logits = logits + 1.5 * jax.random.normal(offsets_key, (1, config.num_experts))
  return logits


def remote_copies(expert_ids: jax.Array, home: jax.Array, local_experts: int, axis_size: int):
  """Rows the layer's packing sends to a device other than the row's own."""
  packed = dispatch.pack_pairs(expert_ids, local_experts, axis_size)
  filled = packed.pair_row < expert_ids.shape[0]
  source = home[jnp.minimum(packed.pair_row, expert_ids.shape[0] - 1)]
  return int(jnp.sum(filled & (packed.pair_device != source)))


def floor_copies(expert_ids: np.ndarray, home: np.ndarray, local_experts: int) -> int:
  """One copy per distinct remote device per token, counted in NumPy."""
  return sum(
    len(set((ids // local_experts).tolist()) - {int(h)})
    for ids, h in zip(expert_ids, home, strict=True)
  )


def scaling_section(tokens: int) -> list[dict]:
  rows = []
  for name, config in MODELS.items():
    for stats in ("balanced", "skewed"):
      logits = router_logits(config, tokens, stats == "skewed", seed=len(rows))
      route = routing.route(logits, jnp.ones(tokens, bool), config, None)
      ids = np.asarray(route.expert_ids)
      for axis_size in (2, 4, *SCALING_AXES):
        if config.num_experts % axis_size:
          continue
        local_experts = config.num_experts // axis_size
        home = np.arange(tokens) % axis_size  # tokens spread evenly over the expert axis
        row_bytes = 2 * config.hidden_size * BF16_BYTES / tokens  # out and back, per token
        sent = remote_copies(route.expert_ids, jnp.asarray(home), local_experts, axis_size)
        floor = floor_copies(ids, home, local_experts)
        all_gather = (axis_size - 1) * tokens * row_bytes
        rows.append(
          dict(
            section="scaling",
            model=name,
            router=stats,
            S=axis_size,
            all_gather=all_gather,
            all_to_all=sent * row_bytes,
            floor=floor * row_bytes,
            ratio=sent * row_bytes / all_gather if all_gather else float("nan"),
            at_floor=sent == floor,
          )
        )
  _table(
    f"scaling: bytes sent per token per layer (bf16 rows, out and back), T={tokens}",
    rows,
    ["model", "router", "S", "all_gather", "all_to_all", "floor", "ratio", "at_floor"],
  )
  for (model, axis_size), target in TARGETS.items():
    worst = max(r["ratio"] for r in rows if r["model"] == model and r["S"] == axis_size)
    print(f"target {model} S={axis_size}: all_to_all/all_gather {worst:.3f} <= {target}")
  return rows


def plot_scaling(rows: list[dict], path: Path) -> None:
  import matplotlib  # imported here: only the plot needs it

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, model in zip(axes, MODELS, strict=True):
    for router, color in (("balanced", "tab:blue"), ("skewed", "tab:orange")):
      sel = [r for r in rows if r["model"] == model and r["router"] == router]
      sizes = [r["S"] for r in sel]
      ax.plot(
        sizes, [r["all_to_all"] for r in sel], "-o", color=color, label=f"all_to_all, {router}"
      )
      ax.plot(sizes, [r["floor"] for r in sel], ":", color="black", lw=3, alpha=0.4)
    sel = [r for r in rows if r["model"] == model and r["router"] == "balanced"]
    ax.plot(
      [r["S"] for r in sel],
      [r["all_gather"] for r in sel],
      "--s",
      color="tab:red",
      label="all_gather",
    )
    ax.plot([], [], ":", color="black", lw=3, alpha=0.4, label="floor (distinct remote devices)")
    ax.set(xscale="log", yscale="log", title=model, xlabel="expert-axis size S")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("bytes per token per layer")
  axes[1].legend(fontsize=8)
  fig.suptitle("moejax dispatch: bytes sent per token (bf16 rows, out and back)")
  fig.tight_layout()
  with files.atomic_path(path, overwrite=True) as temporary:
    fig.savefig(temporary, dpi=120)


# ---- time -----------------------------------------------------------------------------------


def time_section(repeats: int) -> list[dict]:
  base = MoEConfig(num_experts=32, top_k=2, hidden_size=256, intermediate_size=512, chunk_size=256)
  params = random_params(base, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (8192, 256))
  mesh = mesh_of(2, 4)
  times = {}
  for scheme in ("all_gather", "all_to_all"):
    config = dataclasses.replace(base, dispatch=scheme)
    apply = lambda p, x, c=config: moe_apply(p, x, config=c, mesh=mesh)[0]
    forward = jax.jit(apply)
    backward = jax.jit(jax.grad(lambda p, x, f=apply: jnp.sum(f(p, x) ** 2)))
    times[scheme] = (
      best_time(forward, params, x, repeats=repeats),
      best_time(backward, params, x, repeats=repeats),
    )
  rows = [
    dict(
      section="time",
      pass_=name,
      all_gather_ms=1e3 * times["all_gather"][i],
      all_to_all_ms=1e3 * times["all_to_all"][i],
      ratio=times["all_to_all"][i] / times["all_gather"][i],
    )
    for i, name in enumerate(("forward", "forward+backward"))
  ]
  _table(
    "time: 2x4 mesh, T=8192, E=32, K=2, D=256, F=512, C=256, f32 (XLA:CPU, same bytes)",
    rows,
    ["pass_", "all_gather_ms", "all_to_all_ms", "ratio"],
  )
  return rows


# ---- timing (multi-GPU) ---------------------------------------------------------------------

TIMING_TOKENS_PER_DEVICE = (256, 1024, 4096, 16384)


def timing_section(repeats: int) -> list[dict]:
  """Both schemes timed on every device as the expert axis (the run that
  `ALL_TO_ALL_FASTER_FROM_AXIS` needs)."""
  devices = jax.device_count()
  if devices < 2:
    print(f"\ntiming: needs 2 or more devices, found {devices}; skipped")
    return []
  experts = max(64, devices)
  base = MoEConfig(
    num_experts=experts - experts % devices,
    top_k=6,
    hidden_size=2048,
    intermediate_size=1408,
    chunk_size=1024,
    dtype=jnp.bfloat16,
    param_dtype=jnp.bfloat16,
  )
  params = random_params(base, jax.random.key(0))
  mesh = mesh_of(1, devices)
  rows = []
  for per_device in TIMING_TOKENS_PER_DEVICE:
    x = jax.random.normal(jax.random.key(per_device), (devices * per_device, 2048), jnp.bfloat16)
    row = dict(section="timing", devices=devices, tokens_per_device=per_device)
    for scheme in ("all_gather", "all_to_all"):
      config = dataclasses.replace(base, dispatch=scheme)
      apply = lambda p, x, c=config: moe_apply(p, x, config=c, mesh=mesh)[0]
      loss = lambda p, x, f=apply: jnp.sum(f(p, x).astype(jnp.float32) ** 2)
      row[f"{scheme}_fwd_ms"] = 1e3 * best_time(jax.jit(apply), params, x, repeats=repeats)
      row[f"{scheme}_fwd_bwd_ms"] = 1e3 * best_time(
        jax.jit(jax.grad(loss)), params, x, repeats=repeats
      )
    row["fwd_ratio"] = row["all_to_all_fwd_ms"] / row["all_gather_fwd_ms"]
    row["fwd_bwd_ratio"] = row["all_to_all_fwd_bwd_ms"] / row["all_gather_fwd_bwd_ms"]
    rows.append(row)
  _table(
    f"timing: 1x{devices} mesh, E={base.num_experts}, K=6, D=2048, F=1408, C=1024, bf16 "
    "(ratio < 1: all_to_all faster)",
    rows,
    ["tokens_per_device", "all_gather_fwd_ms", "all_to_all_fwd_ms", "fwd_ratio", "fwd_bwd_ratio"],
  )
  return rows


# ---- output ---------------------------------------------------------------------------------


def _table(title: str, rows: list[dict], columns: list[str]) -> None:
  print(f"\n{title}")
  cells = [[_fmt(r[c]) for c in columns] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
  print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
  for row in cells:
    print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def _fmt(value) -> str:
  return f"{value:.4g}" if isinstance(value, float) else str(value)


SECTIONS = ("hlo", "fp8", "scaling", "time", "timing")


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--sections",
    default="hlo,fp8,scaling,time",
    help=f"comma-separated, of: {','.join(SECTIONS)} ('timing' on multi-GPU)",
  )
  parser.add_argument("--tokens", type=int, default=4096, help="tokens for the scaling section")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="results", help="folder for dispatch.json and the plot")
  parser.add_argument("--overwrite", action="store_true", help="replace earlier results in --out")
  args = parser.parse_args(argv)
  sections = sections_of(parser, args.sections, SECTIONS)
  out = Path(args.out)
  if not args.overwrite:
    files.refuse_existing(
      [out / "dispatch.json", out / "dispatch_scaling.png"], how="pass --overwrite"
    )
  print(f"moejax dispatch benchmark: {jax.devices()[0].device_kind}, JAX {jax.__version__}")
  rows = []
  if "hlo" in sections:
    rows += hlo_section()
  if "fp8" in sections:
    rows += fp8_exchange_section()
  if "scaling" in sections:
    scaling = scaling_section(args.tokens)
    rows += scaling
    plot_scaling(scaling, out / "dispatch_scaling.png")
  if "time" in sections:
    rows += time_section(args.repeats)
  if "timing" in sections:
    rows += timing_section(args.repeats)
  files.write_atomically(out / "dispatch.json", json.dumps(rows, indent=1), overwrite=True)
  print(f"\nwrote {out / 'dispatch.json'}")


if __name__ == "__main__":
  main()
