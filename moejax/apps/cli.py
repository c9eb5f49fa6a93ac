"""Command line: `python -m moejax demo|train|fit|tune|bench [flags]`.

The simulated CPU device count must be set before JAX starts its backends: this module parses
the flags first, sets the devices, then runs the command.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import runpy
import sys
from pathlib import Path


def chunk_size(value: str) -> int | str:
  """The --chunk-size flag: "auto" or a positive int."""
  if value == "auto":
    return value
  if not value.isdigit() or int(value) < 1:
    raise argparse.ArgumentTypeError(f'must be "auto" or a positive int, got {value!r}')
  return int(value)


def positive_int(value: str) -> int:
  """A flag that counts something: a positive int."""
  if not value.isdigit() or int(value) < 1:
    raise argparse.ArgumentTypeError(f"must be a positive int, got {value!r}")
  return int(value)


def positive_float(value: str) -> float:
  """A rate: a finite float > 0."""
  try:
    number = float(value)
  except ValueError:
    number = math.nan
  if not math.isfinite(number) or number <= 0:
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
  return number


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Every flag's help ends with its default (none for switches and flags without one)."""

  def _get_help_string(self, action: argparse.Action) -> str:
    if action.default in (None, False, argparse.SUPPRESS):
      return action.help or ""
    return super()._get_help_string(action)


def _layer_flags(flags: argparse.ArgumentParser, *, experts: int, hidden: int, intermediate: int):
  """The layer's size flags, with a command's defaults (`cli_setup.moe_config` reads them)."""
  flags.add_argument("--experts", type=positive_int, default=experts, help="E, routed experts")
  flags.add_argument("--top-k", type=positive_int, default=2, help="K, experts per token")
  flags.add_argument("--hidden", type=positive_int, default=hidden, help="D, the model width")
  flags.add_argument(
    "--intermediate", type=positive_int, default=intermediate, help="F, each expert's hidden width"
  )


def _fp8_flags(flags: argparse.ArgumentParser) -> None:
  """--compute-quant and --dispatch-quant: `MoEConfig`'s compute_quant and dispatch_quant."""
  from moejax.compute_quant import RECIPES

  flags.add_argument(
    "--compute-quant",
    choices=RECIPES,
    default=None,
    help="quantize the expert matmuls' operands to fp8 on the fly, from the float weights "
    "(compute_quant); default: unquantized",
  )
  flags.add_argument(
    "--dispatch-quant",
    choices=["fp8"],
    default=None,
    help="send the dispatched rows over the expert axis as fp8 with 1x128 scales "
    "(dispatch_quant); default: in the compute dtype",
  )


def parser() -> argparse.ArgumentParser:
  """The command line's parser: its commands and their flags (`bench`'s are the suite's)."""
  # The choices come from the tables that define them. Importing JAX starts no backend: the
  # device count set after parsing still applies.
  from kernels_pallas.formats import FORMATS
  from kernels_pallas.gpus import GPUS
  from moejax.apps.fit import JOBS, PRESETS
  from moejax.config import BACKENDS, DISPATCHES
  from moejax.remat import REMAT_POLICIES

  parser = argparse.ArgumentParser(prog="python -m moejax", description=__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  command = functools.partial(commands.add_parser, formatter_class=_HelpFormatter)
  demo_flags = command("demo", help="run the layer on uneven per-rank token counts")
  _layer_flags(demo_flags, experts=16, hidden=128, intermediate=256)
  demo_flags.add_argument(
    "--tokens-per-rank", type=positive_int, default=96, help="buffer rows per device"
  )
  demo_flags.add_argument(
    "--chunk-size", type=chunk_size, default=16, help='C, rows per chunk per device, or "auto"'
  )
  demo_flags.add_argument(
    "--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype"
  )
  train_flags = command("train", help="train a small MoE transformer, checkpoint it")
  train_flags.add_argument("--steps", type=positive_int, default=60, help="optimizer steps")
  train_flags.add_argument("--batch-size", type=positive_int, default=32, help="sequences")
  train_flags.add_argument("--seq-len", type=positive_int, default=16, help="tokens a sequence")
  train_flags.add_argument("--vocab", type=positive_int, default=64, help="vocabulary size")
  train_flags.add_argument("--layers", type=positive_int, default=2, help="transformer blocks")
  train_flags.add_argument("--heads", type=positive_int, default=2, help="attention heads")
  train_flags.add_argument(
    "--moe-every", type=int, default=1, choices=[1, 2], help="an MoE block every N blocks"
  )
  train_flags.add_argument(
    "--scan-layers", action="store_true", help="build the blocks as one stack, apply it by scan"
  )
  train_flags.add_argument(
    "--remat",
    default="none",
    choices=list(REMAT_POLICIES),
    help="rematerialize each block: recompute everything, or save moejax.CHECKPOINT_NAMES",
  )
  _layer_flags(train_flags, experts=8, hidden=32, intermediate=64)
  train_flags.add_argument(
    "--chunk-size", type=chunk_size, default="auto", help='C, rows per chunk per device, or "auto"'
  )
  train_flags.add_argument(
    "--backend", default="auto", choices=BACKENDS, help="the experts' backend (expert_backend)"
  )
  train_flags.add_argument("--learning-rate", type=positive_float, default=3e-3, help="Adam's")
  train_flags.add_argument(
    "--bias-update-rate",
    type=positive_float,
    default=None,
    help="balance the experts without an aux loss: each layer gets a selection bias that "
    "moves this much per step toward the mean load (DeepSeek-V3's rule; e.g. 1e-3); "
    "default: no selection bias",
  )
  train_flags.add_argument(
    "--lora-rank",
    type=int,
    default=0,
    help="train LoRA adapters of this rank on the experts only (0: every weight)",
  )
  train_flags.add_argument(
    "--expert-quant",
    choices=sorted(FORMATS),
    default=None,
    help="quantized, frozen experts (e.g. under LoRA adapters), in the format's own block; "
    "default float",
  )
  _fp8_flags(train_flags)
  train_flags.add_argument(
    "--checkpoint", default="checkpoints/moe_transformer", help="the checkpoint folder"
  )
  existing = train_flags.add_mutually_exclusive_group()
  existing.add_argument(
    "--resume", action="store_true", help="continue from the checkpoint in --checkpoint"
  )
  existing.add_argument(
    "--overwrite",
    action="store_true",
    help="start over, replacing the checkpoint in --checkpoint (without either flag an "
    "existing checkpoint is an error)",
  )
  for flags in (demo_flags, train_flags):
    flags.add_argument("--mesh", default="2x4", help="DATAxEXPERT mesh shape")
    flags.add_argument("--seed", type=int, default=0, help="of the weights and the data")
    flags.add_argument(
      "--platform", default="cpu", help="'cpu' simulates the mesh's devices; else as is"
    )
  fit_flags = command(
    "fit",
    help="will an MoE model fit on GPU nodes: its MoE stack compiled for them, no GPU needed",
  )
  model = fit_flags.add_mutually_exclusive_group(required=True)
  model.add_argument("--model", choices=sorted(PRESETS), help="a preset (moejax.fit.PRESETS)")
  model.add_argument("--config", help="a checkpoint folder or its config.json")
  fit_flags.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="the GPU kind")
  fit_flags.add_argument("--nodes", type=positive_int, default=1, help="GPU nodes")
  fit_flags.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs a node")
  fit_flags.add_argument("--job", default="infer", choices=JOBS, help="what the GPUs run")
  fit_flags.add_argument(
    "--expert-quant",
    default="released",
    choices=["released", "none", *sorted(FORMATS)],
    help='"released": the checkpoint\'s format; "none": bf16; or a format',
  )
  fit_flags.add_argument(
    "--lora-rank", type=positive_int, default=16, help="the adapters' rank (job lora)"
  )
  _fp8_flags(fit_flags)
  fit_flags.add_argument(
    "--backend",
    default="auto",
    choices=BACKENDS,
    help="the experts' backend (expert_backend): auto takes XLA on a GPU without a tuning "
    "entry; fused compiles the fused path's kernels",
  )
  fit_flags.add_argument(
    "--tokens-per-device", type=positive_int, default=4096, help="tokens each device holds"
  )
  fit_flags.add_argument(
    "--expert-parallel",
    type=positive_int,
    default=None,
    help="S, devices of the expert axis (default: the most that divide both the devices and "
    "the experts); the data axis takes the rest",
  )
  fit_flags.add_argument(
    "--expert-fsdp", action="store_true", help="split expert weights over the data axis too"
  )
  fit_flags.add_argument(
    "--shared-fsdp",
    action="store_true",
    help="split the router's and shared experts' matrices over every device",
  )
  fit_flags.add_argument(
    "--dispatch", default="auto", choices=DISPATCHES, help="the exchange scheme"
  )
  fit_flags.add_argument(
    "--receive-capacity-factor",
    type=float,
    default=None,
    help="all_to_all's receive buffers at this factor of the balanced load (MoEConfig's)",
  )
  fit_flags.add_argument(
    "--chunk-size", type=chunk_size, default="auto", help='C, rows per chunk per device, or "auto"'
  )
  fit_flags.add_argument(
    "--remat", default="none", choices=list(REMAT_POLICIES), help="as train's --remat"
  )
  fit_flags.add_argument(
    "--context-tokens",
    type=positive_int,
    default=None,
    help="job infer: tokens of context each device's KV cache holds (default: --tokens-per-device)",
  )
  fit_flags.add_argument(
    "--find",
    action="store_true",
    help="search the fewest nodes (up to --max-nodes) on which the job fits, trying expert "
    "parallelism, --expert-fsdp, --shared-fsdp, all_to_all and --remat full in place of "
    "those flags and "
    "--nodes; prints each plan tried and the command of the one found",
  )
  fit_flags.add_argument(
    "--max-nodes", type=positive_int, default=32, help="the most nodes --find tries"
  )
  fit_flags.add_argument("--json", action="store_true", help="print the report as JSON")
  tune_flags = command(
    "tune",
    help="measure the layer's expert paths on this machine's devices; `auto` then follows",
  )
  source = tune_flags.add_mutually_exclusive_group()
  source.add_argument("--model", choices=sorted(PRESETS), help="a preset's MoE layer")
  source.add_argument("--config", help="a checkpoint folder or its config.json")
  _layer_flags(tune_flags, experts=16, hidden=128, intermediate=256)
  tune_flags.add_argument(
    "--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="of the layer flags'"
  )
  tune_flags.add_argument("--mesh", default="1x1", help="DATAxEXPERT mesh shape")
  tune_flags.add_argument(
    "--tokens-per-device", type=positive_int, default=4096, help="a full-size call's"
  )
  tune_flags.add_argument("--repeats", type=positive_int, default=5, help="timed calls each")
  tune_flags.add_argument(
    "--forward-only", action="store_true", help="choose by forward time (inference)"
  )
  tune_flags.add_argument(
    "--timeout", type=positive_float, default=300.0, help="seconds a candidate's first call"
  )
  tune_flags.add_argument(
    "--overwrite", action="store_true", help="replace the file's entries for the same cases"
  )
  tune_flags.add_argument(
    "--platform", default="auto", help="'cpu' simulates the mesh's devices; else as is"
  )
  tune_flags.set_defaults(chunk_size="auto")  # the tuner sets each call's
  commands.add_parser(  # no help flag of its own: `bench --help` reaches the suite's
    "bench",
    help="the benchmark suite (benchmarks/suite.py); its flags: bench --help",
    add_help=False,
  )
  return parser


def parse_mesh(text: str, command: str) -> tuple[int, int]:
  """'2x4' -> (2, 4); anything else exits naming `command`'s --mesh."""
  try:
    data, expert = (int(part) for part in text.lower().split("x"))
  except ValueError:
    raise SystemExit(
      f"moejax {command}: --mesh must look like DATAxEXPERT, e.g. 2x4; got {text!r}"
    ) from None
  if data < 1 or expert < 1:
    raise SystemExit(f"moejax {command}: --mesh sizes must be positive, got {text!r}")
  return data, expert


def simulate_cpu_devices(count: int) -> None:
  """Makes JAX see `count` CPU devices; only effective before JAX is imported."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
  ).strip()


def run_bench(bench_args: list[str]) -> None:
  """Runs benchmarks/suite.py from the source tree (benchmarks are not installed)."""
  suite = Path(__file__).resolve().parents[2] / "benchmarks" / "suite.py"
  if not suite.exists():
    raise SystemExit(f"{suite} not found: run from a source checkout (pip install -e .)")
  simulate_cpu_devices(8)
  sys.argv = [str(suite), *bench_args]
  runpy.run_path(str(suite), run_name="__main__")


# Flags a command would ignore, by command: (when, the flags, why), each flag its dest.
IGNORED_FLAGS = {
  "tune": (
    (
      lambda a: a.model or a.config,
      ("experts", "top_k", "hidden", "intermediate", "dtype"),
      "--model or --config gives the layer",
    ),
  ),
  "fit": (
    (
      lambda a: a.find,
      ("nodes", "expert_parallel", "expert_fsdp", "shared_fsdp", "dispatch", "remat",
       "receive_capacity_factor", "context_tokens"),
      "--find chooses the plans it tries",
    ),
    (lambda a: not a.find, ("max_nodes",), "it bounds --find's search"),
    (lambda a: a.job != "infer", ("context_tokens",), "only --job infer holds a KV cache"),
    (lambda a: a.job != "lora", ("lora_rank",), "only --job lora trains adapters"),
  ),
}  # fmt: skip


def refuse_ignored_flags(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
  """Exits naming the flags given (not at their `defaults`) that the command would ignore."""
  for applies, names, why in IGNORED_FLAGS.get(args.command, ()):
    given = [name for name in names if getattr(args, name) != getattr(defaults, name)]
    if given and applies(args):
      named = ", ".join(f"--{name.replace('_', '-')}" for name in given)
      raise SystemExit(f"moejax {args.command}: {named} would be ignored: {why}")


def _required_flags(args: argparse.Namespace) -> list[str]:
  """The command and the flags it requires, as given: what its defaults parse from."""
  if args.command == "fit":  # one of --model or --config
    return ["fit", "--model", args.model] if args.model else ["fit", "--config", args.config]
  return [args.command]


def main(argv: list[str] | None = None) -> None:
  flags = parser()
  args, rest = flags.parse_known_args(argv)
  if args.command == "bench":
    run_bench(rest)  # the suite parses its own flags
    return
  if rest:
    flags.error(f"unrecognized arguments: {' '.join(rest)}")
  if args.command in IGNORED_FLAGS:
    defaults = flags.parse_args(_required_flags(args))
    refuse_ignored_flags(args, defaults)
  if args.command == "fit":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs; nothing runs
    from moejax.apps import fit_cli

    fit_cli.run(args)
    return
  data, expert = parse_mesh(args.mesh, args.command)
  if args.platform == "cpu":
    simulate_cpu_devices(data * expert)
  # Imported here: JAX must load after XLA_FLAGS is set.
  if args.command == "tune":
    from moejax.apps import tune_cli

    tune_cli.run(args, mesh_shape=(data, expert))
  elif args.command == "train":
    from moejax.apps import train

    train.run(args, mesh_shape=(data, expert))
  else:
    from moejax.apps import demo

    demo.run(args, mesh_shape=(data, expert))
