"""Command line: `python -m moejax demo [flags]`.

The simulated CPU device count must be set before JAX is imported, so this module parses the
flags first and imports the JAX-using commands afterwards.
"""

from __future__ import annotations

import argparse
import os


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m moejax", description=__doc__)
  commands = parser.add_subparsers(dest="command", required=True)
  demo = commands.add_parser("demo", help="run the layer on uneven per-rank token counts")
  demo.add_argument("--mesh", default="2x4", help="DATAxEXPERT mesh shape (default 2x4)")
  demo.add_argument("--experts", type=int, default=16, help="E (default 16)")
  demo.add_argument("--top-k", type=int, default=2, help="K (default 2)")
  demo.add_argument("--hidden", type=int, default=128, help="D (default 128)")
  demo.add_argument("--intermediate", type=int, default=256, help="F (default 256)")
  demo.add_argument("--tokens-per-rank", type=int, default=96, help="buffer rows per device")
  demo.add_argument("--chunk-size", type=int, default=32, help="C (default 32)")
  demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  demo.add_argument("--seed", type=int, default=0)
  demo.add_argument(
    "--platform", default="cpu", help="'cpu' simulates the mesh's devices (default); else as is"
  )
  return parser


def parse_mesh(text: str) -> tuple[int, int]:
  """'2x4' -> (2, 4)."""
  try:
    data, expert = (int(part) for part in text.lower().split("x"))
  except ValueError:
    raise SystemExit(f"--mesh must look like DATAxEXPERT, e.g. 2x4; got {text!r}") from None
  if data < 1 or expert < 1:
    raise SystemExit(f"--mesh sizes must be positive, got {text!r}")
  return data, expert


def main(argv: list[str] | None = None) -> None:
  args = _parser().parse_args(argv)
  data, expert = parse_mesh(args.mesh)
  if args.platform == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={data * expert}"
    ).strip()
  from moejax import demo

  demo.run(args, mesh_shape=(data, expert))


if __name__ == "__main__":
  main()
