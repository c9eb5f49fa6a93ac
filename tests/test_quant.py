"""Quantized experts (`moejax.quant`, `BlockScaled`): the formats bit for bit against NumPy
and ml_dtypes, the layer against a reference on independently dequantized weights, gradients,
compiled memory, and bad input."""

from __future__ import annotations

import contextlib
import dataclasses

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.compat import triton_missing_reason
from kernels_pallas.quantized import BlockScaled
from moejax import MoEConfig, MoELayer, MoEParams, checkpoint, moe_apply, quant, reference_moe
from moejax.layer import QuantizedWeight
from moejax.models import shard_model
from moejax.testing import random_params, rank_mask
from tests.helpers import assert_close, check_layer, mesh_of, seed_of, slow, tolerance

BASE = dict(num_experts=8, top_k=2, hidden_size=64, intermediate_size=64, chunk_size=8)
FP8 = dict(expert_quant="fp8_block", quant_block_size=(32, 32))
MXFP4 = dict(expert_quant="mxfp4")
INT4 = dict(expert_quant="int4_group", quant_block_size=(32, 1))
NVFP4 = dict(expert_quant="nvfp4")
GPT_OSS = dict(
  **MXFP4,
  activation="swiglu_oai",
  swiglu_limit=1.0,
  expert_bias=True,
  router_bias=True,
  renormalize=True,
)


def numpy_quantize(w: np.ndarray, expert_quant: str, block):
  """The formats written out in NumPy float32 with ml_dtypes: (values, scales, global scale
  or None)."""
  w = np.asarray(w, np.float32)
  *lead, rows, cols = w.shape
  bi, bo = block
  padded = np.zeros((*lead, -(-rows // bi) * bi, -(-cols // bo) * bo), np.float32)
  padded[..., :rows, :cols] = w
  blocks = padded.reshape(*lead, padded.shape[-2] // bi, bi, padded.shape[-1] // bo, bo)
  amax = np.abs(blocks).max(axis=(-3, -1))  # [..., in/bi, out/bo]
  inverse = None
  if expert_quant == "nvfp4":  # compressed-tensors' tensor_group rule: g = 448 * 6 / amax,
    # rounded as torch computes a number over a tensor (through the tensor's reciprocal)
    inverse = (np.float32(1) / amax.max(axis=(-2, -1), keepdims=True)) * np.float32(2688)
    scales = np.clip(inverse * (amax / np.float32(6)), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    scales = np.where(scales > 0, scales.astype(np.float32), np.float32(1))
    dtypes = (ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn)
  elif expert_quant == "fp8_block":
    scales = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    dtypes = (ml_dtypes.float8_e4m3fn, np.float32)
  elif expert_quant == "int4_group":  # compressed-tensors' symmetric rule, bf16 scales
    scales = np.where(amax > 0, amax / np.float32(7.5), np.float32(1)).astype(np.float32)
    scales = scales.astype(ml_dtypes.bfloat16).astype(np.float32)
    dtypes = (ml_dtypes.int4, ml_dtypes.bfloat16)
  else:
    exponent = np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2
    scales = np.where(amax > 0, np.exp2(exponent), 1).astype(np.float32)
    dtypes = (ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e8m0fnu)
  full = np.repeat(np.repeat(scales, bi, axis=-2), bo, axis=-1)[..., :rows, :cols]
  values = w / (full if inverse is None else full / inverse)
  if expert_quant in ("mxfp4", "nvfp4"):
    values = np.clip(values, -6, 6)
  if expert_quant == "int4_group":
    values = np.clip(np.round(values), -8, 7)  # half to even, as torch.round
  global_scale = None if inverse is None else np.broadcast_to(1 / inverse[..., 0], (*lead, cols))
  return values.astype(dtypes[0]), scales.astype(dtypes[1]), global_scale


def numpy_dequantize(w: BlockScaled) -> np.ndarray:
  """values * (scales * global scale) broadcast over blocks, in NumPy (ml_dtypes casts):
  the scales' product in float32 as the format defines it, the rest in float64."""
  values = np.asarray(w.values).astype(np.float64)
  scales = np.asarray(w.scales).astype(np.float32)
  *_, rows, cols = values.shape
  full = np.repeat(np.repeat(scales, w.block[0], axis=-2), w.block[1], axis=-1)[..., :rows, :cols]
  if w.global_scale is not None:
    full = full * np.asarray(w.global_scale, np.float32)[..., None, :]
  return values * full


def as_bits(a) -> np.ndarray:
  a = np.asarray(a)
  if a.dtype == ml_dtypes.int4:  # no bit view of a 4-bit type: its integers are its codes
    return a.astype(np.int8)
  return a.view({1: np.uint8, 2: np.uint16}.get(a.dtype.itemsize, np.uint32))


@pytest.mark.parametrize(
  "expert_quant, block",
  [
    ("fp8_block", (32, 32)),
    ("fp8_block", (16, 48)),
    ("mxfp4", (32, 1)),
    ("int4_group", (32, 1)),
    ("nvfp4", (16, 1)),
  ],
)
def test_quantize_matches_numpy_bit_for_bit(expert_quant, block, request):
  w = 3.0 * jax.random.normal(jax.random.key(seed_of(request.node.name)), (3, 64, 80))
  w = w.at[1, :32, :].set(0.0)  # a block of zeros: scale 1
  got = quant.quantize(w, expert_quant, block)
  values, scales, global_scale = numpy_quantize(np.asarray(w), expert_quant, block)
  assert got.block == block
  chex.assert_trees_all_equal(as_bits(got.values), as_bits(values))
  chex.assert_trees_all_equal(as_bits(got.scales), as_bits(scales))
  chex.assert_trees_all_equal(
    None if got.global_scale is None else as_bits(got.global_scale),
    None if global_scale is None else as_bits(global_scale),
  )
  chex.assert_trees_all_equal(
    np.asarray(got.dequantize()), numpy_dequantize(got).astype(np.float32)
  )


@pytest.mark.parametrize(
  "expert_quant, block", [("fp8_block", (32, 32)), ("mxfp4", (32, 1)), ("nvfp4", (16, 1))]
)
def test_padding_and_column_halves_keep_the_weight(expert_quant, block, request):
  """`BlockScaled.pad` appends zeros (any scale covers them) and `split_columns` /
  `concatenate_columns` cut and rejoin whole scale blocks: dequantized, each equals the
  same operation on the NumPy-dequantized weight."""
  w = jax.random.normal(jax.random.key(seed_of(request.node.name)), (2, 80, 128))
  q = quant.quantize(w, expert_quant, block)
  plain = numpy_dequantize(q).astype(np.float32)
  padded = q.pad(-2, 96).pad(-1, 160)
  assert padded.scales.shape == padded.expected_scales_shape()
  want = np.zeros((2, 96, 160), np.float32)
  want[:, :80, :128] = plain
  np.testing.assert_array_equal(np.asarray(padded.dequantize()), want)
  halves = q.split_columns(2)
  for half, columns in zip(halves, np.split(plain, 2, axis=-1), strict=True):
    np.testing.assert_array_equal(np.asarray(half.dequantize()), columns)
  joined = BlockScaled.concatenate_columns(halves)
  np.testing.assert_array_equal(np.asarray(joined.dequantize()), plain)
  with pytest.raises(ValueError, match="whole 32-column blocks"):
    quant.quantize(w[..., :96], "fp8_block", (32, 32)).split_columns(2)


def test_mxfp4_codes_and_scales_are_the_ocp_ones():
  """Every e2m1 magnitude round-trips; scales are exact powers of two (e8m0 byte 127 + k)."""
  codes = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
  w = 4 * np.concatenate([codes, -codes, codes, -codes]).reshape(32, 1)
  got = quant.quantize(jnp.asarray(w), "mxfp4", (32, 1))
  assert np.asarray(got.scales).view(np.uint8).tolist() == [[129]]  # amax 24: 2^(4-2)
  chex.assert_trees_all_equal(np.asarray(got.dequantize()), w)


class TestLayer:
  """The layer on quantized experts against `reference_moe` on weights dequantized by NumPy."""

  def check(self, config: MoEConfig, mesh_shape, name: str, gradients=True):
    """Quantizes random weights as `config` asks; compares y and the gradients of x and the
    float parameters with the float32 reference on NumPy-dequantized weights. The quantized
    weights are differentiated too: their cotangents must be zero (they are constants)."""
    key = jax.random.key(seed_of(name))
    unquantized = dataclasses.replace(config, expert_quant=None)
    params, config = quant.quantize_experts(
      random_params(unquantized, key), unquantized, config.expert_quant
    )
    dequantized = {
      "w_gate_up": jnp.asarray(numpy_dequantize(params.w_gate_up), jnp.float32),
      "w_down": jnp.asarray(numpy_dequantize(params.w_down), jnp.float32),
    }
    float_config = dataclasses.replace(unquantized, dtype=jnp.float32)
    x = 2.0 * jax.random.normal(jax.random.fold_in(key, 1), (8 * 9, config.hidden_size))
    mask = rank_mask([0, 4, 9, 2, 0, 7, 1, 9], 9)
    mesh = None if mesh_shape is None else mesh_of(*mesh_shape)
    trainable = params._replace(w_gate_up=None, w_down=None)

    def float_gradients(got: MoEParams) -> MoEParams:
      for leaf in jax.tree.leaves((got.w_gate_up, got.w_down)):
        # Integer leaves get float0 cotangents; e8m0 (mxfp4's scales) cannot hold a zero.
        if leaf.dtype not in (jax.dtypes.float0, jnp.float8_e8m0fnu):
          assert not np.any(np.asarray(leaf, np.float32)), "a quantized weight got a gradient"
      return got._replace(w_gate_up=None, w_down=None)

    check_layer(
      lambda p, x, mask: moe_apply(p, x, config=config, mesh=mesh, token_mask=mask)[0],
      lambda p, x, mask: reference_moe(p._replace(**dequantized), x, float_config, mask),
      params,
      x,
      mask,
      seed=seed_of(name) + 2,
      dtype=config.dtype,
      reference_params=trainable,
      gradients_of=float_gradients,
      gradients=gradients,
    )

  @pytest.mark.parametrize(
    "expert_quant, mesh_shape, dispatch",
    [
      slow(FP8, None, "all_gather"),
      (FP8, (2, 4), "all_to_all"),
      ({**MXFP4, "expert_fsdp": True}, (2, 4), "all_gather"),
      slow(MXFP4, (1, 8), "all_to_all"),
      ({**INT4, "num_shared_experts": 1, "shared_intermediate_size": 32}, (2, 4), "all_to_all"),
      ({**NVFP4, "expert_fsdp": True}, (2, 4), "all_to_all"),
    ],
    ids=[
      "fp8-no mesh",
      "fp8-2x4-all_to_all",
      "mxfp4-2x4-all_gather-fsdp",
      "mxfp4-1x8-all_to_all",
      "int4-2x4-all_to_all-shared",
      "nvfp4-2x4-all_to_all-fsdp",
    ],
  )
  def test_matches_the_dequantized_reference(self, expert_quant, mesh_shape, dispatch, request):
    config = MoEConfig(**BASE, **expert_quant, dispatch=dispatch)
    self.check(config, mesh_shape, request.node.name)

  @pytest.mark.parametrize("expert_quant", [FP8, MXFP4], ids=["fp8_block", "mxfp4"])
  def test_bfloat16_compute(self, expert_quant, request):
    config = MoEConfig(**BASE, **expert_quant, dtype=jnp.bfloat16)
    self.check(config, (2, 4), request.node.name, gradients=False)

  def test_gpt_oss_mxfp4_with_biases_and_shared_experts(self, request):
    config = MoEConfig(**BASE, **GPT_OSS, num_shared_experts=1, shared_intermediate_size=32)
    self.check(config, (2, 4), request.node.name)

  @pytest.mark.filterwarnings("ignore:expert_backend='pallas' on a CPU:UserWarning")
  @pytest.mark.parametrize(
    "expert_quant, mesh_shape, dtype",
    [
      (FP8, None, jnp.float32),
      (MXFP4, (2, 4), jnp.float32),
      slow(FP8, (2, 4), jnp.bfloat16),
      slow(MXFP4, None, jnp.bfloat16),
      ({**INT4, "quant_block_size": (64, 1)}, None, jnp.bfloat16),
      (NVFP4, (2, 4), jnp.float32),
    ],
    ids=["fp8_block", "mxfp4", "fp8_block-bf16", "mxfp4-bf16", "int4_group-64-bf16", "nvfp4"],
  )
  def test_pallas_kernels_dequantize_tile_by_tile(self, expert_quant, mesh_shape, dtype, request):
    """expert_backend="pallas" runs the kernel that takes the format (Triton, interpreted
    here), not the tile loop: y (and in float32 the gradients of x and the router) match the
    reference."""
    from kernels_pallas.backends import select_kernel
    from moejax.plan import expert_case, plan_experts

    config = MoEConfig(**BASE, **expert_quant, expert_backend="pallas", dtype=dtype)
    if select_kernel(expert_case(config)) is None:
      pytest.skip(str(triton_missing_reason()))
    with pytest.warns(UserWarning, match="in the interpreter"):
      assert plan_experts(config, num_rows=64, local_experts=2).path == "pallas"
    self.check(config, mesh_shape, request.node.name, gradients=dtype == jnp.float32)

  @pytest.mark.filterwarnings("ignore:expert_backend='fused' on a CPU:UserWarning")
  @pytest.mark.parametrize(
    "expert_quant, mesh_shape, dtype",
    [
      (GPT_OSS, None, jnp.float32),
      slow(FP8, (2, 4), jnp.float32),
      slow({**INT4, "quant_block_size": (64, 1)}, None, jnp.bfloat16),
      slow(NVFP4, (2, 4), jnp.float32),
    ],
    ids=["gpt-oss-mxfp4-biases", "fp8_block-2x4", "int4_group-64-bf16", "nvfp4-2x4"],
  )
  def test_the_fused_path_decodes_tile_by_tile(self, expert_quant, mesh_shape, dtype, request):
    """expert_backend="fused" runs quantized experts in its kernels (interpreted here), not
    the tile loop: y (and in float32 the gradients of x, the router and the biases) match
    the reference."""
    from moejax.plan import plan_experts

    config = MoEConfig(**BASE, **expert_quant, expert_backend="fused", dtype=dtype)
    if triton_missing_reason() is not None:
      pytest.skip(str(triton_missing_reason()))
    with pytest.warns(UserWarning, match="in the interpreter"):
      assert plan_experts(config, num_rows=64, local_experts=2).path == "fused"
    self.check(config, mesh_shape, request.node.name, gradients=dtype == jnp.float32)


def test_compiled_temporaries_hold_no_dequantized_copy():
  """E=32 experts of D=F=256: the compiled layer's temporary memory with quantized experts
  stays well under the dequantized weights' size, and the parameters shrink as the formats
  promise at their bit widths (fp8 ~0.5x of bf16, mxfp4 ~0.27x, int4 with bf16 scales per 32
  and nvfp4 with e4m3 scales per 16 ~0.28x; XLA:CPU stores a 4-bit value in a byte)."""
  config = MoEConfig(num_experts=32, top_k=2, hidden_size=256, intermediate_size=256)
  params = random_params(config, jax.random.key(0))
  x = jnp.zeros((64, 256), jnp.float32)
  bits = lambda leaf: leaf.size * jax.dtypes.itemsize_bits(leaf.dtype)
  nbytes = lambda tree: sum(bits(leaf) for leaf in jax.tree.leaves(tree)) // 8
  experts_bf16 = nbytes((params.w_gate_up, params.w_down)) // 2
  formats = (("fp8_block", 0.5), ("mxfp4", 0.27), ("int4_group", 0.28), ("nvfp4", 0.28))
  for expert_quant, ratio in formats:
    quantizable = dataclasses.replace(config, quant_block_size=(32, 1))
    if expert_quant == "fp8_block":
      quantizable = config
    qparams, qconfig = quant.quantize_experts(params, quantizable, expert_quant)
    stored = nbytes((qparams.w_gate_up, qparams.w_down))
    assert stored <= 1.05 * ratio * experts_bf16, (expert_quant, stored / experts_bf16)
    run = jax.jit(lambda p, x, c=qconfig: moe_apply(p, x, config=c)[0])
    temp = run.lower(qparams, x).compile().memory_analysis().temp_size_in_bytes
    dequantized_f32 = 2 * experts_bf16
    assert temp < 0.25 * dequantized_f32, (expert_quant, temp, dequantized_f32)


@pytest.mark.parametrize(
  "inside_set_mesh", [True, slow(False)], ids=["in set_mesh", "outside set_mesh"]
)
def test_quantized_and_referenced_on_an_explicit_axes_mesh(inside_set_mesh, request):
  """A layer's parameters on `jax.make_mesh`'s explicit axes: every format quantizes them
  keeping their expert split, bit for bit as whole arrays do, and the reference takes them
  as they are, inside `jax.set_mesh` or not."""
  config = MoEConfig(**{**BASE, "quant_block_size": (32, 1)})
  mesh = jax.make_mesh((2, 4), ("data", "expert"))  # explicit axes by default
  layer = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(seed_of(request.node.name)))
  x = jax.random.normal(jax.random.key(1), (8, config.hidden_size))
  whole = jax.device_get(layer.moe_params())
  with jax.set_mesh(mesh) if inside_set_mesh else contextlib.nullcontext():
    sharded = layer.moe_params()
    assert_close(reference_moe(sharded, x, config), reference_moe(whole, x, config), what="y")
    for expert_quant in ("mxfp4", "int4_group", "nvfp4"):
      quantized, _ = quant.quantize_experts(sharded, config, expert_quant)
      assert quantized.w_gate_up.values.sharding.spec[0] == "expert", expert_quant
      expected, _ = quant.quantize_experts(whole, config, expert_quant)
      chex.assert_trees_all_equal(jax.device_get(quantized), expected)


def test_dequantize_experts_inverts_the_format(request):
  config = MoEConfig(**BASE)
  params = random_params(config, jax.random.key(seed_of(request.node.name)))
  qparams, qconfig = quant.quantize_experts(params, config, "mxfp4")
  back, back_config = quant.dequantize_experts(qparams, qconfig)
  assert back_config == config
  chex.assert_trees_all_close(back.w_down, numpy_dequantize(qparams.w_down).astype(np.float32))


class TestBadInput:
  def quantized(self):
    config = MoEConfig(**BASE)
    return quant.quantize_experts(random_params(config, jax.random.key(0)), config, "mxfp4")

  def test_block_must_not_straddle_gate_and_up(self):
    with pytest.raises(ValueError, match=r"intermediate_size=64 must be a multiple of"):
      MoEConfig(**{**BASE, "intermediate_size": 64}, expert_quant="fp8_block",
                quant_block_size=(32, 48))  # fmt: skip

  def test_mxfp4_needs_multiples_of_32(self):
    with pytest.raises(ValueError, match="hidden_size=48 must be a multiple of 32"):
      MoEConfig(**{**BASE, "hidden_size": 48}, expert_quant="mxfp4")

  def test_unknown_format(self):
    with pytest.raises(ValueError, match="expert_quant must be one of"):
      MoEConfig(**BASE, expert_quant="int4")

  def test_plain_weights_under_a_quantized_config(self):
    params, config = self.quantized()
    plain = params._replace(w_down=jnp.ones((8, 64, 64)))
    with pytest.raises(ValueError, match=r"params\.w_down must be a BlockScaled"):
      moe_apply(plain, jnp.ones((4, 64)), config=config)

  def test_quantized_weights_under_a_float_config(self):
    params, config = self.quantized()
    with pytest.raises(ValueError, match=r"params\.w_gate_up is a BlockScaled but the config"):
      moe_apply(params, jnp.ones((4, 64)), config=dataclasses.replace(config, expert_quant=None))

  @pytest.mark.parametrize(
    "change, match",
    [
      (lambda w: BlockScaled(w.values, w.scales[:, :1], w.block), "scales shape"),
      (lambda w: BlockScaled(w.values, w.scales.astype(jnp.float32), w.block), "scales dtype"),
      (lambda w: BlockScaled(w.values.astype(jnp.float8_e4m3fn), w.scales, w.block), "values"),
      (lambda w: BlockScaled(w.values, w.scales, (16, 1)), "block"),
      (
        lambda w: BlockScaled(w.values, w.scales, w.block, jnp.ones((8, w.shape[-1]))),
        r"global_scale \(dtype, shape\) \('float32', \(8, 128\)\), expected None",
      ),
    ],
    ids=["scale shape", "scale dtype", "value dtype", "block", "global scale"],
  )
  def test_a_blockscaled_that_disagrees_with_the_config(self, change, match):
    params, config = self.quantized()
    bad = params._replace(w_gate_up=change(params.w_gate_up))
    with pytest.raises(ValueError, match=f"params.w_gate_up has {match}"):
      jax.jit(lambda p: moe_apply(p, jnp.ones((4, 64)), config=config))(bad)


class TestNNX:
  """`MoELayer` with quantized experts: fixed weights out of optax's reach, sharded like float
  ones, saved and restored by orbax, and re-placed with redundant experts."""

  config = MoEConfig(**BASE, **MXFP4, num_redundant_experts=8)

  def test_trains_only_the_float_parameters(self):
    layer = MoELayer(self.config, rngs=nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(layer, QuantizedWeight))
    optimizer = nnx.Optimizer(layer, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (16, 64))

    @nnx.jit
    def step(layer, optimizer):
      _, grads = nnx.value_and_grad(lambda layer: jnp.sum(layer(x) ** 2))(layer)
      optimizer.update(layer, grads)
      return grads

    grads = step(layer, optimizer)
    assert {path[0] for path, _ in nnx.to_flat_state(grads)} == {"router_kernel"}
    chex.assert_trees_all_equal(nnx.state(layer, QuantizedWeight), before)

  def test_sharded_saved_restored_and_rebalanced(self, tmp_path):
    mesh = mesh_of(2, 4)
    layer = MoELayer(self.config, mesh=mesh, rngs=nnx.Rngs(0))
    shard_model(layer, mesh)
    expert_split = NamedSharding(mesh, P("expert", None, None))
    for leaf in jax.tree.leaves(nnx.state(layer, QuantizedWeight)):
      assert leaf.sharding.is_equivalent_to(expert_split, 3)
    x = jax.device_put(jax.random.normal(jax.random.key(2), (64, 64)), NamedSharding(mesh, P()))
    y = layer(x)
    checkpoint.save(tmp_path / "ckpt", layer)
    restored = MoELayer(self.config, mesh=mesh, rngs=nnx.Rngs(1))
    checkpoint.restore(tmp_path / "ckpt", restored)
    chex.assert_trees_all_equal(restored(x), y)
    layer.rebalance()
    chex.assert_trees_all_close(layer(x), y, **tolerance())
    for leaf in jax.tree.leaves(nnx.state(layer, QuantizedWeight)):
      assert leaf.sharding.is_equivalent_to(expert_split, 3)
