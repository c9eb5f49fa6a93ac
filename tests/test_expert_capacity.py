"""Expert capacity (`capacity_factor`): the assignments a device keeps are the first of its
(local expert, row, choice) order, checked against a NumPy rule and the reference run on the
kept ones alone (the dropped ones' weights 0), forward and gradients; counted per device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import MoEConfig, moe_apply, reference_moe
from moejax.testing import poison, random_params
from tests.helpers import assert_close, mesh_of

T, K = 64, 2
CONFIG = MoEConfig(
  num_experts=8, top_k=K, hidden_size=16, intermediate_size=24, external_router=True
)


def kept(ids: np.ndarray, mask: np.ndarray, factor: float, data: int, experts: int) -> np.ndarray:
  """[T, K] bool: the assignments kept, by the rule written out. Tokens are split over the
  data x expert devices, data-major, one chunk each; the devices of one data rank gather
  their shares in expert-rank order; device s keeps the first `capacity` assignments to its
  experts by (expert, gathered row, choice), padding never counted."""
  share, local = len(ids) // (data * experts), CONFIG.num_experts // experts
  capacity = max(local, int(np.ceil(factor * (experts * share * K) / experts)))
  keep = np.zeros(ids.shape, bool)
  for d in range(data):
    rows = np.arange(d * experts * share, (d + 1) * experts * share)
    rows = rows[mask[rows]]  # each device's valid rows come first in its chunk
    for s in range(experts):
      mine = [(ids[r, k], i, k, r) for i, r in enumerate(rows) for k in range(K)]
      mine = sorted(a for a in mine if s * local <= a[0] < (s + 1) * local)
      for _, _, k, r in mine[:capacity]:
        keep[r, k] = True
  return keep


def _inputs(seed: int):
  keys = jax.random.split(jax.random.key(seed), 4)
  params = random_params(CONFIG, keys[0])
  x = jax.random.normal(keys[1], (T, CONFIG.hidden_size))
  skewed = jax.random.normal(keys[2], (T, CONFIG.num_experts)) + jnp.arange(8.0)[None, :] / 2
  weights, ids = jax.lax.top_k(jax.nn.softmax(skewed), K)  # the last experts overloaded
  mask = jax.random.bernoulli(keys[3], 0.8, (T,))
  return params, x, ids.astype(jnp.int32), weights, mask


@pytest.mark.parametrize(
  "data, experts, factor, dispatch",
  [(1, 1, 0.5, "all_gather"), (2, 4, 1.0, "all_gather"), (2, 4, 1.0, "all_to_all")],
  ids=["one device", "2x4 all_gather", "2x4 all_to_all"],
)
def test_keeps_the_first_assignments_by_expert_and_drops_the_rest(data, experts, factor, dispatch):
  """all_to_all's packed rows arrive in the order all_gather's do (source device, then row):
  the same assignments drop."""
  params, x, ids, weights, mask = _inputs(data * 10 + experts)
  mesh = None if data * experts == 1 else mesh_of(data, experts)
  share = T // (data * experts)
  config = dataclasses.replace(CONFIG, capacity_factor=factor, chunk_size=share, dispatch=dispatch)
  keep = kept(np.asarray(ids), np.asarray(mask), factor, data, experts)
  assert 0 < (~keep & np.asarray(mask)[:, None]).sum() < mask.sum() * K  # some drop, not all
  cotangent = jax.random.normal(jax.random.key(5), x.shape)

  def ours(x, weights):
    y, aux = moe_apply(
      params, poison(x, mask), config=config, mesh=mesh, token_mask=mask, expert_ids=ids,
      combine_weights=weights,
    )  # fmt: skip
    return jnp.sum(y * cotangent), (y, aux)

  def reference(x, weights):
    y = reference_moe(
      params, x, CONFIG, token_mask=mask, expert_ids=ids, combine_weights=weights * keep
    )
    return jnp.sum(y * cotangent), y

  (_, (y, aux)), grads = jax.value_and_grad(ours, argnums=(0, 1), has_aux=True)(x, weights)
  (_, y_ref), grads_ref = jax.value_and_grad(reference, argnums=(0, 1), has_aux=True)(x, weights)
  assert_close(y, y_ref, what="y")
  valid = np.asarray(mask)[:, None]
  for name, got, want in zip(("x", "weights"), grads, grads_ref, strict=True):
    assert_close(np.where(valid, got, 0), want, what=f"d/d {name}")
  dropped = (~keep & valid).reshape(data * experts, share, K)
  # each device counts the assignments dropped at its experts, not its tokens' drops
  assert int(aux.dropped_assignments.sum()) == int(dropped.sum())
  assert aux.dropped_assignments.shape == (data * experts,)


def test_dropless_counts_nothing_and_a_bad_factor_is_named():
  params, x, ids, weights, _ = _inputs(0)
  _, aux = moe_apply(params, x, config=CONFIG, expert_ids=ids, combine_weights=weights)
  assert aux.dropped_assignments.tolist() == [0]
  for overrides, message in [
    ({"capacity_factor": 0.0}, r"^capacity_factor must be a number > 0 or None, got 0\.0$"),
    (
      {"capacity_factor": 1.0, "batch_invariant": True},
      r"^capacity_factor=1\.0 cannot be used with batch_invariant: which assignments drop",
    ),
    (
      {"capacity_factor": 1.0, "receive_capacity_factor": 2.0, "dispatch": "all_to_all"},
      r"^capacity_factor=1\.0 cannot be used with receive_capacity_factor: its sub-chunks",
    ),
  ]:
    with pytest.raises(ValueError, match=message):
      dataclasses.replace(CONFIG, **overrides)
