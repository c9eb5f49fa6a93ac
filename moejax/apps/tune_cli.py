"""`python -m moejax tune`: `moejax.tune` for a layer of flags, a preset or a checkpoint, on
this machine's devices; prints what it measured and where it wrote it."""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from moejax import hf, tuning
from moejax.apps.cli_setup import from_flags, layer_mesh, moe_config
from moejax.apps.fit import model_json
from moejax.config import MoEConfig
from moejax.tuner import call_sizes, tune


def layer_config(args: argparse.Namespace) -> MoEConfig:
  """The layer to tune: a preset's or checkpoint's MoE layer (bf16, experts in the released
  format), else the layer flags'."""
  if args.model or args.config:
    try:
      _, config_json = model_json(args.model or args.config)
    except ValueError as error:
      raise SystemExit(f"moejax tune: {error}") from None
    return from_flags(
      args, hf.config_from_hf, config=config_json, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
  return moe_config(args, dtype=getattr(jnp, args.dtype), param_dtype=getattr(jnp, args.dtype))


def run(args: argparse.Namespace, mesh_shape: tuple[int, int]) -> tuning.TuningFile:
  config = layer_config(args)
  mesh = None if mesh_shape == (1, 1) else layer_mesh(args, mesh_shape, config)
  try:
    table = tune(
      config,
      mesh=mesh,
      tokens_per_device=args.tokens_per_device,
      repeats=args.repeats,
      forward_only=args.forward_only,
      timeout_s=args.timeout,
      overwrite=args.overwrite,
    )
  except (FileExistsError, tuning.TuningFileError, OSError) as error:
    raise SystemExit(f"moejax tune: {error}") from None
  print(
    f"moejax tune on {table.device_kind}: E={config.num_experts}, K={config.top_k}, "
    f"D={config.hidden_size}, F={config.intermediate_size}, {jnp.dtype(config.dtype).name}"
  )
  objective = "forward+backward" if not args.forward_only else "forward"
  print(
    f"{'rows':>7}  {'candidate':<16} {'status':<9} {'error':>9} {'grad error':>10} {'fwd ms':>9} "
    f"{'fwd+bwd ms':>11}"
  )
  measured = len(call_sizes(config, mesh, args.tokens_per_device))
  for entry in table.entries[-measured:]:
    for c in entry.candidates:
      mark = "  <- fastest " + objective if c.name == entry.winner else ""
      error = "" if c.error is None else f"{c.error:.1e}"  # as the file stores them
      grad_error = "" if c.grad_error is None else f"{c.grad_error:.1e}"
      fwd = "" if c.forward_ms is None else f"{c.forward_ms:.3f}"
      train = "" if c.train_ms is None else f"{c.train_ms:.3f}"
      print(
        f"{entry.rows:>7}  {c.name:<16} {c.status:<9} {error:>9} {grad_error:>10} {fwd:>9} "
        f"{train:>11}{mark}"
      )
  print(f"wrote {tuning.user_file(table.device_kind)}: expert_backend='auto' now follows it")
  return table
