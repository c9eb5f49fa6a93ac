"""FP8 compute (`MoEConfig(compute_quant=...)`): the layer's forward against the recipe written
out in NumPy (each operand quantized as `moejax.compute_quant` documents, dequantized, the
products in float64), and against the unquantized layer: the quantization happens and stays
sane, forward and gradients, on one device and a 2x4 mesh with both dispatch schemes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas.fused_moe import FP8_BLOCKS
from moejax import MoEConfig, moe_apply, reference_moe
from moejax.apps import train
from moejax.apps.cli import parser as main_parser
from moejax.compute_quant import fake_quantized
from moejax.lora import ExpertLoRA
from moejax.plan import ExpertPlan, plan_experts
from moejax.remat import REMAT_POLICIES
from moejax.testing import poison, random_params, rank_mask
from tests.helpers import assert_close, mesh_of, random_adapters, slow

T, D, F = 64, 128, 256
CONFIG = MoEConfig(num_experts=8, top_k=2, hidden_size=D, intermediate_size=F)


def quantized(x: np.ndarray, group: tuple[int, int], power_of_two: bool = False) -> np.ndarray:
  """x [M, N] through float8_e4m3fn in groups of `group` (0: the whole axis), dequantized:
  scale = amax / 448 (`power_of_two`: the next power of two up from it), 1 for a group of
  zeros, values rounded to nearest even."""
  rows, cols = x.shape
  gr, gc = group[0] or rows, group[1] or cols
  grouped = x.reshape(rows // gr, gr, cols // gc, gc)
  amax = np.abs(grouped).max(axis=(1, 3), keepdims=True)
  scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
  if power_of_two:
    scale = 2.0 ** np.ceil(np.log2(scale))
  values = (grouped / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
  return (values.astype(np.float64) * scale).reshape(rows, cols)


# (activation groups, weight groups) of the forward products, per recipe (0: whole axis)
FORWARD_GROUPS = {
  "fp8_deepseek": ((1, 128), (128, 128)),
  "fp8_rowwise": ((1, 0), (0, 1)),
  "mxfp8": ((1, 32), (32, 1)),
}


def recipe_in_numpy(params, x, ids, weights, recipe: str) -> np.ndarray:
  """sum_k w[n,k] * expert_{e[n,k]}(x[n]) with both forward products quantized by `recipe`."""
  rows, weight_groups = FORWARD_GROUPS[recipe]
  quantized_ = functools.partial(quantized, power_of_two=recipe == "mxfp8")
  x, ids, weights = (np.asarray(a) for a in (x, ids, weights))
  w_gate_up, w_down = np.asarray(params.w_gate_up), np.asarray(params.w_down)
  out = np.zeros((len(x), D))
  for n, k in np.ndindex(ids.shape):
    e = ids[n, k]
    gate_up = quantized_(x[n : n + 1], rows) @ quantized_(w_gate_up[e], weight_groups)
    gate, up = gate_up[:, :F], gate_up[:, F:]
    hidden = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)  # silu, compute dtype
    out[n] += weights[n, k] * (quantized_(hidden, rows) @ quantized_(w_down[e], weight_groups))[0]
  return out


def _inputs(seed: int):
  """Uniform weights and tokens (fewer outliers than Gaussian ones: the recipe's error is what
  a trained layer's is, ~2-4 %), routed to distinct experts."""
  keys = jax.random.split(jax.random.key(seed), 5)
  params = random_params(CONFIG, keys[0])
  uniform = lambda key, a: jax.random.uniform(key, a.shape, a.dtype, -1.0, 1.0) / a.shape[-2] ** 0.5
  params = params._replace(
    w_gate_up=uniform(keys[1], params.w_gate_up), w_down=uniform(keys[2], params.w_down)
  )
  x = jax.random.uniform(keys[3], (T, D), minval=-2.0, maxval=2.0)
  scores = jax.nn.softmax(jax.random.normal(keys[4], (T, CONFIG.num_experts)))
  weights, ids = jax.lax.top_k(scores, CONFIG.top_k)
  return params, x, ids.astype(jnp.int32), weights


def assert_equal_but_a_rounding_flip(got, want) -> None:
  """got [T, D] equals want to 1e-5 (each token row's error over want's Frobenius norm), but
  for at most one row, off by at most 1e-3: an activation computed an ulp apart (XLA's exp
  against NumPy's, or sums in another order) can lie on an e4m3 rounding boundary and round
  to the neighbouring value (measured: one row in 64, 3e-5 and 7e-4)."""
  rows = np.linalg.norm(np.asarray(got) - np.asarray(want), axis=1) / np.linalg.norm(want)
  assert np.sort(rows)[-2] <= 1e-5 and rows.max() <= 1e-3, np.sort(rows)[-3:]


@pytest.mark.parametrize("recipe", ["fp8_deepseek", "fp8_rowwise", "mxfp8"])
def test_the_forward_is_the_recipe_written_out(recipe):
  params, x, ids, weights = _inputs(1)
  config = dataclasses.replace(CONFIG, compute_quant=recipe)
  y, _ = moe_apply(params, x, config=config, expert_ids=ids, combine_weights=weights)
  want = recipe_in_numpy(params, x, ids, weights, recipe)
  assert_equal_but_a_rounding_flip(y, want)
  unquantized = reference_moe(params, x, CONFIG, expert_ids=ids, combine_weights=weights)
  assert np.linalg.norm(np.asarray(unquantized) - want) / np.linalg.norm(want) > 1e-3


# the fused path (its fp8 kernels interpreted) in chunks of 32 tokens: its tiles are 128 rows
FUSED = dict(expert_backend="fused", chunk_size=32)


@pytest.mark.parametrize(
  "recipe, mesh_shape, dispatch, fp8_exchange, path",
  [
    ("fp8_deepseek", None, "all_gather", False, {}),
    ("fp8_rowwise", None, "all_gather", False, {}),
    ("mxfp8", None, "all_gather", False, {}),
    slow("fp8_deepseek", (2, 4), "all_gather", False, {}),
    slow("fp8_deepseek", (2, 4), "all_to_all", False, {}),
    slow("fp8_deepseek", (2, 4), "all_to_all", True, {}),
    slow("fp8_deepseek", (2, 4), "all_to_all", True, FUSED),
  ],
  ids=[
    "deepseek one device",
    "rowwise one device",
    "mxfp8 one device",
    "2x4 all_gather",
    "2x4 all_to_all",
    "2x4 all_to_all fp8 exchange",
    "2x4 all_to_all fp8 exchange fused",
  ],
)
@pytest.mark.filterwarnings("ignore:expert_backend='fused' on a CPU")
def test_quantized_and_sane_forward_and_gradients(recipe, mesh_shape, dispatch, fp8_exchange, path):
  """Against the unquantized reference, the relative error (|error| / |reference|, Frobenius)
  above 1e-3 (quantized) and below 8e-2 (sane): the output and the gradients of x, the
  experts and the router; padding poisoned; on the tile loop (the recipe emulated) and the
  fused path (its fp8 kernels: below, and tests/test_fused.py against the recipe written
  out). fp8 on both operands of both products costs ~5-6 % on random data (one e4m3 product
  alone ~3.6 %); measured here 5.2-6.3 %."""
  params, x, _, _ = _inputs(2)
  config = dataclasses.replace(
    CONFIG, compute_quant=recipe, dispatch=dispatch,
    dispatch_quant="fp8" if fp8_exchange else None, **{"chunk_size": 4, **path},
  )  # fmt: skip
  if path:
    assert plan_experts(config, num_rows=64, local_experts=8) == ExpertPlan(
      path="fused", backend="triton", interpret=True, blocks=FP8_BLOCKS
    )
  mesh = mesh_shape and mesh_of(*mesh_shape)
  mask = rank_mask([8, 3, 0, 8, 5, 8, 1, 8], 8)
  probe = jax.random.normal(jax.random.key(3), x.shape)

  def ours(params, x):
    y, _ = moe_apply(params, poison(x, mask), config=config, mesh=mesh, token_mask=mask)
    return jnp.sum(jnp.where(mask[:, None], y, 0.0) * probe), y

  def theirs(params, x):
    y = reference_moe(params, x, CONFIG, mask)
    return jnp.sum(y * probe), y

  (_, y), grads = jax.value_and_grad(ours, (0, 1), has_aux=True)(params, x)
  (_, y_ref), grads_ref = jax.value_and_grad(theirs, (0, 1), has_aux=True)(params, x)
  valid = np.asarray(mask)[:, None]
  checked = {
    "y": (np.where(valid, y, 0.0), y_ref),
    "d/dx": (np.where(valid, grads[1], 0.0), grads_ref[1]),
    "d/dw_gate_up": (grads[0].w_gate_up, grads_ref[0].w_gate_up),
    "d/dw_down": (grads[0].w_down, grads_ref[0].w_down),
    # the router computes unquantized: its gradient differs through the experts' outputs
    "d/drouter_kernel": (grads[0].router_kernel, grads_ref[0].router_kernel),
  }
  assert_quantized_and_sane(checked)


@pytest.mark.filterwarnings("ignore:expert_backend='fused' on a CPU")
def test_the_fused_path_computes_the_tile_loops_emulated_products():
  """fp8_deepseek on the fused path (its kernels interpreted), with each expert's output
  RMS-normalized and LoRA adapters (unquantized): the output and the gradients of x, both
  expert matrices, the adapters and the router equal the tile loop's emulation of the recipe
  (1e-5; each expert's rows of a chunk of 32 tokens fit in one group of 128, so both paths
  group the weight gradients' operands alike), padding poisoned. The output and x's gradient
  but for a token's rounding flip: the adapters' share of d(gate|up) is summed in another
  order, and a value on an e4m3 boundary may round the other way when d(gate|up) is quantized
  for dx (measured: one row, 2e-4 of the whole)."""
  params, x, _, _ = _inputs(4)
  config = dataclasses.replace(
    CONFIG, compute_quant="fp8_deepseek", chunk_size=32, expert_output_norm_eps=1e-6,
    lora_rank=4, lora_alpha=8.0,
  )  # fmt: skip
  params = params._replace(lora=random_adapters(config, jax.random.key(6), scale=0.05)[0])
  fused = dataclasses.replace(config, expert_backend="fused")
  assert plan_experts(fused, num_rows=64, local_experts=8) == ExpertPlan(
    path="fused", backend="triton", interpret=True, blocks=FP8_BLOCKS
  )
  mask = rank_mask([8, 3, 0, 8, 5, 8, 1, 8], 8)
  probe = jax.random.normal(jax.random.key(5), x.shape)
  on = lambda config: outputs_and_gradients(poisoned_layer(config, mask), params, x, mask, probe)
  ours, emulated = on(fused), on(config)
  for name in ("y", "x"):  # [T, D]: a token's row may hold a rounding flip
    assert_equal_but_a_rounding_flip(ours.pop(name), emulated.pop(name))
  for name, want in emulated.items():
    error = np.linalg.norm(ours[name] - want) / np.linalg.norm(want)
    assert error <= 1e-5, (name, error)


def poisoned_layer(config: MoEConfig, mask: jax.Array):
  """(params, x) -> the layer's output, x's masked rows poisoned (NaN)."""
  return lambda p, x: moe_apply(p, poison(x, mask), config=config, token_mask=mask)[0]


def outputs_and_gradients(layer, params, x, mask, probe) -> dict:
  """`layer(params, x)` on the rows `mask` keeps, and the gradients of x (on them), both
  expert matrices, the router and the experts' adapters (if any) for the loss
  sum(y * probe)."""
  valid = np.asarray(mask)[:, None]

  def loss(params, x):
    y = jnp.where(valid, layer(params, x), 0.0)
    return jnp.sum(y * probe), y

  (_, y), (d_params, d_x) = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
  adapters = d_params.lora._asdict() if d_params.lora is not None else {}
  return dict(
    y=y, x=np.where(valid, d_x, 0.0), w_gate_up=d_params.w_gate_up, w_down=d_params.w_down,
    router=d_params.router_kernel, **{f"lora.{name}": d for name, d in adapters.items()},
  )  # fmt: skip


def assert_quantized_and_sane(checked: dict) -> None:
  """Each (got, want) pair's relative error (Frobenius) above 1e-3 and below 8e-2."""
  for what, (got, want) in checked.items():
    error = np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want)
    assert 1e-3 < error < 8e-2, (what, error)


@pytest.mark.slow
def test_lora_adapters_train_over_fp8_compute_under_remat():
  """Adapters (computed unquantized) over fp8_deepseek base products, the layer under the
  "names" remat policy: the output and the gradients of x and every adapter matrix against
  the unquantized reference with W + s·A·B per expert, padding poisoned."""
  params, x, _, _ = _inputs(6)
  config = dataclasses.replace(CONFIG, lora_rank=4, lora_alpha=8.0, chunk_size=16)
  adapters, _ = random_adapters(config, jax.random.key(6), scale=0.05)
  params = params._replace(lora=adapters)
  quantized_config = dataclasses.replace(config, compute_quant="fp8_deepseek")
  mask = jax.random.bernoulli(jax.random.key(7), 0.75, (T,))
  probe = jax.random.normal(jax.random.key(8), x.shape)
  layer = lambda p, x: moe_apply(p, poison(x, mask), config=quantized_config, token_mask=mask)[0]
  ours = jax.checkpoint(layer, policy=REMAT_POLICIES["names"])
  theirs = lambda p, x: reference_moe(p, x, config, mask)
  valid = np.asarray(mask)[:, None]
  loss = lambda f: lambda p, x: (jnp.sum(jnp.where(valid, f(p, x), 0.0) * probe), f(p, x))
  (_, y), grads = jax.value_and_grad(loss(ours), (0, 1), has_aux=True)(params, x)
  (_, y_ref), grads_ref = jax.value_and_grad(loss(theirs), (0, 1), has_aux=True)(params, x)
  checked = {"y": (np.where(valid, y, 0.0), np.where(valid, y_ref, 0.0))}
  checked["d/dx"] = (np.where(valid, grads[1], 0.0), grads_ref[1])
  for name in ExpertLoRA._fields:
    checked[f"d/d{name}"] = (getattr(grads[0].lora, name), getattr(grads_ref[0].lora, name))
  assert_quantized_and_sane(checked)


def test_a_group_of_zeros_and_the_largest_value_survive():
  x = jnp.array([[0.0] * 4, [448.0, -1.0, 3.0, 0.5]])
  assert fake_quantized(x, (1, None)).tolist() == [[0.0] * 4, [448.0, -1.0, 3.0, 0.5]]


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(compute_quant="fp4"), r"compute_quant must be one of \(None, 'fp8_deepseek', 'fp8_"),
    (
      dict(compute_quant="fp8_deepseek", intermediate_size=192),
      r"quantizes in groups of 128: intermediate_size=192 must be a multiple of 128",
    ),
    (
      dict(compute_quant="mxfp8", hidden_size=144),
      r"'mxfp8' quantizes in groups of 32: hidden_size=144 must be a multiple of 32",
    ),
    (
      dict(compute_quant="fp8_deepseek", latent_size=96),  # the experts' width, not D's
      r"quantizes in groups of 128: latent_size=96 must be a multiple of 128",
    ),
    (
      dict(compute_quant="fp8_rowwise", expert_quant="fp8_block"),
      r"compute_quant='fp8_rowwise' quantizes float master weights on the fly; "
      r"expert_quant='fp8_block' stores them quantized: choose one",
    ),
  ],
)
def test_a_bad_recipe_is_named(fields, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(CONFIG, **fields)


@pytest.mark.parametrize(
  "fields, reason",
  [
    (
      dict(compute_quant="fp8_rowwise", expert_backend="fused"),
      r" \(the fused kernels: they run compute_quant='fp8_deepseek', not 'fp8_rowwise'\)",
    ),
    (
      dict(compute_quant="fp8_rowwise", expert_backend="pallas"),
      r" \(the fp8 kernels: they run 'fp8_deepseek', not compute_quant='fp8_rowwise'\)",
    ),
    (
      dict(compute_quant="fp8_deepseek", expert_backend="pallas", lora_rank=4),
      r" \(the fp8 kernels: they take experts without adapters, not lora_rank=4\)",
    ),
  ],
  ids=["fused", "pallas rowwise", "pallas lora"],
)
def test_kernels_asked_for_fall_back_to_the_tile_loop_with_the_reason(fields, reason):
  config = dataclasses.replace(CONFIG, **fields)
  recipe = fields["compute_quant"]
  with pytest.warns(UserWarning, match=f"compute_quant='{recipe}' runs on the tile loop{reason}"):
    assert plan_experts(config, num_rows=64, local_experts=8) == ExpertPlan(path="tile_loop")


def weight_casts(jaxpr, shapes: set[tuple], in_loop: bool = False) -> list[bool]:
  """For each cast to float8_e4m3fn of an array of one of `shapes` in `jaxpr` and the jaxprs
  in its equations' parameters: whether it runs inside a scan or while loop."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "convert_element_type":
      out = eqn.outvars[0].aval
      found += [in_loop] if out.dtype == jnp.float8_e4m3fn and out.shape in shapes else []
    looped = in_loop or eqn.primitive.name in ("scan", "while")
    for value in eqn.params.values():
      for sub in value if isinstance(value, tuple | list) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
        if hasattr(sub, "eqns"):
          found += weight_casts(sub, shapes, looped)
  return found


@pytest.mark.parametrize("backend", ["pallas", "fused"])
def test_the_fp8_kernels_weights_are_quantized_once_per_pass_not_per_chunk(backend):
  """On the fp8 kernels (the Hopper ones, or the fused path's), the gradient of a layer of 4
  chunks quantizes its expert matrices outside the chunk loops (forward and backward:
  `prepare`), never inside one (each chunk's products, recomputed forward and dgrad, read
  those blocks)."""
  params, x, _, _ = _inputs(11)
  config = dataclasses.replace(
    CONFIG, compute_quant="fp8_deepseek", expert_backend=backend, chunk_size=16
  )
  loss = lambda p, x: jnp.sum(moe_apply(p, x, config=config)[0])
  with pytest.warns(UserWarning, match="interpreter"):
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(params, x).jaxpr
  blocks = lambda e, k, n: (e, k // 128, 128, n // 128, 128)  # `quantize_groups`' 128x128 view
  in_loop = weight_casts(jaxpr, {blocks(*params.w_gate_up.shape), blocks(*params.w_down.shape)})
  assert len(in_loop) >= 4 and not any(in_loop), in_loop


@pytest.mark.slow  # the layer's fp8 kernels in the Mosaic GPU interpreter: 35-70 s
def test_the_fp8_kernels_compute_the_emulating_tile_loops_products():
  """fp8_deepseek with expert_backend="pallas": the Hopper fp8 kernels (interpreted) give the
  tile loop's emulated output (the same quantized operands, sums in another order: 1e-5 but a
  rounding flip) and down-projection gradient (1e-4), its gate|up gradient up to the rounding
  of a cotangent quantized with its routing weight in it (the tile loop applies it after:
  1e-3), and x's and the
  router's gradients quantized and sane against the unquantized reference: the routing
  weights' gradient is <d_out, the forward's fp8 output> here, <the dgrad's fp8 d(hidden),
  hidden> on the tile loop, both the recipe's (3.8 % apart). Padding poisoned. One device:
  under a multi-device shard_map the Mosaic GPU interpreter fails these kernels (JAX 0.12:
  "Barrier remains allocated", the bf16 Mosaic kernel too where a device holds no rows; JAX
  0.10: no result in 10 minutes), so the mesh is checked by compiling for 8 H200s
  (tests/test_gpu_compile.py)."""
  params, x, _, _ = _inputs(9)
  mask = rank_mask([8, 3, 0, 8, 5, 8, 1, 8], 8)
  probe = jax.random.normal(jax.random.key(10), x.shape)
  # Two chunks: the kernels read the weights' fp8 blocks quantized once for both, and the
  # weights' gradients accumulate over them.
  config = dataclasses.replace(CONFIG, compute_quant="fp8_deepseek", chunk_size=T // 2)
  kernels = dataclasses.replace(config, expert_backend="pallas")
  with pytest.warns(UserWarning, match="runs the fp8 kernels in the Mosaic GPU interpreter"):
    assert plan_experts(kernels, num_rows=64, local_experts=8) == ExpertPlan(
      path="pallas", backend="mosaic", interpret=True
    )
  gradients = lambda layer: outputs_and_gradients(layer, params, x, mask, probe)
  with pytest.warns(UserWarning, match="Mosaic GPU interpreter"):
    ours = gradients(poisoned_layer(kernels, mask))
  emulated = gradients(poisoned_layer(config, mask))
  unquantized = gradients(lambda p, x: reference_moe(p, x, CONFIG, mask))
  error = lambda name: np.linalg.norm(ours[name] - emulated[name]) / np.linalg.norm(emulated[name])
  assert_equal_but_a_rounding_flip(ours["y"], emulated["y"])
  assert error("w_down") <= 1e-4 and error("w_gate_up") <= 1e-3, (
    error("w_down"),
    error("w_gate_up"),
  )
  assert_quantized_and_sane({name: (ours[name], unquantized[name]) for name in ("x", "router")})


@pytest.mark.slow
def test_training_200_steps_ends_within_a_percent_of_the_unquantized_run(tmp_path):
  """`moejax train` on its small model (D = F = 128, one device) for 200 steps with
  --compute-quant fp8_deepseek and without: the mean loss of the last 50 steps, and the task
  loss's mean over the whole run, each within 1 % (docs/performance.md, "FP8 compute", has
  the run's figures)."""
  losses = {}
  for recipe in (None, "fp8_deepseek"):
    flags = ["train", "--steps", "200", "--hidden", "128", "--intermediate", "128"]
    flags += ["--batch-size", "8"]
    flags += ["--checkpoint", str(tmp_path / str(recipe))]
    flags += ["--compute-quant", recipe] if recipe else []
    metrics = train.run(main_parser().parse_args(flags), mesh_shape=(1, 1))
    losses[recipe] = (
      np.mean([step["loss"] for step in metrics[-50:]]),  # where the run ends
      np.mean([step["task_loss"] for step in metrics]),  # the task's whole curve
    )
  (end, curve), (end_fp8, curve_fp8) = losses[None], losses["fp8_deepseek"]
  assert end < 0.1  # it learned
  assert abs(end_fp8 - end) <= 0.01 * end and abs(curve_fp8 - curve) <= 0.01 * curve, losses


@pytest.mark.parametrize("dispatch", ["all_gather", slow("all_to_all")])
def test_the_fp8_exchange_sends_the_rows_rounded_and_their_gradients_straight_through(dispatch):
  """dispatch_quant="fp8" on a 2x4 mesh: the experts see each row rounded in 1x128 groups
  (the layer equals the reference on the rounded rows, with the same router logits), the
  gradients are the reference's at the rounded rows, and the exchange carries fp8."""
  config = dataclasses.replace(CONFIG, chunk_size=4, dispatch=dispatch)
  params, x, _, _ = _inputs(4)
  logits = x @ params.router_kernel
  mesh = mesh_of(2, 4)
  quantized_config = dataclasses.replace(config, dispatch_quant="fp8")
  ours = lambda p, x: moe_apply(p, x, config=quantized_config, mesh=mesh, router_logits=logits)[0]
  theirs = lambda p, x: reference_moe(p, x, config, router_logits=logits)
  rounded = fake_quantized(x, (1, 128))
  assert_close(ours(params, x), theirs(params, rounded), what="y")
  loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
  got = jax.grad(loss(ours), (0, 1))(params, x)
  want = jax.grad(loss(theirs), (0, 1))(params, rounded)
  assert_close(got[1], want[1], what="d/dx")
  for name in ("w_gate_up", "w_down"):
    assert_close(getattr(got[0], name), getattr(want[0], name), what=f"d/d{name}")
  program = jax.jit(ours).lower(params, x).as_text().splitlines()
  collective = "all_gather" if dispatch == "all_gather" else "all_to_all"
  assert any(collective in line and "f8E4M3FN" in line for line in program)


def test_the_fp8_exchange_on_one_device_warns_and_sends_nothing_quantized():
  params, x, _, _ = _inputs(5)
  config = dataclasses.replace(CONFIG, dispatch_quant="fp8")
  with pytest.warns(UserWarning, match="this call's expert axis has one device, nothing is"):
    y, _ = moe_apply(params, x, config=config)
  assert_close(y, reference_moe(params, x, CONFIG), what="y")
  with pytest.raises(ValueError, match=r"sends rows in groups of 128: their width 96 must"):
    dataclasses.replace(config, hidden_size=96)
