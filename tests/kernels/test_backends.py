"""One test base for every grouped-matmul backend; one subclass per backend.

On a CPU the Pallas kernels run in their interpreters (with small blocks); on a GPU
(`benchmarks/gpu_check.py` runs this file there) they run compiled, with their default blocks.
References are `jax.lax.ragged_dot` and plain `jnp` on float32 copies of the same inputs.
A case a backend cannot run must raise `NotImplementedError`, never fail deeper. Kernel calls
run under `jax.jit`: eager dispatch beside the interpreters' callback threads can deadlock
(seen with JAX 0.10's Mosaic GPU interpreter), and a GPU runs them jitted anyway.
"""

from __future__ import annotations

import dataclasses
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import MosaicBlocks, TritonBlocks, gmm, moe_mlp
from kernels_pallas.backends import BACKENDS, Case, unsupported_reason
from kernels_pallas.compat import jax_version
from kernels_pallas.gmm_xla import moe_mlp_reference
from kernels_pallas.ops import KernelSettings, transposed_grouped_matmul
from kernels_pallas.quantized import BlockScaled
from tests.helpers import assert_close, seed_of, slow

ON_GPU = jax.devices()[0].platform == "gpu"
INTERPRET = not ON_GPU
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
GRAD_ATOL = 2e-2  # fused MLP gradients, relative to their largest value
BF16_PRESET = jax.lax.DotAlgorithmPreset.BF16_BF16_F32


def random_sizes(key, groups: int, num_rows: int, empty: tuple[int, ...] = (1,)) -> jax.Array:
  """[G] sizes with the groups in `empty` at 0 and a sum a few rows short of M."""
  sizes = np.array(jax.random.randint(key, (groups,), 1, 2 * num_rows // groups))
  sizes[list(empty)] = 0
  ends = np.minimum(np.cumsum(sizes), num_rows - 5)
  return jnp.asarray(np.diff(ends, prepend=0), jnp.int32)


def past_sum_poisoned(lhs: jax.Array, sizes: jax.Array) -> jax.Array:
  """lhs with NaN in every row past the groups' sum: no kernel may read them."""
  rows = jnp.arange(lhs.shape[0])[:, None]
  return jnp.where(rows < jnp.sum(sizes), lhs, jnp.nan).astype(lhs.dtype)


def operands(name: str, m: int, k: int, n: int, groups: int, dtype):
  """Random lhs [M, K] and rhs [G, K, N] at unit output scale, and random sizes."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed_of(name)), 3)
  lhs = jax.random.normal(k1, (m, k)).astype(dtype)
  rhs = (jax.random.normal(k2, (groups, k, n)) / np.sqrt(k)).astype(dtype)
  return lhs, rhs, random_sizes(k3, groups, m)


def reference_gmm(lhs, rhs, sizes) -> jax.Array:
  """ragged_dot on float32 copies, at full float32 precision."""
  f32 = lambda a: a.astype(jnp.float32)
  return jax.lax.ragged_dot(f32(lhs), f32(rhs), sizes, precision=jax.lax.Precision.HIGHEST)


def random_block_scaled(key, shape, rhs_format: str, block) -> tuple[BlockScaled, np.ndarray]:
  """Random weights [G, in, out] in a format (every value code, scales around 1/sqrt(in)),
  and their float32 values dequantized by NumPy + ml_dtypes, apart from moejax's code."""
  k1, k2 = jax.random.split(key)
  groups, rows, cols = shape
  scales_shape = (groups, -(-rows // block[0]), -(-cols // block[1]))
  if rhs_format == "fp8_block":
    values = jnp.clip(jax.random.normal(k1, shape) * 100, -448, 448).astype(jnp.float8_e4m3fn)
    scales = jax.random.uniform(k2, scales_shape, minval=0.5, maxval=2.0) / (100 * rows**0.5)
  elif rhs_format == "int4_group":
    values = jax.random.randint(k1, shape, -8, 8).astype(jnp.int4)
    scales = jax.random.uniform(k2, scales_shape, minval=0.5, maxval=2.0) / (4 * rows**0.5)
    scales = scales.astype(jnp.bfloat16)
  elif rhs_format == "nvfp4":  # e4m3 scales of every mantissa, a global scale per column
    values = (jax.random.normal(k1, shape) * 2).astype(jnp.float4_e2m1fn)
    scales = jax.random.uniform(k2, scales_shape, minval=16.0, maxval=448.0)
    scales = scales.astype(jnp.float8_e4m3fn)
    global_scale = jax.random.uniform(k1, (groups, cols), minval=0.5, maxval=2.0)
    global_scale = global_scale / (1000 * rows**0.5)
  else:
    values = (jax.random.normal(k1, shape) * 2).astype(jnp.float4_e2m1fn)
    exponents = jax.random.randint(k2, scales_shape, -2, 0) - int(np.log2(rows)) // 2
    scales = jnp.exp2(exponents.astype(jnp.float32)).astype(jnp.float8_e8m0fnu)
  np_scales = np.asarray(scales).astype(np.float32)
  np_scales = np_scales.repeat(block[0], axis=1).repeat(block[1], axis=2)[:, :rows, :cols]
  if rhs_format != "nvfp4":
    global_scale = None
  else:
    np_scales = np_scales * np.asarray(global_scale)[:, None, :]
  weights = BlockScaled(values, scales, block, global_scale)
  return weights, np.asarray(values).astype(np.float32) * np_scales


# int4_group in groups of 64: the kernels take it in 32-row scale blocks (`kernel_form`).
QUANTIZED = [
  ("fp8_block", (64, 32)),
  ("mxfp4", (32, 1)),
  ("int4_group", (64, 1)),
  ("nvfp4", (16, 1)),
]


class GroupedMatmulTestBase:
  """The contract of `gmm`, `moe_mlp` and `tgmm` that every backend must meet."""

  implementation: str
  blocks = None  # blocks for the interpreters; None: the backend's defaults
  tgmm_blocks = None

  def kwargs(self, small_blocks: bool = True) -> dict:
    """Call arguments: small blocks in the interpreters (more tiles, more edges), unless the
    case is large enough that the interpreters' cost per tile dominates."""
    return dict(
      implementation=self.implementation,
      interpret=INTERPRET,
      config=self.blocks if INTERPRET and small_blocks else None,
    )

  def skip_unsupported(self, call, dtype, activation=None, precision=None, rhs_format=None) -> bool:
    """If the backend cannot run the case, checks that `call()` says so; returns whether."""
    case = Case(dtype, activation, precision=precision, rhs_format=rhs_format)
    reason = unsupported_reason(self.implementation, case)
    if reason is not None:
      with pytest.raises(NotImplementedError):
        call()
    return reason is not None

  @pytest.mark.parametrize(
    "dtype, out_dtype",
    [(F32, None), slow(BF16, None), slow(F32, BF16), slow(BF16, BF16), slow(F32, F32), (BF16, F32)],
    ids=lambda d: str(d),
  )
  def test_gmm_matches_ragged_dot(self, dtype, out_dtype, request):
    lhs, rhs, sizes = operands(request.node.name, 128, 64, 96, 8, dtype)
    # float32 inputs at full precision: a GPU's default would round them to TF32.
    precision = jax.lax.Precision.HIGHEST if dtype == F32 else None
    call = lambda: jax.jit(
      lambda a, b: gmm(
        a, b, sizes, precision=precision, preferred_element_type=out_dtype, **self.kwargs()
      )
    )(lhs, rhs)
    if self.skip_unsupported(call, dtype, precision=precision):
      return
    got = call()
    assert got.dtype == (out_dtype or dtype)
    assert_close(got, reference_gmm(lhs, rhs, sizes), got.dtype, comparison="kernel")

  def test_rows_past_the_groups_sum_give_zero(self, request):
    lhs, rhs, sizes = operands(request.node.name, 100, 64, 64, 4, BF16)
    call = lambda: jax.jit(lambda a, b: gmm(a, b, sizes, **self.kwargs()))(
      past_sum_poisoned(lhs, sizes), rhs
    )
    if self.skip_unsupported(call, BF16):
      return
    got = np.asarray(call().astype(jnp.float32))
    total = int(jnp.sum(sizes))
    assert total < 100 and np.all(got[total:] == 0)
    assert_close(got[:total], reference_gmm(lhs, rhs, sizes)[:total], BF16, comparison="kernel")

  @pytest.mark.slow
  def test_every_zero_size_group_pattern(self, request):
    groups = 6  # 64 patterns: empty groups first, last, adjacent, alone and all of them
    lhs, rhs, _ = operands(request.node.name, 64, 64, 64, groups, BF16)
    kwargs = self.kwargs()
    if kwargs["config"] is not None:  # the edges tested are rows': one N block, one K step
      kwargs["config"] = dataclasses.replace(kwargs["config"], block_n=64, block_k=64)
    run = jax.jit(lambda sizes: gmm(lhs, rhs, sizes, **kwargs))
    if self.skip_unsupported(lambda: run(jnp.ones(groups, jnp.int32)), BF16):
      return
    full = jnp.array([3, 9, 1, 12, 7, 15], jnp.int32)  # sum 47 < 64
    for present in itertools.product([0, 1], repeat=groups):
      sizes = full * jnp.array(present, jnp.int32)
      assert_close(run(sizes), reference_gmm(lhs, rhs, sizes), BF16, comparison="kernel")

  # Four of the peer suite's eight (m, k, n) in [128, 1024] x [64, 128] x [128, 256]: each
  # size of each dimension twice, each pair of sizes once. On the JAX of the GPU machine
  # (0.11) and later: the oldest JAX runs the same kernels' VJPs in the other cases.
  @pytest.mark.slow
  @pytest.mark.skipif(
    jax_version() < (0, 11),
    reason="the mixed-precision VJP sweep runs on JAX 0.11+ (the GPU machine's and newer)",
  )
  @pytest.mark.parametrize(
    "m, k, n", [(128, 64, 128), (128, 128, 256), (1024, 64, 256), (1024, 128, 128)]
  )
  @pytest.mark.parametrize(
    "after, precision",
    [(None, None), (None, BF16_PRESET), (jax.nn.relu, BF16_PRESET), (jnp.tanh, BF16_PRESET)],
    ids=["none", "none-bf16dot", "relu-bf16dot", "tanh-bf16dot"],
  )
  def test_gmm_vjp_with_float32_cotangent(self, m, k, n, after, precision, request):
    """bf16 operands, a float32 result and a float32 cotangent (mixed-precision training):
    the gradients match XLA's on float32 copies at the peer suite's tolerance (tokamax's
    `RaggedDotTestBase.test_vjp`: rtol 5e-3, atol 1e-6), so no bit of the cotangent is lost
    to the operands' dtype."""
    groups = 8
    rng = np.random.default_rng(seed_of(request.node.name))
    lhs, rhs = (
      jnp.asarray(rng.normal(0.0, 0.1, shape).astype(np.float32), BF16)
      for shape in [(m, k), (groups, k, n)]
    )
    sizes = jnp.full(groups, m // groups, jnp.int32)
    after = after or (lambda y: y)

    def kernel(a, b):
      out = gmm(
        a,
        b,
        sizes,
        precision=precision,
        preferred_element_type=jnp.float32,
        **self.kwargs(small_blocks=False),
      )
      return after(out)

    reference = lambda a, b: after(reference_gmm(a, b, sizes))
    if self.skip_unsupported(lambda: jax.jit(kernel)(lhs, rhs), BF16, precision=precision):
      return
    f32 = lambda a: a.astype(jnp.float32)
    expected, reference_vjp = jax.vjp(reference, f32(lhs), f32(rhs))
    actual, kernel_vjp = jax.vjp(jax.jit(kernel), lhs, rhs)
    assert_close(actual, expected, comparison="reordered")
    d_out = jax.nn.standardize(expected)  # float32, every bit used
    got = jax.jit(kernel_vjp)(d_out)
    want = reference_vjp(d_out)
    chex.assert_trees_all_equal_dtypes(got, (lhs, rhs))
    chex.assert_trees_all_close(jax.tree.map(f32, got), want, atol=1e-6, rtol=5e-3)

  @pytest.mark.parametrize("activation", ["silu", "gelu"])
  def test_moe_mlp_forward_and_gradients(self, activation, request):
    m, d, f, groups = 128, 64, 128, 4
    keys = jax.random.split(jax.random.key(seed_of(request.node.name)), 5)
    x = jax.random.normal(keys[0], (m, d)).astype(BF16)
    w_gate_up = (jax.random.normal(keys[1], (groups, d, 2 * f)) / np.sqrt(d)).astype(BF16)
    w_down = (jax.random.normal(keys[2], (groups, f, d)) / np.sqrt(f)).astype(BF16)
    weights = jax.random.uniform(keys[3], (m,), minval=0.1).astype(BF16)
    sizes = random_sizes(keys[4], groups, m)
    probe = jax.random.normal(keys[4], (m, d))
    args = (x, w_gate_up, w_down, weights)

    def kernel(x, w_gate_up, w_down, weights):
      return moe_mlp(
        x, w_gate_up, w_down, sizes, row_weights=weights, activation=activation, **self.kwargs()
      )

    def reference(x, w_gate_up, w_down, weights):
      f32 = [a.astype(jnp.float32) for a in (x, w_gate_up, w_down, weights)]
      return moe_mlp_reference(*f32[:3], sizes, f32[3], activation, jax.lax.Precision.HIGHEST)

    if self.skip_unsupported(lambda: jax.jit(kernel)(*args), BF16, activation):
      return
    assert_close(jax.jit(kernel)(*args), jax.jit(reference)(*args), BF16, comparison="kernel")
    loss = lambda mlp: lambda *a: jnp.sum(mlp(*a).astype(jnp.float32) * probe)
    got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2, 3)))(*args)
    for g, w in zip(got, want, strict=True):
      scale = float(jnp.max(jnp.abs(w)))
      assert_close(g.astype(jnp.float32) / scale, w / scale, atol=GRAD_ATOL, rtol=0.0)

  @pytest.mark.parametrize("rhs_format, block", QUANTIZED, ids=[q[0] for q in QUANTIZED])
  def test_block_scaled_rhs_matches_its_dequantized_weights(self, rhs_format, block, request):
    """gmm on a `BlockScaled` rhs, forward and d(lhs) (the kernel reading it transposed),
    equals ragged_dot on the weights dequantized apart (NumPy + ml_dtypes) to float32
    rounding: no bit is lost to a narrower dtype. Rows past the groups' sum are NaN."""
    m, k, n, groups = 96, 64, 80, 4  # n: padded to whole column blocks
    keys = jax.random.split(jax.random.key(seed_of(request.node.name)), 4)
    rhs, dequantized = random_block_scaled(keys[0], (groups, k, n), rhs_format, block)
    sizes = random_sizes(keys[1], groups, m)
    lhs = past_sum_poisoned(jax.random.normal(keys[2], (m, k)), sizes)
    highest = jax.lax.Precision.HIGHEST
    kernel = jax.jit(lambda a: gmm(a, rhs, sizes, precision=highest, **self.kwargs()))
    if self.skip_unsupported(lambda: kernel(lhs), F32, precision=highest, rhs_format=rhs_format):
      return
    total = int(jnp.sum(sizes))
    reference = lambda a: reference_gmm(a, jnp.asarray(dequantized), sizes)
    got, kernel_vjp = jax.vjp(kernel, lhs)
    assert np.all(np.asarray(got)[total:] == 0)
    assert_close(got[:total], reference(lhs)[:total], comparison="reordered")
    d_out = jax.random.normal(keys[3], got.shape)
    want = jax.vjp(reference, jnp.where(jnp.isnan(lhs), 0.0, lhs))[1](d_out)
    assert_close(jax.jit(kernel_vjp)(d_out)[0], want[0], comparison="reordered")

  @pytest.mark.parametrize("rhs_format, block", QUANTIZED, ids=[q[0] for q in QUANTIZED])
  def test_moe_mlp_with_block_scaled_weights(self, rhs_format, block, request):
    """The fused MLP in bf16 on `BlockScaled` weights: output and the gradients of x and the
    row weights match the float32 reference on the independently dequantized weights,
    rounded to bf16 as the kernel's matmuls take them."""
    m, d, f, groups = 64, 64, 64, 4
    keys = jax.random.split(jax.random.key(seed_of(request.node.name)), 6)
    w_gate_up, gate_up_values = random_block_scaled(keys[0], (groups, d, 2 * f), rhs_format, block)
    w_down, down_values = random_block_scaled(keys[1], (groups, f, d), rhs_format, block)
    x = jax.random.normal(keys[2], (m, d)).astype(BF16)
    weights = jax.random.uniform(keys[3], (m,), minval=0.1).astype(BF16)
    sizes = random_sizes(keys[4], groups, m)
    probe = jax.random.normal(keys[5], (m, d))

    def kernel(x, weights):
      return moe_mlp(x, w_gate_up, w_down, sizes, row_weights=weights, **self.kwargs())

    def reference(x, weights):
      f32 = lambda a: jnp.asarray(a, BF16).astype(jnp.float32)
      return moe_mlp_reference(
        f32(x), f32(gate_up_values), f32(down_values), sizes, f32(weights), "silu",
        jax.lax.Precision.HIGHEST,
      )  # fmt: skip

    run = jax.jit(kernel)
    if self.skip_unsupported(lambda: run(x, weights), BF16, "silu", rhs_format=rhs_format):
      return
    assert_close(run(x, weights), reference(x, weights), BF16, comparison="kernel")
    loss = lambda mlp: lambda *a: jnp.sum(mlp(*a).astype(jnp.float32) * probe)
    got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1)))(x, weights)
    want = jax.jit(jax.grad(loss(reference), argnums=(0, 1)))(x, weights)
    for g, w in zip(got, want, strict=True):
      scale = float(jnp.max(jnp.abs(w)))
      assert_close(g.astype(jnp.float32) / scale, w / scale, atol=GRAD_ATOL, rtol=0.0)

  @pytest.mark.parametrize("dtype", [F32, BF16])
  def test_tgmm_matches_per_group_products(self, dtype, request):
    m, k, n, groups = 160, 64, 128, 5
    keys = jax.random.split(jax.random.key(seed_of(request.node.name)), 3)
    lhs = jax.random.normal(keys[0], (m, k)).astype(dtype)
    dout = jax.random.normal(keys[1], (m, n)).astype(dtype)
    sizes = random_sizes(keys[2], groups, m, empty=(0, 3))
    backend = BACKENDS[self.implementation]
    blocks = (self.tgmm_blocks if INTERPRET else None) or backend.tgmm_blocks(m, k, n)
    precision = jax.lax.Precision.HIGHEST if dtype == F32 else None
    # The forward kernel's blocks set the rows' tiles (Mosaic's: 2 steps of tgmm's per tile).
    settings = KernelSettings(
      self.implementation, self.blocks if INTERPRET else None, blocks, precision, None, INTERPRET
    )
    call = lambda: jax.jit(lambda a, d: transposed_grouped_matmul(a, d, sizes, settings))(
      past_sum_poisoned(lhs, sizes), past_sum_poisoned(dout, sizes)
    )
    if self.skip_unsupported(call, dtype, precision=precision):
      return
    got = call()
    ends = np.cumsum(np.asarray(sizes))
    f32 = lambda a: np.asarray(a, np.float32)
    want = np.stack(
      [
        f32(lhs)[e - s : e].T @ f32(dout)[e - s : e]
        for s, e in zip(np.asarray(sizes), ends, strict=True)
      ]
    )
    chex.assert_shape(got, (groups, k, n))
    assert np.all(np.asarray(got)[[0, 3]] == 0)  # empty groups
    atol = 1e-5 * np.sqrt(m) if dtype == F32 else 2e-2 * np.sqrt(m)
    assert_close(got, want, dtype, comparison="kernel", atol=atol)


class TestXla(GroupedMatmulTestBase):
  implementation = "xla"


class TestTriton(GroupedMatmulTestBase):
  implementation = "triton"
  blocks = TritonBlocks(block_m=16, block_n=32, block_k=16)
  tgmm_blocks = TritonBlocks(block_m=16, block_n=32, block_k=16)


class TestMosaic(GroupedMatmulTestBase):
  implementation = "mosaic"
  blocks = MosaicBlocks(block_m=64, block_n=32, block_k=32, max_concurrent_steps=2)
  tgmm_blocks = MosaicBlocks(block_m=64, block_n=32, block_k=32, max_concurrent_steps=2)
