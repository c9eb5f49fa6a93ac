"""The layer in users' hands: a transformer that trains, checkpoints across meshes, Linen."""

import dataclasses
import json
import subprocess
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.core import FrozenDict, freeze, unfreeze

from kernels_pallas.formats import FORMATS
from kernels_pallas.quantized import BlockScaled
from moejax import MoEConfig, MoELayer, MoEParams, checkpoint, eplb, linen, reference_moe, train
from moejax.apps.cli import parser as main_parser
from moejax.expert_placement import initial_placement, logical_load
from moejax.linen import moe_linen
from moejax.models import ClusterTask, MoETransformer, TransformerConfig, shard_model
from moejax.params import QUANTIZED_PARAMS
from moejax.train import train_step
from tests.helpers import assert_close, mesh_of, seed_of, slow, user_env

MOE = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=64, chunk_size=32)


def build(mesh_shape, seed, moe_every=1, scan_layers=False, moe=MOE):
  mesh = mesh_of(*mesh_shape)
  config = TransformerConfig(
    vocab_size=64, num_layers=2, num_heads=2, moe=moe, moe_every=moe_every, scan_layers=scan_layers
  )
  model = MoETransformer(config, mesh=mesh, rngs=nnx.Rngs(seed))
  shard_model(model, mesh)
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  shard_model(optimizer, mesh)
  return model, optimizer, mesh


def test_training_on_the_mesh_lowers_the_loss_and_reports_load():
  model, optimizer, mesh = build((2, 4), seed=0)
  task = ClusterTask()
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  losses = []
  for step in range(60):
    tokens, targets, mask = (jax.device_put(a, sharding) for a in task.batch(32, step))
    metrics = train_step(model, optimizer, tokens, targets, mask)
    losses.append(float(metrics["task_loss"]))
  assert losses[-1] < 0.3 * losses[0], losses[::10]
  counts = np.asarray(metrics["expert_counts"])  # [layers, E]
  assert counts.shape == (2, 8)
  np.testing.assert_array_equal(counts.sum(axis=1), 2 * int(mask.sum()))
  assert np.all(np.isfinite(float(metrics["load_balancing_loss"])))


def test_every_other_block_is_moe():
  model, _, _ = build((1, 1), seed=0, moe_every=2)
  assert [type(b.ffn).__name__ for b in model.blocks] == ["DenseFFN", "MoELayer"]


@pytest.mark.parametrize(
  "scan_layers, expert_fsdp",
  [slow(False, False, id="unrolled"), pytest.param(True, True, id="scanned-onto-fsdp")],
)
def test_checkpoint_restores_onto_another_mesh(tmp_path, scan_layers, expert_fsdp):
  """Saved on (2, 4), restored on (4, 2); the scanned model's expert weights restore split
  over data as well (expert_fsdp)."""
  model, optimizer, _ = build((2, 4), seed=0, scan_layers=scan_layers)
  checkpoint.save(tmp_path / "ckpt", model, optimizer, step=5)
  target = dataclasses.replace(MOE, expert_fsdp=expert_fsdp)
  restored, restored_optimizer, _ = build((4, 2), seed=1, scan_layers=scan_layers, moe=target)
  assert checkpoint.restore(tmp_path / "ckpt", restored, restored_optimizer) == 5
  moe = restored.blocks.groups.moe if scan_layers else restored.blocks[0]
  w = moe.ffn.w_gate_up[...]
  assert w.sharding.mesh.shape == {"data": 4, "expert": 2}
  layer_axis = (None,) if scan_layers else ()
  stored = (*layer_axis, "expert", "data" if expert_fsdp else None)
  assert w.sharding.spec[: len(stored)] == stored
  tokens, _, mask = ClusterTask().batch(8, 0)
  assert_close(restored(tokens, mask), model(tokens, mask), what="logits after restore")


def test_checkpoint_restores_a_subset_and_names_a_mismatch(tmp_path):
  """A training checkpoint (model and optimizer) restores the model alone, and the first
  part that does not fit another model is named in one sentence."""
  model = MoELayer(MOE, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  checkpoint.save(tmp_path / "ckpt", model, optimizer, step=7)
  alone = MoELayer(MOE, rngs=nnx.Rngs(1))
  assert checkpoint.restore(tmp_path / "ckpt", alone) == 7
  chex.assert_trees_all_equal(nnx.state(alone), nnx.state(model))
  wider = MoELayer(dataclasses.replace(MOE, intermediate_size=2 * MOE.intermediate_size),
                   rngs=nnx.Rngs(0))  # fmt: skip
  with pytest.raises(ValueError, match=r"model/w_down is \(\d+, \d+, \d+\) in the checkpoint"):
    checkpoint.restore(tmp_path / "ckpt", wider)
  checkpoint.save(tmp_path / "model_only", model)
  with pytest.raises(ValueError, match="the checkpoint has no optimizer"):
    checkpoint.restore(tmp_path / "model_only", alone, optimizer)


def test_a_checkpoint_is_never_replaced_unasked_nor_lost_midway(tmp_path, monkeypatch):
  """`save` refuses a folder holding a checkpoint without `overwrite`; a save interrupted
  before its meta.json swap leaves the previous checkpoint as it was."""
  model = MoELayer(MOE, rngs=nnx.Rngs(0))
  checkpoint.save(tmp_path / "ckpt", model, step=3)
  with pytest.raises(FileExistsError, match=r"ckpt holds a checkpoint \(step 3\).*overwrite=True"):
    checkpoint.save(tmp_path / "ckpt", MoELayer(MOE, rngs=nnx.Rngs(1)), step=4)

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(checkpoint.files, "write_atomically", interrupted)
  with pytest.raises(KeyboardInterrupt):
    checkpoint.save(tmp_path / "ckpt", MoELayer(MOE, rngs=nnx.Rngs(1)), step=4, overwrite=True)
  monkeypatch.undo()
  restored = MoELayer(MOE, rngs=nnx.Rngs(2))
  assert checkpoint.restore(tmp_path / "ckpt", restored) == 3
  chex.assert_trees_all_equal(nnx.state(restored), nnx.state(model))
  checkpoint.save(tmp_path / "ckpt", MoELayer(MOE, rngs=nnx.Rngs(1)), step=4, overwrite=True)
  assert checkpoint.step_of(tmp_path / "ckpt") == 4
  assert [p.name for p in (tmp_path / "ckpt").glob("state-*")] == ["state-4"]  # no leftovers


@pytest.mark.parametrize("expert_quant", [*(slow(f) for f in FORMATS if f != "fp8_block"),
                                          "fp8_block"])  # fmt: skip
def test_train_command_runs_at_its_defaults_and_guards_its_checkpoint(expert_quant, tmp_path):
  """Every --expert-quant runs at the command's default sizes; an existing checkpoint is
  resumed with --resume or replaced with --overwrite, never silently; a --resume path that
  holds no checkpoint is an error."""
  folder = str(tmp_path / "ck")
  parse = lambda *flags: main_parser().parse_args(["train", "--checkpoint", folder, *flags])
  train.run(parse("--steps", "1", "--expert-quant", expert_quant), mesh_shape=(2, 4))
  assert checkpoint.step_of(folder) == 1
  with pytest.raises(SystemExit, match=r"holds a checkpoint \(step 1\).*--resume.*--overwrite"):
    train.run(parse("--steps", "1"), mesh_shape=(2, 4))
  typo = main_parser().parse_args(["train", "--checkpoint", folder + "x", "--resume"])
  with pytest.raises(SystemExit, match=r"--resume: .*ckx holds no checkpoint"):
    train.run(typo, mesh_shape=(2, 4))
  assert checkpoint.step_of(folder) == 1


def test_a_resume_keeps_what_the_checkpoint_stores(tmp_path, capsys):
  """A selection bias in the checkpoint is restored with or without --bias-update-rate (and
  then not moved); a flag that needs a bias the checkpoint lacks starts one at 0; other model
  flags exit 2 naming them, the checkpoint untouched; a --checkpoint that is a file is
  refused before any training."""
  folder = tmp_path / "ck"
  small = ["--layers", "1", "--batch-size", "4", "--seq-len", "8", "--checkpoint", str(folder)]
  run = lambda *flags: train.run(
    main_parser().parse_args(["train", *small, "--steps", "1", *flags]), mesh_shape=(2, 4)
  )
  run()
  assert not checkpoint.holds(folder, "routing_bias")
  run("--resume", "--bias-update-rate", "0.5")
  assert "holds no selection bias: --bias-update-rate starts one at 0" in capsys.readouterr().out
  assert checkpoint.holds(folder, "routing_bias")
  moved = stored_bias(folder)
  assert np.abs(moved).max() > 0  # the update ran
  run("--resume")
  assert "selection bias is kept as it is" in capsys.readouterr().out
  np.testing.assert_array_equal(stored_bias(folder), moved)
  with pytest.raises(SystemExit) as exited:
    run("--resume", "--experts", "16", "--hidden", "48")
  assert exited.value.code == 2
  assert (
    "it was trained with --experts 8 --hidden 32; these flags say --experts 16 --hidden 48"
    in capsys.readouterr().err
  )
  assert checkpoint.step_of(folder) == 3
  (tmp_path / "a_file").write_text("mine")
  for path in (tmp_path / "a_file", tmp_path / "a_file" / "ck"):
    args = main_parser().parse_args(["train", "--checkpoint", str(path)])
    with pytest.raises(SystemExit, match=r"a_file is a file, not a folder"):
      train.resumes(args)
  assert (tmp_path / "a_file").read_text() == "mine"


def stored_bias(folder) -> np.ndarray:
  """The selection bias a `train` checkpoint holds (its MoE layer's), read as stored."""
  import orbax.checkpoint as ocp

  state = folder / json.loads((folder / "meta.json").read_text())["state"]
  with ocp.PyTreeCheckpointer() as checkpointer, warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Sharding info not provided")  # read on this host
    tree = checkpointer.restore(state)
  found = [v for k, v in jax.tree_util.tree_leaves_with_path(tree) if "routing_bias" in str(k)]
  return np.stack([np.asarray(v) for v in found])


def test_no_optimizer_decays_the_selection_bias():
  """The selection bias is a `SelectionBias` variable, not an `nnx.Param`: adamw's weight
  decay over the parameters leaves it as it is."""
  config = dataclasses.replace(MOE, use_routing_bias=True)
  layer = MoELayer(config, rngs=nnx.Rngs(0), bias_init=nnx.initializers.ones)
  optimizer = nnx.Optimizer(layer, optax.adamw(0.1, weight_decay=0.5), wrt=nnx.Param)
  grads = jax.tree.map(jnp.zeros_like, nnx.state(layer, nnx.Param))
  kernel = np.asarray(layer.router_kernel[...])
  optimizer.update(layer, grads)
  np.testing.assert_array_equal(layer.routing_bias[...], np.ones(8, np.float32))
  assert not np.array_equal(layer.router_kernel[...], kernel)  # decayed


@pytest.mark.slow
def test_train_command_checkpoints_and_resumes(tmp_path):
  """A scanned model, each block rematerialized saving the layer's checkpoint names, LoRA
  adapters trained alone over mxfp4 experts."""
  env = user_env()  # the resumed run reads the first one's compiled programs
  base = [sys.executable, "-m", "moejax", "train", "--checkpoint", str(tmp_path / "ck")]
  base += ["--scan-layers", "--remat", "names", "--lora-rank", "4", "--expert-quant", "mxfp4"]
  first = subprocess.run(
    [*base, "--steps", "12"], capture_output=True, text=True, timeout=600, env=env
  )
  assert first.returncode == 0, first.stderr[-3000:]
  assert "expert load at the last step" in first.stdout
  assert json.loads((tmp_path / "ck" / "meta.json").read_text())["step"] == 12
  second = subprocess.run(
    [*base, "--steps", "3", "--resume"], capture_output=True, text=True, timeout=600, env=env
  )
  assert second.returncode == 0, second.stderr[-3000:]
  assert f"resumed from {tmp_path / 'ck'} at step 12" in second.stdout
  assert json.loads((tmp_path / "ck" / "meta.json").read_text())["step"] == 15


class LinenModel(nn.Module):
  """A Linen model with the MoE layer inside."""

  @nn.compact
  def __call__(self, x, mask):
    return moe_linen(MOE, name="moe")(nn.Dense(32, name="proj")(x), mask)


def test_a_jitted_linen_init_on_an_explicit_mesh_needs_the_mesh_set():
  """As the guide says: eager `init` places the parameters on the module's mesh; a jitted one
  needs `jax.set_mesh` (JAX's rule for any jit that makes arrays on explicit axes)."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"))  # explicit axes, JAX's default
  module, x = moe_linen(MOE, mesh=mesh), jnp.ones((8, 32))
  eager = module.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"jax\.set_mesh"):
    jax.jit(module.init)(jax.random.key(0), x)
  with jax.set_mesh(mesh):
    jitted = jax.jit(module.init)(jax.random.key(0), x)
  chex.assert_trees_all_equal_shapes_and_dtypes(nn.unbox(jitted), nn.unbox(eager))
  assert nn.unbox(jitted)["params"]["w_down"].sharding.spec[0] == "expert"


def test_linen_model_matches_the_nnx_layer(request):
  key = jax.random.key(seed_of(request.node.name))
  x = jax.random.normal(key, (4, 6, 32))
  mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.7, (4, 6))
  model = LinenModel()
  variables = model.init(jax.random.fold_in(key, 2), x, mask)
  y = model.apply(variables, x, mask)
  params = nn.unbox(variables)["params"]
  layer = MoELayer(MOE, rngs=nnx.Rngs(0))
  for name, value in params["moe"].items():
    getattr(layer, name)[...] = value
  hidden = x @ params["proj"]["kernel"] + params["proj"]["bias"][None, None, :]
  assert_close(y, layer(hidden, mask), what="linen vs nnx")
  assert np.all(np.asarray(y)[~np.asarray(mask)] == 0)


@pytest.mark.parametrize(
  "extra", [dict(num_redundant_experts=3), dict(expert_quant="mxfp4")], ids=["redundant", "mxfp4"]
)
def test_linen_bridge_carries_the_layers_state(request, extra):
  """Replica placement and load, and quantized weights, in their own Linen collections."""
  config = dataclasses.replace(MOE, **extra)
  key = jax.random.key(seed_of(request.node.name))
  mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.7, (24,))
  x = jnp.where(mask[:, None], jax.random.normal(key, (24, 32)), jnp.nan)  # padding poisoned
  module = moe_linen(config)
  variables = module.init(jax.random.fold_in(key, 2), x, mask)
  y, updated = module.apply(variables, x, mask, mutable=["ExpertLoad"])
  variables = nn.unbox(variables)
  params = variables["params"]
  experts = config.num_experts
  if config.num_redundant_experts:
    assert set(variables) == {"params", "ExpertPlacement", "ExpertLoad"}
    slot_of = variables["ExpertPlacement"]["placement"]["physical_to_logical"]
    for name in QUANTIZED_PARAMS:  # each replica starts as its expert
      np.testing.assert_array_equal(params[name], params[name][:experts][slot_of])
    load = updated["ExpertLoad"]["expert_load"]
    assert int(load.sum()) == config.top_k * int(mask.sum())
    w_gate_up, w_down = params["w_gate_up"][:experts], params["w_down"][:experts]
    config = dataclasses.replace(config, num_redundant_experts=0)
  else:
    assert set(params) == {"router_kernel"}  # quantized weights are not trained
    quantized = variables["QuantizedWeight"]
    w_gate_up, w_down = (
      BlockScaled(quantized[name]["values"], quantized[name]["scales"], config.quant_block)
      for name in QUANTIZED_PARAMS
    )
  expected = reference_moe(
    MoEParams(params["router_kernel"], w_gate_up, w_down), x, config, token_mask=mask
  )
  assert_close(y, expected, what="linen vs reference")


class MoEBlock(nn.Module):
  """A Linen model with the MoE layer one level down, as in a real model."""

  config: MoEConfig
  mesh: jax.sharding.Mesh | None = None

  @nn.compact
  def __call__(self, x, mask):
    return moe_linen(self.config, mesh=self.mesh, name="moe")(x, mask)


def _expert_leaves(variables, config):
  """{name: array} of the module's expert weights (values and scales of quantized ones)."""
  if config.expert_quant:
    quantized = variables["QuantizedWeight"]["moe"]
    return {f"{n}.{part}": quantized[n][part] for n in QUANTIZED_PARAMS for part in quantized[n]}
  return {n: variables["params"]["moe"][n] for n in QUANTIZED_PARAMS}


@pytest.mark.parametrize(
  "extra, mesh_shape",
  [
    (dict(num_redundant_experts=4), (2, 4)),
    (dict(num_redundant_experts=2, expert_quant="mxfp4"), None),
  ],
  ids=["2x4", "mxfp4"],
)
def test_linen_rebalance_moves_experts_by_the_counted_load(request, extra, mesh_shape):
  """`linen.rebalance` on a nested module: DeepSeek's placement of the counted load, each slot
  holding its new expert's weights, the load zeroed, and the same output as before."""
  config = dataclasses.replace(MOE, **extra)
  mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
  key = jax.random.key(seed_of(request.node.name))
  mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.7, (32,))
  x = jnp.where(mask[:, None], jax.random.normal(key, (32, 32)), jnp.nan)  # padding poisoned
  model = MoEBlock(config, mesh)
  variables = model.init(jax.random.fold_in(key, 2), x, mask)
  _, counted = model.apply(variables, x, mask, mutable=["ExpertLoad"])
  variables = {**variables, **counted}
  load = np.asarray(nn.unbox(counted)["ExpertLoad"]["moe"]["expert_load"])
  with pytest.raises(ValueError, match="no module at path=\\('block',\\)"):
    linen.rebalance(variables, config, path=("block",))
  with pytest.raises(ValueError, match="no 'ExpertLoad' collection"):
    linen.rebalance({k: v for k, v in variables.items() if k != "ExpertLoad"}, config)

  moved, placement = linen.rebalance(variables, config, path=("moe",))
  frozen_moved, frozen_placement = linen.rebalance(freeze(variables), config, path=("moe",))
  assert isinstance(frozen_moved, FrozenDict)  # Linen's other variables type, kept
  chex.assert_trees_all_equal((unfreeze(frozen_moved), frozen_placement), (moved, placement))

  current = initial_placement(config.num_experts, config.num_redundant_experts)
  devices = 1 if mesh is None else mesh.shape["expert"]
  expected = eplb.rebalance(
    logical_load(load, current), num_physical=config.num_physical_experts, num_devices=devices
  )
  chex.assert_trees_all_equal(placement, expected)
  assert not np.array_equal(placement.physical_to_logical, current.physical_to_logical)
  before, after = nn.unbox(variables), nn.unbox(moved)
  chex.assert_trees_all_equal(
    tuple(after["ExpertPlacement"]["moe"]["placement"][f] for f in placement._fields),
    tuple(placement),
  )
  np.testing.assert_array_equal(after["ExpertLoad"]["moe"]["expert_load"], np.zeros_like(load))
  old, new = _expert_leaves(before, config), _expert_leaves(after, config)
  for name in old:  # slot p now holds expert physical_to_logical[p], first laid out at slot e
    np.testing.assert_array_equal(
      np.asarray(new[name]).view(np.uint8),
      np.asarray(old[name])[placement.physical_to_logical].view(np.uint8),
      err_msg=name,
    )
    assert new[name].sharding == old[name].sharding, name
  for field in ("ExpertPlacement", "ExpertLoad"):
    old_leaves, new_leaves = jax.tree.leaves(before[field]), jax.tree.leaves(after[field])
    assert [a.sharding for a in new_leaves] == [a.sharding for a in old_leaves], field

  y, recounted = model.apply(moved, x, mask, mutable=["ExpertLoad"])
  assert int(nn.unbox(recounted)["ExpertLoad"]["moe"]["expert_load"].sum()) == 2 * int(mask.sum())
  assert_close(y, model.apply(variables, x, mask), what="after vs before rebalance")
  chex.assert_tree_all_finite(y)


def test_linen_rebalance_needs_redundant_experts():
  with pytest.raises(ValueError, match="num_redundant_experts is 0"):
    linen.rebalance({}, MOE)
