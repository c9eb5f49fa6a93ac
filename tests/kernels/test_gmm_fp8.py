"""The fp8 grouped matmuls (kernels_pallas/gmm_fp8.py) in the Mosaic GPU interpreter, against
the emulated fp8_deepseek recipe (`moejax.compute_quant.matmul`) group by group."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gmm_fp8 import Fp8Blocks, gmm_fp8, gmm_fp8_vjp
from moejax.compute_quant import matmul
from tests.helpers import seed_of

# A group longer than a row tile and than a token group (150 > 128), an empty one, rows past
# the sum (NaN: never read); K = N = 256 (two scale groups each, two column tiles).
SIZES = (70, 0, 150, 20)
ROWS, K, N = 256, 256, 256
BLOCKS = Fp8Blocks(block_m=64, block_n=128, max_concurrent_steps=2)


def poisoned(rng, shape) -> jnp.ndarray:
  """Fresh normal rows, NaN past the groups' rows."""
  x = rng.standard_normal(shape).astype(np.float32)
  x[sum(SIZES) :] = np.nan
  return jnp.asarray(x)


def by_group(product, empty) -> list:
  """product(g, rows of g) for each group, `empty` for an empty one."""
  ends = np.cumsum(SIZES)
  return [
    product(g, slice(end - size, end)) if size else empty
    for g, (size, end) in enumerate(zip(SIZES, ends, strict=True))
  ]


def whole_token_groups(x) -> jnp.ndarray:
  """x's rows padded with zeros to whole 128-row groups (a tile loop's tiles of the wgrad)."""
  return jnp.pad(x, ((0, -len(x) % 128), (0, 0)))


def relative_error(out, ref) -> float:
  return float(np.abs(np.asarray(out) - ref).max() / np.abs(ref).max())


def test_each_product_equals_the_emulated_recipe(request):
  """Forward a @ W, and through its VJP the dgrad g @ W^T and wgrad a^T @ g, equal the
  recipe's products emulated in XLA to 1e-5 (the kernels sum each 128-group in fp8 and
  promote it to float32), differ from the unquantized products by the quantization (1e-3 to
  5e-2), and rows outside the groups stay 0 (their NaN never read)."""
  rng = np.random.default_rng(seed_of(request.node.name))
  lhs, dout = poisoned(rng, (ROWS, K)), poisoned(rng, (ROWS, N))
  w = jnp.asarray(rng.standard_normal((len(SIZES), K, N)), jnp.float32)
  sizes = jnp.array(SIZES, jnp.int32)
  used = sum(SIZES)

  def rows_of(products, width):
    blocks = [p for p in products if p is not None]
    return np.concatenate([*blocks, np.zeros((ROWS - used, width), np.float32)])

  forward, pullback = jax.vjp(lambda lhs, w: gmm_fp8_vjp(lhs, w, sizes, BLOCKS, True), lhs, w)
  dgrad, wgrad = pullback(dout)
  emulated = rows_of(
    by_group(lambda g, r: matmul(lhs[r], w[g], "fp8_deepseek", "forward"), None), N
  )
  exact = rows_of(by_group(lambda g, r: lhs[r] @ w[g], None), N)
  w_t = jnp.swapaxes(w, 1, 2)
  emulated_dgrad = rows_of(
    by_group(lambda g, r: matmul(dout[r], w_t[g], "fp8_deepseek", "dgrad"), None), K
  )
  zero_grad = np.zeros((K, N), np.float32)
  emulated_wgrad = np.stack(
    by_group(
      lambda g, r: matmul(
        whole_token_groups(lhs[r]).T, whole_token_groups(dout[r]), "fp8_deepseek", "wgrad"
      ),
      zero_grad,
    )
  )
  exact_wgrad = np.stack(by_group(lambda g, r: lhs[r].T @ dout[r], zero_grad))

  assert relative_error(forward, emulated) <= 1e-5
  assert relative_error(dgrad, emulated_dgrad) <= 1e-5
  assert relative_error(wgrad, emulated_wgrad) <= 1e-5
  assert 1e-3 <= relative_error(forward, exact) <= 5e-2
  assert 1e-3 <= relative_error(wgrad, exact_wgrad) <= 5e-2
  assert not np.asarray(forward[used:]).any() and not np.asarray(wgrad[1]).any()


def test_sizes_off_the_recipes_groups_are_refused():
  sizes = jnp.array([4], jnp.int32)
  with pytest.raises(ValueError, match="groups of 128: K=192 must be a multiple of 128"):
    gmm_fp8(jnp.ones((8, 192)), jnp.ones((1, 192, 128)), sizes, interpret=True)
  with pytest.raises(ValueError, match="block_n=96 must divide the 128-wide scale blocks"):
    Fp8Blocks(block_n=96)
