"""Pallas kernels against the XLA reference: Triton in the Pallas interpreter, Mosaic GPU in
the Mosaic GPU interpreter, gradients, backend choice, and CUDA lowering with jax.export."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from kernels_pallas import MosaicBlocks, TritonBlocks, gmm, moe_mlp
from kernels_pallas.api import moe_mlp_reference
from kernels_pallas.gmm_mosaic import gmm_mosaic, interpret_params
from kernels_pallas.gmm_triton import gmm_triton, tgmm_triton
from tests.helpers import assert_close, seed_of

TRITON = dict(implementation="triton", interpret=True, config=TritonBlocks(16, 16, 16))


def operands(name: str, m: int, k: int, n: int, g: int, dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.key(seed_of(name)))
  lhs = jax.random.normal(k1, (m, k)).astype(dtype)
  rhs = (jax.random.normal(k2, (g, k, n)) / np.sqrt(k)).astype(dtype)
  return lhs, rhs


def test_gmm_triton_every_zero_size_pattern(request):
  lhs, rhs = operands(request.node.name, 40, 16, 32, 4)
  for present in itertools.product([False, True], repeat=4):
    sizes = jnp.array([(g + 3) * 2 * p for g, p in enumerate(present)], jnp.int32)  # sum <= 36
    got = gmm(lhs, rhs, sizes, **TRITON)
    assert_close(got, jax.lax.ragged_dot(lhs, rhs, sizes), what=f"sizes {sizes.tolist()}")


@pytest.mark.parametrize(
  "m, k, n, sizes",
  [
    (37, 20, 24, [37, 0, 0]),  # one group, M, K, N not multiples of the blocks
    (64, 16, 16, [5, 17, 3]),  # sum < M: rows past it are 0
    (33, 48, 16, [0, 33, 0]),
    (16, 16, 48, [1, 1, 1]),
  ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gmm_triton_shapes_and_dtypes(m, k, n, sizes, dtype, request):
  lhs, rhs = operands(request.node.name, m, k, n, 3, dtype)
  sizes = jnp.array(sizes, jnp.int32)
  got = gmm(lhs, rhs, sizes, preferred_element_type=jnp.float32, **TRITON)
  want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
  assert_close(got, want, dtype, what="gmm")
  assert np.all(np.asarray(got)[int(sizes.sum()) :] == 0)


def test_gmm_triton_gradients_match_ragged_dot(request):
  lhs, rhs = operands(request.node.name, 45, 24, 20, 4)
  sizes = jnp.array([9, 0, 20, 7], jnp.int32)  # a zero-size group and 9 rows past the sum
  probe = jax.random.normal(jax.random.key(1), (45, 20))

  def loss(impl):
    return lambda lhs, rhs: jnp.sum(jnp.sin(impl(lhs, rhs)) * probe)

  kernel = loss(lambda lhs, rhs: gmm(lhs, rhs, sizes, **TRITON))
  reference = loss(lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs, sizes))
  got = jax.grad(kernel, argnums=(0, 1))(lhs, rhs)
  want = jax.grad(reference, argnums=(0, 1))(lhs, rhs)
  assert_close(got[0], want[0], what="d lhs")
  assert_close(got[1], want[1], what="d rhs")


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_moe_mlp_triton_forward_and_gradients(activation, request):
  m, d, f, g = 40, 16, 24, 3
  key = jax.random.key(seed_of(request.node.name))
  k1, k2, k3, k4 = jax.random.split(key, 4)
  x = jax.random.normal(k1, (m, d))
  w_gate_up = jax.random.normal(k2, (g, d, 2 * f)) / 4
  w_down = jax.random.normal(k3, (g, f, d)) / 5
  weights = jax.random.uniform(k4, (m,))
  sizes = jnp.array([11, 0, 22], jnp.int32)
  probe = jax.random.normal(jax.random.key(2), (m, d))

  def loss(impl):
    return lambda *args: jnp.sum(jnp.sin(impl(*args)) * probe)

  kernel = loss(
    lambda x, wgu, wd, w: moe_mlp(x, wgu, wd, sizes, row_weights=w, activation=activation, **TRITON)
  )
  reference = loss(lambda x, wgu, wd, w: moe_mlp_reference(x, wgu, wd, sizes, w, activation))
  args = (x, w_gate_up, w_down, weights)
  assert_close(kernel(*args), reference(*args), what="loss")
  got = jax.grad(kernel, argnums=(0, 1, 2, 3))(*args)
  want = jax.grad(reference, argnums=(0, 1, 2, 3))(*args)
  for name, a, b in zip(("x", "w_gate_up", "w_down", "row_weights"), got, want, strict=True):
    assert_close(a, b, what=f"d {name}")


def test_tgmm_triton_zero_groups_give_zero(request):
  lhs, _ = operands(request.node.name, 32, 16, 16, 3)
  dout = jax.random.normal(jax.random.key(3), (32, 16))
  blocks = TritonBlocks(16, 16, 16)
  sizes = jnp.array([0, 20, 0], jnp.int32)
  got = tgmm_triton(lhs, dout, sizes, blocks=blocks, interpret=True)
  assert np.all(np.asarray(got)[[0, 2]] == 0)
  assert_close(got[1], lhs[:20].T @ dout[:20], what="tgmm group 1")


MOSAIC_SMALL = MosaicBlocks(block_m=64, block_n=16, block_k=16, max_concurrent_steps=2)


@pytest.mark.parametrize("sizes", [[40, 0, 70], [0, 0, 128], [1, 2, 3]])
def test_gmm_mosaic_in_gpu_interpreter(sizes, request):
  lhs, rhs = operands(request.node.name, 128, 32, 32, 3, jnp.bfloat16)
  sizes = jnp.array(sizes, jnp.int32)
  got = gmm_mosaic(lhs, rhs, sizes, blocks=MOSAIC_SMALL, interpret=interpret_params())
  want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
  assert_close(got, want, jnp.bfloat16, what="mosaic gmm")
  assert np.all(np.asarray(got.astype(jnp.float32))[int(sizes.sum()) :] == 0)


def test_moe_mlp_mosaic_in_gpu_interpreter(request):
  m, d, f = 128, 32, 16
  keys = jax.random.split(jax.random.key(seed_of(request.node.name)), 4)
  x = jax.random.normal(keys[0], (m, d)).astype(jnp.bfloat16)
  w_gate_up = (jax.random.normal(keys[1], (2, d, 2 * f)) / 4).astype(jnp.bfloat16)
  w_down = (jax.random.normal(keys[2], (2, f, d)) / 3).astype(jnp.bfloat16)
  weights = jax.random.uniform(keys[3], (m,)).astype(jnp.bfloat16)
  sizes = jnp.array([50, 60], jnp.int32)
  got = moe_mlp(
    x,
    w_gate_up,
    w_down,
    sizes,
    row_weights=weights,
    implementation="mosaic",
    config=MOSAIC_SMALL,
    interpret=interpret_params(),
  )
  want = moe_mlp_reference(x, w_gate_up, w_down, sizes, weights, "silu")
  assert_close(got, want, jnp.bfloat16, what="mosaic moe_mlp")


def test_backend_choice_and_fallback():
  lhs, rhs = jnp.ones((8, 4)), jnp.ones((2, 4, 4))
  sizes = jnp.array([3, 4], jnp.int32)
  # On this CPU the best backend is XLA; an explicit unsupported case raises with the reason.
  from kernels_pallas.api import best_implementation, unsupported_reason

  assert best_implementation(jnp.bfloat16, "silu") == "xla"
  assert unsupported_reason("mosaic", jnp.bfloat16, jnp.bfloat16, "silu") is None
  assert "one dtype" in unsupported_reason("triton", jnp.float32, jnp.bfloat16)
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
  with pytest.raises(ValueError, match="block_m=48 must be a power of two"):
    TritonBlocks(block_m=48)


TRITON_CUSTOM_CALL = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def cuda_custom_calls(fn, *shapes, disabled=()) -> str:
  exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=list(disabled))
  return exported(*shapes).mlir_module()


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
  ]:
    assert "__gpu$xla.gpu.triton" in cuda_custom_calls(fn, *args, disabled=[TRITON_CUSTOM_CALL])


def test_mosaic_kernel_lowers_for_cuda():
  lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
  for activation, n in [(None, 512), ("silu", 1024)]:
    rhs = jax.ShapeDtypeStruct((8, 256, n), jnp.bfloat16)
    fn = lambda a, b, s, act=activation: gmm_mosaic(a, b, s, blocks=MosaicBlocks(), activation=act)
    assert "mosaic_gpu" in cuda_custom_calls(fn, lhs, rhs, sizes)


def test_kernel_erf_matches_lax_erf():
  from kernels_pallas.gmm_triton import erf_in_kernel

  x = jnp.linspace(-6.0, 6.0, 10001)
  error = float(jnp.max(jnp.abs(erf_in_kernel(x) - jax.lax.erf(x))))
  assert error < 1e-6, error


def test_gmm_mosaic_gradients_in_the_interpreters(request):
  lhs, rhs = operands(request.node.name, 128, 32, 32, 3, jnp.bfloat16)
  sizes = jnp.array([40, 0, 70], jnp.int32)
  probe = jax.random.normal(jax.random.key(4), (128, 32))

  def loss(impl):
    return lambda lhs, rhs: jnp.sum(impl(lhs, rhs).astype(jnp.float32) * probe)

  mosaic = loss(
    lambda a, b: gmm(
      a, b, sizes, implementation="mosaic", config=MOSAIC_SMALL, interpret=interpret_params()
    )
  )
  reference = loss(lambda a, b: jax.lax.ragged_dot(a, b, sizes))
  got = jax.grad(mosaic, argnums=(0, 1))(lhs, rhs)
  want = jax.grad(reference, argnums=(0, 1))(lhs, rhs)
  assert_close(got[0], want[0], jnp.bfloat16, what="d lhs (mosaic)")
  assert_close(got[1], want[1], jnp.bfloat16, what="d rhs (tgmm)")
