"""What the backend test base (test_backends.py) does not cover: the registry, the choice of
backend, bad arguments, and the CUDA lowering of every kernel with jax.export (no GPU needed)."""

import itertools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import export

from kernels_pallas import MosaicBlocks, TritonBlocks, gmm, moe_mlp
from kernels_pallas.api import best_implementation
from kernels_pallas.backends import (
  BACKENDS,
  Case,
  no_kernel_reason,
  select_kernel,
  unsupported_reason,
)
from kernels_pallas.compat import triton_missing_reason
from kernels_pallas.dequant import decode
from kernels_pallas.formats import FORMATS
from kernels_pallas.gmm_mosaic import gmm_mosaic, tgmm_mosaic
from kernels_pallas.gmm_triton import gmm_triton, tgmm_triton
from kernels_pallas.quantized import BlockScaled, from_qarray
from tests.helpers import assert_close, expect_triton_deprecation, tolerance
from tests.lowering import block_scaled_spec, cuda_custom_calls


def test_registry_records_are_complete_and_frozen():
  for name, backend in BACKENDS.items():
    assert backend.name == name
    assert callable(backend.gmm) and callable(backend.tgmm)
    with pytest.raises(AttributeError):
      backend.name = "other"
  assert BACKENDS["mosaic"].blocks_type is MosaicBlocks
  assert BACKENDS["triton"].blocks_type is TritonBlocks


def test_backend_choice_and_fallback():
  lhs, rhs = jnp.ones((8, 4)), jnp.ones((2, 4, 4))
  sizes = jnp.array([3, 4], jnp.int32)
  # On this CPU the best backend is XLA; an explicit unsupported case raises with the reason.
  assert best_implementation(jnp.bfloat16, "silu") == "xla"
  assert unsupported_reason("mosaic", Case(jnp.bfloat16, "silu")) is None
  assert "one dtype" in unsupported_reason("triton", Case(jnp.float32, rhs_dtype=jnp.bfloat16))
  assert_close(gmm(lhs, rhs, sizes), jax.lax.ragged_dot(lhs, rhs, sizes), what="default")
  with pytest.raises(NotImplementedError, match="bf16/f16"):
    gmm(lhs, rhs, sizes, implementation="mosaic")
  with pytest.raises(NotImplementedError, match="gelu"):
    moe_mlp(
      lhs.astype(jnp.bfloat16),
      jnp.ones((2, 4, 8), jnp.bfloat16),
      jnp.ones((2, 4, 4), jnp.bfloat16),
      sizes,
      activation="gelu",
      implementation="mosaic",
    )
  with pytest.raises(ValueError, match="implementation must be one of"):
    gmm(lhs, rhs, sizes, implementation="cuda")
  with pytest.raises(ValueError, match="group_sizes has shape"):
    gmm(lhs, rhs, jnp.array([8], jnp.int32))
  on_mosaic = lambda **kw: gmm(
    lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes, implementation="mosaic", **kw
  )
  with pytest.raises(NotImplementedError, match="precision"):
    on_mosaic(precision=jax.lax.Precision.HIGHEST)
  with pytest.raises(TypeError, match="config for mosaic must be MosaicBlocks"):
    on_mosaic(config=TritonBlocks())
  with pytest.raises(ValueError, match="block_m=48 must be a power of two"):
    TritonBlocks(block_m=48)
  with pytest.raises(ValueError, match="max_concurrent_steps=1 must be >= 2"):
    MosaicBlocks(max_concurrent_steps=1)


TRITON_CUSTOM_CALL = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


@pytest.mark.skipif(triton_missing_reason() is not None, reason=str(triton_missing_reason()))
def test_triton_kernels_lower_for_cuda():
  lhs = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  weights = jax.ShapeDtypeStruct((256,), jnp.bfloat16)
  blocks = TritonBlocks(64, 64, 32)
  for fn, args in [
    (lambda a, b, s: gmm_triton(a, b, s, blocks=blocks), (lhs, rhs, sizes)),
    (
      lambda a, b, s, w: gmm_triton(a, b, s, w, blocks=blocks, activation="gelu"),
      (lhs, rhs, sizes, weights),
    ),
    (
      lambda a, b, s: gmm_triton(a, b, s, blocks=blocks, transpose_rhs=True),
      (lhs, jax.ShapeDtypeStruct((4, 256, 128), jnp.bfloat16), sizes),
    ),
    (
      lambda a, d, s: tgmm_triton(a, d, s, blocks=blocks),
      (lhs, jax.ShapeDtypeStruct((256, 256), jnp.bfloat16), sizes),
    ),
    *[  # BlockScaled rhs, forward gated and read transposed
      (
        lambda a, b, s, t=transpose: gmm_triton(
          a,
          b,
          s,
          blocks=BACKENDS["triton"].fit_blocks(blocks, b, t),
          transpose_rhs=t,
          activation=None if t else "silu",
        ),
        (lhs, block_scaled_spec(shape, rhs_format), sizes),
      )
      for rhs_format in FORMATS
      for transpose, shape in ((False, (4, 128, 256)), (True, (4, 256, 128)))
    ],
  ]:
    with expect_triton_deprecation():
      mlir = cuda_custom_calls(fn, *args, disabled=[TRITON_CUSTOM_CALL], device_kind="NVIDIA A100")
    assert "__gpu$xla.gpu.triton" in mlir


def test_mosaic_kernels_lower_for_cuda():
  """The forward kernel (plain, gated, reading rhs transposed in shared memory; bf16 weights
  and those of every format) and tgmm."""
  lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
  blocks = MosaicBlocks()
  for (activation, transpose, rhs_shape), rhs_format in itertools.product(
    [(None, False, (8, 256, 512)), ("silu", False, (8, 256, 1024)), (None, True, (8, 512, 256))],
    [None, *FORMATS],
  ):
    rhs = jax.ShapeDtypeStruct(rhs_shape, jnp.bfloat16)
    if rhs_format:
      rhs = block_scaled_spec(rhs_shape, rhs_format)
    fn = lambda a, b, s, act=activation, t=transpose: gmm_mosaic(
      a, b, s, blocks=blocks, activation=act, transpose_rhs=t
    )
    assert "mosaic_gpu" in cuda_custom_calls(fn, lhs, rhs, sizes)
  dout = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16)
  fn = lambda a, d, s: tgmm_mosaic(a, d, s, blocks=BACKENDS["mosaic"].tgmm_blocks(512, 256, 384))
  assert "mosaic_gpu" in cuda_custom_calls(fn, lhs, dout, sizes)


def test_kernel_erf_matches_lax_erf():
  from kernels_pallas.activations import erf_in_kernel

  x = jnp.linspace(-6.0, 6.0, 10001)
  error = float(jnp.max(jnp.abs(erf_in_kernel(x) - jax.lax.erf(x))))
  assert error < 1e-6, error


def test_auto_uses_xla_off_the_measured_cases():
  """On this CPU no kernel is measured faster: None and "auto" take the XLA paths."""
  from moejax import MoEConfig
  from moejax.plan import ExpertPlan, plan_experts

  assert best_implementation(jnp.bfloat16, "silu", num_rows=1 << 20) == "xla"
  config = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128)
  assert plan_experts(config, num_rows=1 << 20, local_experts=8) == ExpertPlan(path="tile_loop")
  pallas = MoEConfig(**{**config.__dict__, "expert_backend": "pallas"})
  with pytest.warns(UserWarning, match="in the interpreter"):
    assert plan_experts(pallas, num_rows=16, local_experts=8) == ExpertPlan(
      path="pallas", backend="triton", interpret=True
    )


def test_the_selector_walks_the_registry_in_order():
  """Each device gets the first kernel made for it that runs the case; no backend name is a
  fallback anywhere else."""
  hopper, ampere, cpu = "9.0", "8.0", None
  assert select_kernel(Case(jnp.bfloat16, "silu"), hopper) == "mosaic"
  assert select_kernel(Case(jnp.float32, "silu"), hopper) == "triton"  # wgmma: bf16/f16
  assert select_kernel(Case(jnp.bfloat16, "silu"), ampere) == "triton"
  assert select_kernel(Case(jnp.float32, "gelu", rhs_format="mxfp4"), cpu) == "triton"
  assert select_kernel(Case(jnp.float32, "silu", biases=True), hopper) is None
  reason = no_kernel_reason(Case(jnp.bfloat16, "swiglu_oai"), hopper)
  assert reason.startswith("mosaic: activation='swiglu_oai'") and "triton: " in reason, reason
  for name, backend in BACKENDS.items():  # xla is the reference, made for no device
    assert backend.made_for(hopper) == (name != "xla")


def test_auto_takes_a_kernel_only_where_measured_faster(monkeypatch):
  from kernels_pallas import api, platform

  with platform.targeting(platform.Target(platform="gpu", compute_capability="9.0")):
    assert api.best_implementation(jnp.bfloat16, "silu", num_rows=1 << 20) == "xla"  # no record
    monkeypatch.setattr(api, "KERNEL_FASTER_FROM_ROWS", {"mosaic": 8192})
    assert api.best_implementation(jnp.bfloat16, "silu", num_rows=8192) == "mosaic"
    assert api.best_implementation(jnp.bfloat16, "silu", num_rows=4096) == "xla"  # unmeasured
    assert api.best_implementation(jnp.float32, "silu", num_rows=8192) == "xla"  # unsupported
    assert api.best_implementation(jnp.bfloat16, "gelu", num_rows=8192) == "xla"


def test_a_jax_without_pallas_triton_is_reported_not_an_import_error(monkeypatch):
  from kernels_pallas import compat

  monkeypatch.setattr(compat, "pallas_triton", lambda: None)
  reason = BACKENDS["triton"].unsupported_reason(jnp.bfloat16, "silu", None)
  assert reason.startswith("Pallas Triton was removed from JAX ")
  lhs, rhs = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((2, 16, 16), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="Pallas Triton was removed"):
    gmm(lhs, rhs, jnp.array([3, 4], jnp.int32), implementation="triton")
  with pytest.raises(NotImplementedError, match="Pallas Triton was removed"):
    gmm_triton(lhs, rhs, jnp.array([3, 4], jnp.int32), blocks=TritonBlocks(16, 16, 16))


def test_compat_erf_has_erfs_value_and_derivative():
  from kernels_pallas.compat import erf

  x = jnp.linspace(-5.0, 5.0, 2001)
  chex_close = lambda a, b: assert_close(a, b, what="erf")
  chex_close(erf(x), jax.lax.erf(x))
  chex_close(jax.vmap(jax.grad(erf))(x), jax.vmap(jax.grad(jax.lax.erf))(x))


def test_block_scaled_bad_input():
  """A format a backend lacks, weights of two formats, an unknown format and a scale block
  no tile fits in each raise, naming the problem."""
  lhs = jnp.ones((32, 64), jnp.bfloat16)
  sizes = jnp.array([16, 16], jnp.int32)
  values = jnp.ones((2, 64, 64), jnp.float8_e4m3fn)
  fp8 = BlockScaled(values, jnp.ones((2, 2, 2)), (32, 32))
  with pytest.raises(NotImplementedError, match="xla takes no fp8_block"):
    gmm(lhs, fp8, sizes, implementation="xla")
  with pytest.raises(NotImplementedError, match="mosaic runs bf16/f16 wgmma only"):
    gmm(lhs.astype(jnp.float32), fp8, sizes, implementation="mosaic", interpret=True)
  down = jnp.ones((2, 32, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="must share a format, got fp8_block and None"):
    moe_mlp(lhs, fp8, down, sizes, implementation="triton", interpret=True)
  unknown = BlockScaled(values.astype(jnp.float16), jnp.ones((2, 2, 2)), (32, 32))
  with pytest.raises(ValueError, match="in none of the formats"):
    gmm(lhs, unknown, sizes, implementation="triton", interpret=True)
  tiny_blocks = BlockScaled(values, jnp.ones((2, 8, 8)), (8, 8))
  for implementation in ("triton", "mosaic"):
    with pytest.raises(NotImplementedError, match=r"tiles of >= \d+ .*\(8, 8\) scale block"):
      gmm(lhs, tiny_blocks, sizes, implementation=implementation, interpret=True)


@pytest.mark.parametrize(
  "qtype, tiles", [(jnp.float8_e4m3fn, {1: 32, 2: 32}), ("mxfp4", {1: 32}), ("nvfp4", {1: 16})]
)
def test_qwix_qarray_rhs_is_taken_as_its_block_scaled(qtype, tiles):
  """A qwix QArray (as tokamax's ragged_dot takes) runs as the BlockScaled it holds: the
  same result as passing that BlockScaled, and as ragged_dot on qwix's own dequantization."""
  qwix = pytest.importorskip("qwix")
  keys = jax.random.split(jax.random.key(5), 2)
  w = jax.random.normal(keys[0], (2, 64, 64)) / 8
  q = qwix.quantize(w, qtype, tiled_axes=tiles, channelwise_axes=[0] if len(tiles) > 1 else [0, 2])
  lhs = jax.random.normal(keys[1], (32, 64))
  sizes = jnp.array([12, 16], jnp.int32)
  run = lambda rhs: jax.jit(
    lambda a: gmm(a, rhs, sizes, implementation="triton", interpret=True,
                  precision=jax.lax.Precision.HIGHEST)
  )(lhs)  # fmt: skip
  if triton_missing_reason() is not None:
    pytest.skip(triton_missing_reason())
  chex.assert_trees_all_equal(run(q), run(from_qarray(q)))
  want = jax.lax.ragged_dot(lhs, qwix.dequantize(q), sizes, precision=jax.lax.Precision.HIGHEST)
  chex.assert_trees_all_close(run(q), want, **tolerance(comparison="reordered"))
  with pytest.raises(ValueError, match="symmetric with one scale tile per group"):
    from_qarray(qwix.quantize(w, jnp.float8_e4m3fn, tiled_axes={0: 2, 1: 32, 2: 32}))


def test_kernel_decode_matches_ml_dtypes_for_every_code():
  """The kernels' bit decode gives exactly ml_dtypes' value for each of the 256 float8_e4m3fn
  codes (NaN included) and, in both nibbles of a byte, each of the 16 float4_e2m1fn codes
  (mxfp4's and nvfp4's)."""
  codes = np.arange(256, dtype=np.uint8)
  fp8 = np.asarray(decode(jnp.asarray(codes), "fp8_block"))
  want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(fp8, want)  # NaN where ml_dtypes has NaN
  assert np.array_equal(np.signbit(fp8[~np.isnan(want)]), np.signbit(want[~np.isnan(want)]))
  pairs = jax.lax.bitcast_convert_type(
    jnp.asarray(codes, jnp.uint8), jnp.float4_e2m1fn
  )  # [256, 2]: (low nibble, high nibble) of each byte
  for rhs_format in ("mxfp4", "nvfp4"):
    even, odd = (np.asarray(v) for v in decode(jnp.asarray(codes), rhs_format))
    for got, nibble in ((even, 0), (odd, 1)):
      want = np.asarray(pairs[:, nibble]).astype(np.float32)
      np.testing.assert_array_equal(got, want)
      assert np.array_equal(np.signbit(got), np.signbit(want))
