"""The fp8 grouped matmuls (kernels_pallas/gmm_fp8.py) in the Mosaic GPU interpreter, against
the emulated fp8_deepseek recipe (`moejax.compute_quant.matmul`) group by group."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gmm_fp8 import Fp8Blocks, fp8_weight, gmm_fp8, gmm_fp8_vjp, tgmm_fp8
from moejax.compute_quant import matmul
from tests.helpers import seed_of, slow


class Case(NamedTuple):
  sizes: tuple[int, ...]  # rows of each group; rows past their sum are NaN (never read)
  rows: int
  k: int
  n: int
  blocks: Fp8Blocks
  prepared: bool  # the weight quantized once beforehand (`fp8_weight`), as the layer does


CASES = [
  # A group longer than a row tile and a token group (150 > 128), an empty one; K = N = 256
  # (two scale groups each, two column tiles).
  Case((70, 0, 150, 20), 256, 256, 256, Fp8Blocks(64, 128, 2), prepared=True),
  # Past those sizes: 8 skewed groups over 1024 rows (one of 600: five token groups), 128-row
  # tiles, three scale groups along K and N, 64-column tiles.
  slow(Case((600, 1, 0, 129, 64, 0, 127, 31), 1024, 384, 384, Fp8Blocks(128, 64, 3), False)),
]


def poisoned(rng, case: Case, width: int) -> jnp.ndarray:
  """Fresh normal rows, NaN past the groups' rows."""
  x = rng.standard_normal((case.rows, width)).astype(np.float32)
  x[sum(case.sizes) :] = np.nan
  return jnp.asarray(x)


def by_group(sizes, product, empty) -> list:
  """product(g, rows of g) for each group, `empty` for an empty one."""
  ends = np.cumsum(sizes)
  return [
    product(g, slice(end - size, end)) if size else empty
    for g, (size, end) in enumerate(zip(sizes, ends, strict=True))
  ]


def whole_token_groups(x) -> jnp.ndarray:
  """x's rows padded with zeros to whole 128-row groups (a tile loop's tiles of the wgrad)."""
  return jnp.pad(x, ((0, -len(x) % 128), (0, 0)))


def relative_error(out, ref) -> float:
  return float(np.abs(np.asarray(out) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize(
  "case", CASES, ids=["4 groups, weight quantized beforehand", "8 skewed groups"]
)
def test_each_product_equals_the_emulated_recipe(case, request):
  """Forward a @ W, and through its VJP the dgrad g @ W^T and wgrad a^T @ g, equal the
  recipe's products emulated in XLA to 1e-5 (the kernels sum each 128-group in fp8 and
  promote it to float32), differ from the unquantized products by the quantization (1e-3 to
  5e-2), and rows outside the groups and empty groups stay 0 (their NaN never read)."""
  rng = np.random.default_rng(seed_of(request.node.name))
  k, n, used = case.k, case.n, sum(case.sizes)
  lhs, dout = poisoned(rng, case, k), poisoned(rng, case, n)
  w = jnp.asarray(rng.standard_normal((len(case.sizes), k, n)), jnp.float32)
  group = lambda product, empty=None: by_group(case.sizes, product, empty)

  def rows_of(products, width):
    blocks = [p for p in products if p is not None]
    return np.concatenate([*blocks, np.zeros((case.rows - used, width), np.float32)])

  sizes = jnp.array(case.sizes, jnp.int32)
  w_fp8 = lambda w: fp8_weight(jax.lax.stop_gradient(w), interpret=True) if case.prepared else None
  product = lambda lhs, w: gmm_fp8_vjp(lhs, w, sizes, w_fp8(w), case.blocks, True)
  forward, pullback = jax.vjp(product, lhs, w)
  dgrad, wgrad = pullback(dout)
  emulated = rows_of(group(lambda g, r: matmul(lhs[r], w[g], "fp8_deepseek", "forward")), n)
  exact = rows_of(group(lambda g, r: lhs[r] @ w[g]), n)
  w_t = jnp.swapaxes(w, 1, 2)
  emulated_dgrad = rows_of(group(lambda g, r: matmul(dout[r], w_t[g], "fp8_deepseek", "dgrad")), k)
  zero_grad = np.zeros((k, n), np.float32)
  tokens = lambda x: whole_token_groups(x)
  emulated_wgrad = np.stack(
    group(
      lambda g, r: matmul(tokens(lhs[r]).T, tokens(dout[r]), "fp8_deepseek", "wgrad"), zero_grad
    )
  )
  exact_wgrad = np.stack(group(lambda g, r: lhs[r].T @ dout[r], zero_grad))

  assert relative_error(forward, emulated) <= 1e-5
  assert relative_error(dgrad, emulated_dgrad) <= 1e-5
  assert relative_error(wgrad, emulated_wgrad) <= 1e-5
  assert 1e-3 <= relative_error(forward, exact) <= 5e-2
  assert 1e-3 <= relative_error(wgrad, exact_wgrad) <= 5e-2
  empty = [g for g, size in enumerate(case.sizes) if not size]
  assert not np.asarray(forward[used:]).any() and not np.asarray(wgrad[np.array(empty)]).any()


def test_shapes_off_the_recipes_groups_or_each_other_are_refused():
  sizes = jnp.array([4], jnp.int32)
  with pytest.raises(ValueError, match="groups of 128: K=192 must be a multiple of 128"):
    gmm_fp8(jnp.ones((8, 192)), jnp.ones((1, 192, 128)), sizes, interpret=True)
  with pytest.raises(ValueError, match="block_n=96 must divide the 128-wide scale blocks"):
    Fp8Blocks(block_n=96)
  with pytest.raises(ValueError, match=r"rhs \(1, 256, 128\) must be \[G, K, N\]: K differs"):
    gmm_fp8(jnp.ones((8, 128)), jnp.ones((1, 256, 128)), sizes, interpret=True)
  prepared = fp8_weight(jnp.ones((1, 256, 128)), interpret=True).forward
  with pytest.raises(ValueError, match=r"rhs \(1, 256, 128\) must be laid out by kernel_rhs"):
    gmm_fp8(jnp.ones((8, 128)), prepared, sizes, interpret=True)
  with pytest.raises(ValueError, match=r"dout \(4, 128\) must have the same rows"):
    tgmm_fp8(jnp.ones((8, 128)), jnp.ones((4, 128)), sizes, interpret=True)
