"""The fused expert path (`expert_backend="fused"`, `kernels_pallas.fused_moe`), in the Pallas
interpreter: the kernels against a plain per-assignment reference, forward and every gradient,
and the layer against `reference_moe` on one device and a 2x4 mesh with both dispatch schemes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.fused_moe import (
  batch_invariant_blocks,
  counted_layout,
  fp8_matrix,
  fused_moe_mlp,
)
from kernels_pallas.gmm_triton import TritonBlocks
from moejax import MoEConfig
from moejax.activations import GATED, GatedActivation
from moejax.compute_quant import fake_quantized
from moejax.plan import ExpertPlan, plan_experts
from moejax.testing import random_params, rank_mask, relative_error
from tests.helpers import assert_close, check_against_reference, mesh_of, slow
from tests.kernels.test_backends import QUANTIZED, random_block_scaled

pytestmark = pytest.mark.filterwarnings("ignore:expert_backend='fused' on a CPU")

BLOCKS = TritonBlocks(block_m=16, block_n=16, block_k=16)
LOCAL_EXPERTS, D, F = 4, 32, 32


def per_assignment(
  activation, x, expert_ids, weights, w_gate_up, w_down, b_gate_up=0, b_down=0, lora=None
):
  """sum_k w[n,k] * mlp_{e[n,k]}(x[n]) one assignment at a time, float32 at full precision,
  the biases (where given) added before the activation and the weight, and with `lora`
  (gate_up_a, gate_up_b, down_a, down_b) each projection plus (rows @ A) @ B; ids outside
  [0, El) contribute nothing."""
  bias = lambda b, experts: b[experts] if isinstance(b, jax.Array) else b
  product = lambda rows, w: jnp.einsum("nd,ndf->nf", rows, w, precision="highest")

  def project(rows, w, adapter, experts):
    out = product(rows, w[experts])
    if adapter is None:
      return out
    a, b = adapter
    return out + product(product(rows, a[experts]).astype(rows.dtype), b[experts])

  gate_up_adapter, down_adapter = (None, None) if lora is None else (lora[:2], lora[2:])
  out = jnp.zeros(x.shape, jnp.float32)
  for k in range(expert_ids.shape[1]):
    expert = expert_ids[:, k]
    local = (expert >= 0) & (expert < w_down.shape[0])
    clipped = jnp.clip(expert, 0, w_down.shape[0] - 1)
    gate_up = project(x, w_gate_up, gate_up_adapter, clipped)
    gate_up = gate_up.astype(jnp.float32) + bias(b_gate_up, clipped)
    hidden = activation(*jnp.split(gate_up, 2, axis=-1)).astype(x.dtype)
    y = project(hidden, w_down, down_adapter, clipped)
    y = y + bias(b_down, clipped)
    out += jnp.where(local[:, None], y * weights[:, k : k + 1], 0.0)
  return out


def _operands(seed: int, tokens: int, top_k: int, ids, dtype=jnp.float32, biased=False):
  """(x, weights, w_gate_up, w_down (, b_gate_up, b_down with `biased`)), ids, a probe."""
  keys = jax.random.split(jax.random.key(seed), 7)
  x = jax.random.normal(keys[0], (tokens, D), dtype)
  weights = jax.random.uniform(keys[1], (tokens, top_k), minval=0.1)
  w_gate_up = (jax.random.normal(keys[2], (LOCAL_EXPERTS, D, 2 * F)) / 4).astype(dtype)
  w_down = (jax.random.normal(keys[3], (LOCAL_EXPERTS, F, D)) / 4).astype(dtype)
  probe = jax.random.normal(keys[4], (tokens, D))
  biases = (
    jax.random.normal(keys[5], (LOCAL_EXPERTS, 2 * F)) / 2,
    jax.random.normal(keys[6], (LOCAL_EXPERTS, D)) / 2,
  )
  return (x, weights, w_gate_up, w_down, *(biases if biased else ())), ids, probe


def _uneven_ids(tokens: int, top_k: int, seed: int) -> jax.Array:
  """Ids skewed to expert 3, expert 1 never chosen, a quarter held elsewhere (4, 5)."""
  probs = jnp.array([0.15, 0.0, 0.1, 0.5, 0.15, 0.1])
  return jax.random.choice(jax.random.key(seed), 6, (tokens, top_k), p=probs).astype(jnp.int32)


def relu_squared(gate, up):  # a caller's own activation
  return jnp.maximum(gate, 0.0) ** 2 * up


CASES = {
  "silu top-1 uneven": ("silu", 1, 40),
  "gelu top-8": ("gelu", 8, 24),
  "own function top-2": slow((relu_squared, 2, 24)),
  "nothing local": ("silu", 2, 0),
  "gpt-oss biases top-2": ("swiglu_oai", 2, 24, "biased"),
  **{f"{name} top-3": slow((name, 3, 24)) for name in GATED if name not in ("silu", "gelu")},
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_kernels_match_the_per_assignment_mlp_and_its_gradients(case):
  """Forward and the gradients of x, the weights and both matrices (and the biases, GPT-OSS's
  experts), float32: uneven loads, an expert no token chooses, assignments held elsewhere;
  "nothing local": every id elsewhere."""
  name, top_k, tokens, *biased = case
  activation = GatedActivation(name, limit=1.5)
  ids = _uneven_ids(tokens or 16, top_k, seed=top_k)
  if not tokens:
    ids = ids % 2 + LOCAL_EXPERTS  # every assignment held elsewhere
  operands, ids, probe = _operands(top_k, ids.shape[0], top_k, ids, biased=bool(biased))

  def fused(*operands):
    return fused_moe_mlp(
      operands[0], ids, *operands[1:], activation=activation.in_kernel, blocks=BLOCKS,
      interpret=True,
    )  # fmt: skip

  def reference(*operands):
    return per_assignment(activation, operands[0], ids, *operands[1:])

  loss = lambda fn: lambda *args: jnp.sum(fn(*args) * probe)
  argnums = tuple(range(len(operands)))
  grads = jax.grad(loss(fused), argnums)(*operands)
  want_grads = jax.grad(loss(reference), argnums)(*operands)
  assert_close(fused(*operands), reference(*operands), what="y")
  names = ("x", "weights", "w_gate_up", "w_down", "b_gate_up", "b_down")
  for what, g, w in zip(names[: len(operands)], grads, want_grads, strict=True):
    assert_close(g, w, what=f"d/d {what}")
  if not tokens:
    assert not np.any(fused(*operands)) and not np.any(grads[0])


def test_gradient_seeds_are_summed_in_the_weight_gradient_kernels():
  """With `grad_seeds` (a chunk loop's running sums) each matrix's gradient is its seed plus
  the call's own, bit for bit in float32 (summed once in the kernel, written over the seed),
  and the seeds get none; the other gradients are untouched."""
  operands, ids, probe = _operands(5, 24, 2, _uneven_ids(24, 2, seed=5))
  _, _, w_gate_up, w_down = operands
  keys = jax.random.split(jax.random.key(9))
  seeds = (jax.random.normal(keys[0], w_gate_up.shape), jax.random.normal(keys[1], w_down.shape))

  def loss(x, weights, w_gate_up, w_down, seeds):
    y = fused_moe_mlp(
      x, ids, weights, w_gate_up, w_down, activation=GatedActivation("silu").in_kernel,
      blocks=BLOCKS, interpret=True, grad_seeds=seeds,
    )  # fmt: skip
    return jnp.sum(y * probe)

  seeded = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*operands, seeds)
  plain = jax.grad(loss, argnums=(0, 1, 2, 3))(*operands, None)
  np.testing.assert_array_equal(seeded[2], plain[2] + seeds[0])
  np.testing.assert_array_equal(seeded[3], plain[3] + seeds[1])
  for got, want in zip(seeded[:2], plain[:2], strict=True):
    np.testing.assert_array_equal(got, want)
  assert not any(np.any(g) for g in seeded[4])


@pytest.mark.parametrize(
  "rhs_format, block",
  [q if q[0] == "nvfp4" else slow(*q) for q in QUANTIZED],
  ids=[q[0] for q in QUANTIZED],
)
def test_quantized_matrices_are_decoded_tile_by_tile(rhs_format, block):
  """`BlockScaled` matrices (constants): forward and the gradients of x and the routing
  weights against the per-assignment MLP on their values dequantized apart (NumPy), float32, with
  the biases; each read's blocks fit its scale blocks (nvfp4: 16 rows, 32 paired columns,
  the other way round read transposed)."""
  top_k = 2
  ids = _uneven_ids(24, top_k, seed=5)
  (x, weights, *_, b_gate_up, b_down), ids, probe = _operands(5, 24, top_k, ids, biased=True)
  keys = jax.random.split(jax.random.key(6))
  w_gate_up, gate_up_values = random_block_scaled(
    keys[0], (LOCAL_EXPERTS, D, 2 * F), rhs_format, block
  )
  w_down, down_values = random_block_scaled(keys[1], (LOCAL_EXPERTS, F, D), rhs_format, block)
  activation = GatedActivation("swiglu_oai", limit=1.5)

  def fused(x, weights):
    return fused_moe_mlp(
      x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, activation=activation.in_kernel,
      blocks=BLOCKS, interpret=True,
    )  # fmt: skip

  def reference(x, weights):
    values = (jnp.asarray(gate_up_values), jnp.asarray(down_values))
    return per_assignment(activation, x, ids, weights, *values, b_gate_up, b_down)

  loss = lambda fn: lambda *args: jnp.sum(fn(*args) * probe)
  assert_close(fused(x, weights), reference(x, weights), what="y")
  grads = jax.grad(loss(fused), (0, 1))(x, weights)
  want_grads = jax.grad(loss(reference), (0, 1))(x, weights)
  for what, g, w in zip(("x", "weights"), grads, want_grads, strict=True):
    assert_close(g, w, what=f"d/d {what}")


def _adapters(seed: int, rank: int) -> tuple[jax.Array, ...]:
  """Random (gate_up_a, gate_up_b, down_a, down_b) of `rank`, none zero."""
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = ((D, rank), (rank, 2 * F), (F, rank), (rank, D))
  return tuple(
    jax.random.normal(key, (LOCAL_EXPERTS, *shape)) / 4
    for key, shape in zip(keys, shapes, strict=True)
  )


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "mxfp4 base"])
def test_adapters_in_the_kernels_match_and_train(quantized):
  """LoRA adapters of rank 4 (padded to the blocks inside): forward and the gradients of x,
  the routing weights, the biases, the adapters (and the float matrices) against the
  per-assignment MLP; on an mxfp4 base (QLoRA), the adapters' forward columns come by
  parity beside the base's."""
  ids = _uneven_ids(24, 2, seed=8)
  operands, ids, probe = _operands(8, 24, 2, ids, biased=True)
  x, weights, w_gate_up, w_down, b_gate_up, b_down = operands
  base_values = (w_gate_up, w_down)
  if quantized:
    keys = jax.random.split(jax.random.key(9))
    w_gate_up, gate_up_values = random_block_scaled(keys[0], w_gate_up.shape, "mxfp4", (32, 1))
    w_down, down_values = random_block_scaled(keys[1], w_down.shape, "mxfp4", (32, 1))
    base_values = (jnp.asarray(gate_up_values), jnp.asarray(down_values))
  activation = GatedActivation("silu")
  trained = (x, weights, b_gate_up, b_down, _adapters(10, rank=4))
  trained += () if quantized else (w_gate_up, w_down)

  def fused(x, weights, b_gate_up, b_down, lora, *matrices):
    w = matrices or (w_gate_up, w_down)
    return fused_moe_mlp(
      x, ids, weights, *w, b_gate_up, b_down, lora, activation=activation.in_kernel,
      blocks=BLOCKS, interpret=True,
    )  # fmt: skip

  def reference(x, weights, b_gate_up, b_down, lora, *matrices):
    w = matrices or base_values
    return per_assignment(activation, x, ids, weights, *w, b_gate_up, b_down, lora)

  loss = lambda fn: lambda *args: jnp.sum(fn(*args) * probe)
  assert_close(fused(*trained), reference(*trained), what="y")
  argnums = tuple(range(len(trained)))
  grads = jax.grad(loss(fused), argnums)(*trained)
  want_grads = jax.grad(loss(reference), argnums)(*trained)
  names = ("x", "weights", "b_gate_up", "b_down", "lora", "w_gate_up", "w_down")
  for what, g, w in zip(names, grads, want_grads, strict=False):
    jax.tree.map(lambda g, w, what=what: assert_close(g, w, what=f"d/d {what}"), g, w)


def fp8_recipe_written_out(
  activation, x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, probe
):
  """The fused path's compute_quant="fp8_deepseek", one local expert at a time (its
  assignments in token order, as the kernels lay them out): (y, the gradients of x, the
  routing weights, both matrices and both biases for the loss sum(y * probe)), every product
  on operands quantized by `fake_quantized` and dequantized, float32 at full precision; the
  weight gradients' operands along the expert's rows in groups of 128."""
  top_k, (experts, hidden_width, _) = ids.shape[1], w_down.shape
  product = lambda a, b: jnp.dot(a, b, precision="highest")
  per_row = lambda a: fake_quantized(a, (1, 128))
  per_block = lambda w: fake_quantized(w, (128, 128))
  along_tokens = lambda a: fake_quantized(jnp.pad(a, ((0, -len(a) % 128), (0, 0))), (128, 1))
  x_q, probe_q = per_row(x), per_row(probe)
  y, d_x = jnp.zeros(x.shape), jnp.zeros(x.shape)
  d_weights = jnp.zeros(ids.shape)
  d_matrices = [jnp.zeros_like(w_gate_up), jnp.zeros_like(w_down)]
  d_biases = [jnp.zeros_like(b_gate_up), jnp.zeros_like(b_down)]
  for e in range(experts):
    assignments = np.flatnonzero(np.asarray(ids).reshape(-1) == e)
    if not len(assignments):
      continue
    source, choice = assignments // top_k, assignments % top_k
    weight = weights[source, choice][:, None]
    gate_up = product(x_q[source], per_block(w_gate_up[e])) + b_gate_up[e][None]
    hidden, activation_vjp = jax.vjp(
      activation, gate_up[:, :hidden_width], gate_up[:, hidden_width:]
    )
    out = product(per_row(hidden), per_block(w_down[e])) + b_down[e][None]
    y = y.at[source].add(weight * out)
    d_raw = product(probe_q[source], per_block(w_down[e]).T)
    d_pre = jnp.concatenate(activation_vjp(weight * d_raw), axis=1)
    d_x = d_x.at[source].add(product(per_row(d_pre), per_block(w_gate_up[e]).T))
    d_weights = d_weights.at[source, choice].set(
      jnp.sum(d_raw * hidden, axis=1) + probe[source] @ b_down[e]
    )
    weighted_probe = weight * probe[source]
    d_matrices[0] = d_matrices[0].at[e].set(product(along_tokens(x[source]).T, along_tokens(d_pre)))
    d_matrices[1] = (
      d_matrices[1].at[e].set(product(along_tokens(hidden).T, along_tokens(weighted_probe)))
    )
    d_biases[0] = d_biases[0].at[e].set(jnp.sum(d_pre, axis=0))
    d_biases[1] = d_biases[1].at[e].set(jnp.sum(weighted_probe, axis=0))
  return y, (d_x, d_weights, *d_matrices, *d_biases)


def assert_equal_but_rounding_flips(got, want, what: str, flips: int = 3) -> None:
  """got [units, n] equals want to 1e-5 (each unit's error over want's Frobenius norm) but
  for at most `flips` units, off by at most 1e-3 (measured at 1100 tokens x 4: one row of
  dx, one column of dW_gate_up, 1e-4 each)."""
  errors = np.sort(np.linalg.norm(got - want, axis=1)) / np.linalg.norm(want)
  assert errors[-flips - 1] <= 1e-5 and errors[-1] <= 1e-3, (what, errors[-flips - 1 :])


@pytest.mark.parametrize("tokens, top_k", [(160, 2), slow(1100, 4)], ids=["160x2", "1100x4"])
def test_fp8_compute_is_the_recipe_written_out_forward_and_backward(tokens, top_k):
  """compute_quant="fp8_deepseek" (e4m3 products scaled per 128 of the contraction, float32
  sums): the output and every gradient equal the recipe written out (1e-5, relative; but
  for a few rounding flips where a value is quantized that the kernels and the recipe
  compute an ulp apart), and differ from the unquantized MLP (> 1e-3: the quantization
  happens). Uneven loads: one expert's rows span two of the weight gradients' token groups
  (147 rows; at 1100 tokens x 4 choices 2184 rows, 18 groups), one expert is empty, a
  quarter of the assignments are held elsewhere; with biases."""
  hidden_width = 128
  ids = _uneven_ids(tokens, top_k, seed=2)
  keys = jax.random.split(jax.random.key(7), 7)
  x = jax.random.normal(keys[0], (tokens, 128))
  weights = jax.random.uniform(keys[1], ids.shape, minval=0.1)
  w_gate_up = jax.random.normal(keys[2], (LOCAL_EXPERTS, 128, 2 * hidden_width)) / 8
  w_down = jax.random.normal(keys[3], (LOCAL_EXPERTS, hidden_width, 128)) / 8
  b_gate_up = jax.random.normal(keys[4], (LOCAL_EXPERTS, 2 * hidden_width)) / 2
  b_down = jax.random.normal(keys[5], (LOCAL_EXPERTS, 128)) / 2
  probe = jax.random.normal(keys[6], x.shape)
  operands = (x, weights, w_gate_up, w_down, b_gate_up, b_down)
  activation = GatedActivation("silu").in_kernel
  fused = lambda x, *rest: fused_moe_mlp(
    x, ids, *rest, activation=activation, interpret=True, compute_quant="fp8_deepseek"
  )
  y, fused_vjp = jax.vjp(fused, *operands)
  want_y, want_grads = fp8_recipe_written_out(activation, x, ids, *operands[1:], probe)
  # What one rounding flip moves (a value the kernels and the recipe compute an ulp apart, on
  # an e4m3 boundary), as the rows of [units, n]: hidden's per row, a row of y; d(gate|up)'s
  # per token, a row of dx; d(gate|up)'s along the tokens, a column of an expert's
  # dW_gate_up; hidden's along them, a row of its dW_down. The other arrays' quantized
  # operands are the inputs': no flip.
  flip_units = {
    "y": lambda a: a,
    "x": lambda a: a,
    "w_gate_up": lambda a: jnp.swapaxes(a, 1, 2).reshape(-1, a.shape[1]),
    "w_down": lambda a: a.reshape(-1, a.shape[2]),
  }
  names = ("y", "x", "weights", "w_gate_up", "w_down", "b_gate_up", "b_down")
  for name, got, want in zip(names, (y, *fused_vjp(probe)), (want_y, *want_grads), strict=True):
    if name in flip_units:
      units = flip_units[name]
      assert_equal_but_rounding_flips(np.asarray(units(got)), np.asarray(units(want)), name)
    else:
      assert relative_error(got, want) <= 1e-5, (name, relative_error(got, want))
  unquantized = per_assignment(GatedActivation("silu"), x, ids, *operands[1:])
  assert relative_error(y, unquantized) > 1e-3


@pytest.mark.slow
def test_a_call_past_the_largest_tiles_default_blocks():
  """1100 tokens of 4 choices (4400 assignments: `default_blocks`' 64-row tiles, ~70 of them)
  with the blocks the kernels pick: forward and every gradient against the per-assignment
  MLP, float32 (the gradients relative to their largest value: the weights' sum ~1100 rows
  each, in another order)."""
  tokens, top_k = 1100, 4
  ids = _uneven_ids(tokens, top_k, seed=11)
  operands, ids, probe = _operands(11, tokens, top_k, ids)
  activation = GatedActivation("silu")
  fused = lambda *a: fused_moe_mlp(
    a[0], ids, *a[1:], activation=activation.in_kernel, interpret=True
  )
  reference = lambda *a: per_assignment(activation, a[0], ids, *a[1:])
  assert_close(fused(*operands), reference(*operands), what="y")
  loss = lambda fn: lambda *args: jnp.sum(fn(*args) * probe)
  argnums = tuple(range(len(operands)))
  grads = jax.grad(loss(fused), argnums)(*operands)
  want_grads = jax.grad(loss(reference), argnums)(*operands)
  for what, g, w in zip(("x", "weights", "w_gate_up", "w_down"), grads, want_grads, strict=True):
    assert relative_error(g, w) <= 1e-5, (what, relative_error(g, w))


@pytest.mark.slow
def test_bfloat16_within_its_tolerance():
  operands, ids, _ = _operands(7, 40, 2, _uneven_ids(40, 2, seed=7), jnp.bfloat16)
  got = fused_moe_mlp(
    operands[0], ids, *operands[1:], activation=GatedActivation("silu"), blocks=BLOCKS,
    interpret=True,
  )  # fmt: skip
  want = per_assignment(
    GatedActivation("silu"), *(o.astype(jnp.float32) for o in operands[:1]), ids, operands[1],
    *(o.astype(jnp.float32) for o in operands[2:]),
  )  # fmt: skip
  assert got.dtype == jnp.float32
  assert_close(got, want, jnp.bfloat16, what="y")


def test_the_layout_counts_without_sorting():
  """Each expert's assignments fill whole tiles in token order; others get no row."""
  ids = jnp.array([[3, 0], [3, 9], [0, 3], [-1, 3]])
  layout = counted_layout(ids, local_experts=4, block_m=2)
  # expert 0: assignments 1, 4 (tile 0); expert 3: 0, 2, 5, 7 (tiles 1, 2)
  assert layout.slot.tolist() == [[2, 0], [3, 14], [1, 4], [14, 5]]
  assert layout.row_assignment.tolist()[:6] == [1, 4, 0, 2, 5, 7]
  assert set(layout.row_assignment.tolist()[6:]) == {8}
  assert layout.tile_expert.tolist()[:3] == [0, 3, 3] and int(layout.num_tiles[0]) == 3
  assert layout.tile_ends.tolist() == [1, 1, 1, 3]


CONFIG = MoEConfig(
  num_experts=8, top_k=2, hidden_size=16, intermediate_size=32, expert_backend="fused"
)
# Beside the fused experts: zero-computation experts and a shared expert, both outside them;
# the experts' biases inside.
AROUND = dict(
  num_zero_experts=2, num_shared_experts=1, shared_intermediate_size=16, expert_bias=True
)


NORMED = dict(expert_output_norm_eps=1e-6)  # Muse Spark's post_expert_norm


@pytest.mark.parametrize(
  "mesh_shape, dispatch, normed",
  [
    (None, "all_gather", {}),
    (None, "all_gather", NORMED),
    slow((2, 4), "all_gather", {}),
    slow((2, 4), "all_to_all", NORMED),
  ],
  ids=["one device", "one device output norm", "2x4 all_gather", "2x4 all_to_all output norm"],
)
def test_the_layer_matches_the_reference(mesh_shape, dispatch, normed):
  """The layer on the fused path, with zero experts, a shared expert and the experts' biases,
  and with each expert's output RMS-normalized before its weight (in XLA, between the
  kernels and the sum over choices), padding poisoned with NaN (a rank with no tokens: chunks
  all padding): output and the gradients of x and every parameter against `reference_moe`."""
  config = dataclasses.replace(CONFIG, **AROUND, **normed, chunk_size=4, dispatch=dispatch)
  keys = jax.random.split(jax.random.key(3))
  params = random_params(config, keys[0])
  x = jax.random.normal(keys[1], (48, config.hidden_size))
  mask = rank_mask([6, 0, 5, 3, 6, 1, 6, 2], 6)
  check_against_reference(params, x, config, mesh_shape and mesh_of(*mesh_shape), mask, seed=4)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (
      dict(expert_quant="nvfp4"),  # paired columns: 32 a tile
      "the fused kernels need hidden_size=16 to be a multiple of 32",
    ),
    (
      dict(intermediate_size=24),
      "the fused kernels need intermediate_size=24 to be a multiple of 16",
    ),
  ],
)
def test_a_case_the_kernels_lack_falls_back_with_the_reason(overrides, message):
  config = dataclasses.replace(CONFIG, **overrides)
  fallback = "^expert_backend='fused' falls back to the XLA tile loop: "
  with pytest.warns(UserWarning, match=fallback + message):
    assert plan_experts(config, num_rows=64, local_experts=2) == ExpertPlan(path="tile_loop")


def test_the_plan_takes_the_fused_path():
  """At the kernels' blocks, or with `batch_invariant` at blocks fixed whatever the call's
  size (tests/test_batch_invariance.py checks a token's output does not change)."""
  with pytest.warns(UserWarning, match="runs the Pallas kernels in the interpreter"):
    plan = plan_experts(CONFIG, num_rows=64, local_experts=2)
  assert plan == ExpertPlan(path="fused", backend="triton", interpret=True)
  invariant = dataclasses.replace(CONFIG, batch_invariant=True)
  fixed = batch_invariant_blocks(CONFIG.hidden_size, CONFIG.intermediate_size)
  for rows in (2, 64, 8192):
    with pytest.warns(UserWarning, match="runs the Pallas kernels in the interpreter"):
      plan = plan_experts(invariant, num_rows=rows, local_experts=2)
    assert plan == ExpertPlan(path="fused", backend="triton", interpret=True, blocks=fixed)


def test_a_shape_that_disagrees_is_named():
  (x, weights, w_gate_up, w_down), ids, _ = _operands(0, 16, 2, _uneven_ids(16, 2, seed=0))
  call = lambda **changed: fused_moe_mlp(
    **dict(x=x, expert_ids=ids, weights=weights, w_gate_up=w_gate_up, w_down=w_down) | changed,
    activation=GatedActivation("silu"), blocks=BLOCKS, interpret=True,
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"^weights has shape \(16, 3\); expected \(16, 2\)$"):
    call(weights=jnp.ones((16, 3)))
  with pytest.raises(
    ValueError, match=r"^w_gate_up has shape \(4, 32, 32\); expected \(4, 32, 64\)$"
  ):
    call(w_gate_up=w_gate_up[..., :32])
  with pytest.raises(ValueError, match=r"^b_down has shape \(4, 16\); expected \(4, 32\)$"):
    call(b_gate_up=jnp.zeros((4, 64)), b_down=jnp.zeros((4, 16)))
  with pytest.raises(ValueError, match="b_gate_up and b_down are given together or not at all"):
    call(b_down=jnp.zeros((4, 32)))
  lora = _adapters(1, rank=4)
  with pytest.raises(
    ValueError, match=r"^lora.down_b has shape \(4, 4, 16\); expected \(4, 4, 32\)$"
  ):
    call(lora=(*lora[:3], lora[3][..., :16]))
  with pytest.raises(ValueError, match="fp8_matrices are read under compute_quant only"):
    call(fp8_matrices=(fp8_matrix(w_gate_up), fp8_matrix(w_down)))
  narrow = (fp8_matrix(w_gate_up), fp8_matrix(w_down[..., :16]))
  with pytest.raises(
    ValueError, match=r"^fp8_matrices' w_down has shape \(4, 32, 16\); expected \(4, 32, 32\)$"
  ):
    call(compute_quant="fp8_deepseek", fp8_matrices=narrow)
  with pytest.raises(
    ValueError, match=r"^grad_seeds' w_gate_up has shape \(4, 32, 32\); expected \(4, 32, 64\)$"
  ):
    call(grad_seeds=(w_gate_up[..., :32], w_down))
