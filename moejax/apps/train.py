"""Training the `MoETransformer` with optax: loss with the layers' aux losses, a jitted step,
and the `python -m moejax train` loop."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from moejax import balancing
from moejax.apps import checkpoint
from moejax.apps.cli_setup import from_flags, layer_mesh, moe_config
from moejax.apps.models import ClusterTask, MoETransformer, TransformerConfig, shard_model
from moejax.call_record import call_record
from moejax.layer import collect_aux
from moejax.remat import REMAT_POLICIES


@dataclasses.dataclass(frozen=True)
class LossWeights:
  """Weights of the aux losses added to the task loss (Switch uses 1e-2, ST-MoE 1e-3 for z)."""

  load_balancing: float = 1e-2
  router_z: float = 1e-3


def loss_fn(
  model: MoETransformer,
  tokens: jax.Array,
  targets: jax.Array,
  token_mask: jax.Array,
  weights: LossWeights,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Masked next-token cross-entropy plus weighted aux losses summed over MoE layers.

  Args:
    model: the transformer.
    tokens: [B, S] int32.
    targets: [B, S] int32.
    token_mask: [B, S] bool; padding positions count in no loss.
    weights: `LossWeights`.

  Returns:
    (total loss, metrics: task_loss and `summed_aux`'s values).
  """
  total, (metrics, _) = _loss_and_intermediates(model, tokens, targets, token_mask, weights)
  return total, metrics


def _loss_and_intermediates(model, tokens, targets, token_mask, weights):
  """`loss_fn`'s (total, (metrics, the captured `nnx.Intermediate` state))."""
  logits, intermediates = nnx.capture(model, nnx.Intermediate)(tokens, token_mask)
  # Cross-entropy against one-hot targets: elementwise, so it keeps the batch's sharding on
  # explicit-axes meshes (a gather's gradient is a scatter whose layout JAX then asks for).
  one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
  per_token = -jnp.sum(one_hot * jax.nn.log_softmax(logits), axis=-1)  # [B, S]
  valid = token_mask.astype(jnp.float32)
  task = jnp.sum(per_token * valid) / jnp.maximum(jnp.sum(valid), 1.0)
  aux = summed_aux(intermediates)
  total = task + weights.load_balancing * aux["load_balancing_loss"]
  total = total + weights.router_z * aux["router_z_loss"]
  return total, (dict(task_loss=task, **aux), intermediates)


def summed_aux(intermediates: nnx.State) -> dict[str, jax.Array]:
  """The aux losses of every MoE layer call, summed, and their expert counts, one row per
  layer: the same for unrolled layers and for stacks applied with `nnx.scan`.

  Returns:
    {"load_balancing_loss": [], "router_z_loss": [], "expert_counts": [layers, E + Z],
    "load_max_over_mean": [] the largest of the layers'}.
  """
  aux = collect_aux(intermediates)
  total = lambda name: sum((jnp.sum(value) for value in aux[name]), jnp.float32(0))
  counts = [c.reshape(-1, c.shape[-1]) for c in aux["expert_counts"]]
  worst = [jnp.max(value) for value in aux["load_max_over_mean"]]
  return dict(
    load_balancing_loss=total("load_balancing_loss"),
    router_z_loss=total("router_z_loss"),
    expert_counts=jnp.concatenate(counts) if counts else jnp.zeros((0, 0), jnp.int32),
    load_max_over_mean=jnp.max(jnp.stack(worst)) if worst else jnp.float32(0),
  )


@nnx.jit(static_argnames=("weights", "bias_update_rate"))
def train_step(
  model: MoETransformer,
  optimizer: nnx.Optimizer,
  tokens: jax.Array,
  targets: jax.Array,
  token_mask: jax.Array,
  weights: LossWeights = LossWeights(),
  bias_update_rate: float = 0.0,
) -> dict[str, jax.Array]:
  """One optimizer step over the optimizer's variables (`wrt`: the gradient is taken of
  those only, e.g. just the adapters); then, with `bias_update_rate` > 0, every MoE layer's
  selection bias moves toward balance by the step's loads (`moejax.balancing`). Returns the
  loss and `loss_fn`'s metrics."""
  grad_fn = nnx.value_and_grad(
    _loss_and_intermediates, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True
  )
  (loss, (metrics, intermediates)), grads = grad_fn(model, tokens, targets, token_mask, weights)
  optimizer.update(model, grads)
  if bias_update_rate:
    balancing.update_routing_biases(model, intermediates, rate=bias_update_rate)
  return dict(loss=loss, **metrics)


def run(args, mesh_shape: tuple[int, int]) -> list[dict[str, float]]:
  """`python -m moejax train`: trains on `ClusterTask` with a progress bar, then checkpoints.

  `args.checkpoint` is resumed with `args.resume` (it must hold a checkpoint), replaced with
  `args.overwrite`, and otherwise must hold none: a checkpoint is never replaced unasked.
  Returns the per-step metrics (loss, task_loss, aux losses, tokens/s).
  """
  from tqdm import tqdm  # imported here: only the command line shows a progress bar

  resume = resumes(args)
  selection_bias = args.bias_update_rate is not None
  if resume:
    stored_bias = checkpoint.holds(args.checkpoint, "routing_bias")
    if stored_bias and not selection_bias:
      print("the checkpoint's selection bias is kept as it is (no --bias-update-rate: not moved)")
    elif selection_bias and not stored_bias:
      print("the checkpoint holds no selection bias: --bias-update-rate starts one at 0")
    selection_bias = selection_bias or stored_bias
  moe = moe_config(
    args,
    expert_backend=args.backend,
    lora_rank=args.lora_rank,
    expert_quant=args.expert_quant,
    compute_quant=args.compute_quant,
    dispatch_quant=args.dispatch_quant,
    use_routing_bias=selection_bias,
  )
  mesh = layer_mesh(args, mesh_shape, moe)
  task = ClusterTask(vocab_size=args.vocab, seq_len=args.seq_len, seed=args.seed)
  config = from_flags(
    args,
    TransformerConfig,
    vocab_size=args.vocab,
    num_layers=args.layers,
    num_heads=args.heads,
    moe=moe,
    moe_every=args.moe_every,
    scan_layers=args.scan_layers,
    remat_policy=REMAT_POLICIES[args.remat],
  )
  model = MoETransformer(config, mesh=mesh, rngs=nnx.Rngs(args.seed))
  shard_model(model, mesh)
  trained = nnx.LoRAParam if args.lora_rank else nnx.Param  # adapters only, or everything
  optimizer = nnx.Optimizer(model, optax.adam(args.learning_rate), wrt=trained)
  shard_model(optimizer, mesh)  # its step counter too, so a restored one lands on the mesh
  start = 0
  if resume:
    start = _restored(args, model, optimizer)
    print(f"resumed from {args.checkpoint} at step {start}")
  batch_sharding = NamedSharding(mesh, call_record(config.moe).specs.batch_b)
  history = []
  bar = tqdm(range(start, start + args.steps), desc="train", unit="step")
  for step in bar:
    batch = [jax.device_put(a, batch_sharding) for a in task.batch(args.batch_size, step)]
    began = time.perf_counter()
    metrics = jax.device_get(
      train_step(model, optimizer, *batch, bias_update_rate=args.bias_update_rate or 0.0)
    )
    tokens_per_s = float(batch[2].sum()) / (time.perf_counter() - began)
    row = dict(
      step=step,
      loss=float(metrics["loss"]),
      task_loss=float(metrics["task_loss"]),
      aux_loss=float(metrics["load_balancing_loss"]),
      load_max_over_mean=float(metrics["load_max_over_mean"]),
      tokens_per_s=tokens_per_s,
    )
    history.append({**row, "expert_counts": metrics["expert_counts"].tolist()})
    bar.set_postfix(
      loss=f"{row['loss']:.3f}", aux=f"{row['aux_loss']:.3f}", tok_s=f"{tokens_per_s:.0f}"
    )
  saved = checkpoint.save(
    args.checkpoint,
    model,
    optimizer,
    step=start + args.steps,
    overwrite=resume or args.overwrite,
    info={"model_flags": model_flags(args)},
  )
  load = np.asarray(history[-1]["expert_counts"])
  print(f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}; checkpoint: {saved}")
  print(
    "max/mean expert load (the worst layer): "
    f"{history[0]['load_max_over_mean']:.2f} -> {history[-1]['load_max_over_mean']:.2f}"
  )
  print("expert load at the last step (tokens per expert, one row per MoE layer):")
  for layer, counts in enumerate(load):
    print(f"  layer {layer}: {counts.tolist()}")
  return history


# The flags that shape the model and its state: a resume must give the checkpoint's.
MODEL_FLAGS = (
  "vocab",
  "layers",
  "heads",
  "moe_every",
  "scan_layers",
  "experts",
  "top_k",
  "hidden",
  "intermediate",
  "lora_rank",
  "expert_quant",
)


def model_flags(args) -> dict:
  """{flag: value} of `MODEL_FLAGS`, as a checkpoint records them."""
  return {name: getattr(args, name) for name in MODEL_FLAGS}


def _restored(args, model: MoETransformer, optimizer: nnx.Optimizer) -> int:
  """Restores `args.checkpoint` into the model and optimizer (a selection bias the checkpoint
  lacks starts at 0); flags that build another model than the checkpoint's exit with code 2,
  naming them."""
  flag = lambda name, value: f"--{name.replace('_', '-')} {value}"
  recorded = checkpoint.info_of(args.checkpoint).get("model_flags", {})
  differing = {k: v for k, v in recorded.items() if k in MODEL_FLAGS and getattr(args, k) != v}
  problem = None
  if differing:
    saved = " ".join(flag(name, value) for name, value in differing.items())
    given = " ".join(flag(name, getattr(args, name)) for name in differing)
    problem = f"it was trained with {saved}; these flags say {given}"
  else:
    try:
      return checkpoint.restore(args.checkpoint, model, optimizer, may_lack=("routing_bias",))
    except ValueError as error:  # a checkpoint that records no flags
      problem = str(error)
  print(
    f"moejax train: --resume: {args.checkpoint} holds another model: {problem}. Pass the "
    "checkpoint's model flags, or a new --checkpoint",
    file=sys.stderr,
  )
  raise SystemExit(2)


def resumes(args) -> bool:
  """Whether the train command resumes `args.checkpoint`: with --resume, which must find a
  checkpoint there; else a checkpoint there needs --overwrite. A path that cannot become a
  checkpoint folder (a file, or below one) exits at once, before any training. Exits naming
  the flags."""
  path = Path(args.checkpoint)
  blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
  if blocking is not None:
    raise SystemExit(
      f"moejax train: --checkpoint {path}: {blocking} is a file, not a folder: name a folder "
      "for the checkpoint"
    )
  existing = next(p for p in (path, *path.parents) if p.exists())
  if not os.access(existing, os.W_OK):
    raise SystemExit(f"moejax train: --checkpoint {path}: {existing} is not writable")
  if args.resume:
    if not checkpoint.exists(path):
      raise SystemExit(
        f"moejax train: --resume: {path} holds no checkpoint (no meta.json): check the path, "
        "or leave out --resume to start a new one"
      )
    return True
  if checkpoint.exists(path) and not args.overwrite:
    raise SystemExit(
      f"moejax train: {path} holds a checkpoint (step {checkpoint.step_of(path)}): pass "
      "--resume to continue from it, or --overwrite to start over and replace it"
    )
  return False
