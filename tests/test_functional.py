"""`moejax.moe_mlp`: the routed experts on plain arrays, with the caller's expert ids and
combine weights, against a dense loop written here (float32): each stored gate/up layout, one
device and the 2x4 mesh with both exchange schemes, forward and every gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax.testing import poison, random_params
from tests.helpers import BASE, assert_close, mesh_of, seed_of, slow

E, D, F, K, T = 8, 16, 24, 3, 40


def routed(seed: int):
  """Random tokens, weights, distinct ids [T, K], combine weights of either sign, a mask."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(T, D)).astype(np.float32)
  w_gate_up = (rng.normal(size=(E, D, 2 * F)) / np.sqrt(D)).astype(np.float32)
  w_down = (rng.normal(size=(E, F, D)) / np.sqrt(F)).astype(np.float32)
  ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
  weights = rng.uniform(-0.5, 1.5, size=(T, K)).astype(np.float32)
  mask = rng.random(T) < 0.75
  return x, ids, weights, w_gate_up, w_down, mask


def dense(x, ids, weights, w_gate_up, w_down, mask):
  """sum_k weights[t, k] * silu(x W_gate) * (x W_up) W_down of expert ids[t, k], masked."""
  hi = jax.lax.Precision.HIGHEST
  gate_up = jnp.einsum("td,tkdf->tkf", x, w_gate_up[ids], precision=hi)  # [T, K, 2F]
  hidden = jax.nn.silu(gate_up[..., :F]) * gate_up[..., F:]
  out = jnp.einsum("tkf,tkfd->tkd", hidden, w_down[ids], precision=hi)
  return jnp.where(mask[:, None], jnp.einsum("tk,tkd->td", weights, out), 0.0)


@pytest.mark.parametrize("layout", ["concatenated", "interleaved", "separate"])
def test_each_stored_layout_is_the_dense_loop(layout, request):
  x, ids, weights, w_gate_up, w_down, mask = routed(seed_of(request.node.name))
  stored = {"w_gate_up": w_gate_up}
  if layout == "interleaved":  # gate at even columns, up at odd ones
    stored = {"w_gate_up": np.stack([w_gate_up[..., :F], w_gate_up[..., F:]], -1).reshape(E, D, -1)}
  elif layout == "separate":
    stored = {"w_gate_up": w_gate_up[..., :F], "w_up": w_gate_up[..., F:]}
  layout_flag = {"gate_up_layout": "interleaved"} if layout == "interleaved" else {}
  y, aux = moejax.moe_mlp(
    poison(jnp.asarray(x), jnp.asarray(mask)), ids, weights, w_down=w_down, token_mask=mask,
    chunk_size=8, **stored, **layout_flag,
  )  # fmt: skip
  assert_close(y, dense(x, ids, weights, w_gate_up, w_down, mask), what=f"y ({layout})")
  assert float(aux.load_balancing_loss) == 0.0 and float(aux.router_z_loss) == 0.0
  np.testing.assert_array_equal(aux.expert_weights, np.where(mask[:, None], weights, 0.0))


@pytest.mark.parametrize("dispatch", [slow("all_gather"), "all_to_all"])
def test_on_a_mesh_with_every_gradient(dispatch, request):
  """The 2x4 mesh: y and the gradients of x, both weights and the combine weights."""
  x, ids, weights, w_gate_up, w_down, mask = routed(seed_of(request.node.name))
  mesh = mesh_of(2, 4)

  def loss(x, weights, w_gate_up, w_down):
    y, _ = moejax.moe_mlp(
      x, ids, weights, w_gate_up, w_down, mesh=mesh, token_mask=mask, dispatch=dispatch,
      chunk_size=4,
    )  # fmt: skip
    return jnp.sum(jnp.sin(y))

  want_loss = lambda *args: jnp.sum(jnp.sin(dense(args[0], ids, args[1], *args[2:], mask)))
  args = tuple(map(jnp.asarray, (x, weights, w_gate_up, w_down)))
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)
  want = jax.value_and_grad(want_loss, argnums=(0, 1, 2, 3))(*args)
  assert_close(got[0], want[0], what="loss")
  for name, g, w in zip(("x", "weights", "w_gate_up", "w_down"), got[1], want[1], strict=True):
    assert float(jnp.abs(w).max()) > 0
    assert_close(g, w, what=f"d{name}")


def test_combine_weights_through_moe_apply_keep_the_layers_shared_experts(request):
  """`moe_apply(..., expert_ids=, combine_weights=)` on a layer with its own router and a
  shared expert: the routed part weighed by the given weights (no renormalization, no
  scaling), the shared expert as ever; the reference agrees."""
  seed = seed_of(request.node.name)
  config = moejax.MoEConfig(
    **{**BASE, "top_k": K}, num_shared_experts=1, shared_intermediate_size=8,
    renormalize=True, routed_scaling_factor=2.5,
  )  # fmt: skip
  params = random_params(config, jax.random.key(seed))
  x, ids, weights, *_ = routed(seed)
  y, aux = moejax.moe_apply(params, x, config=config, expert_ids=ids, combine_weights=weights)
  want = moejax.reference_moe(params, x, config, expert_ids=ids, combine_weights=weights)
  assert_close(y, want, what="y")
  np.testing.assert_array_equal(aux.expert_weights, weights)
  assert float(aux.load_balancing_loss) > 0  # the layer's router still scores for its losses


@pytest.mark.parametrize(
  "call, message",
  [
    (dict(combine_weights=np.ones((T, K), np.float32)), "combine_weights is given without"),
    (dict(expert_ids=np.zeros((T, K), np.int32) + np.arange(K), combine_weights=np.ones((T, 2))),
     r"combine_weights has shape \(40, 2\); expected expert_ids' shape \(40, 3\)"),
  ],
)  # fmt: skip
def test_bad_combine_weights_are_named(call, message):
  config = moejax.MoEConfig(**{**BASE, "top_k": K})
  params = random_params(config, jax.random.key(0))
  with pytest.raises(ValueError, match=message):
    moejax.moe_apply(params, np.ones((T, BASE["hidden_size"]), np.float32), config=config, **call)


def test_a_separate_up_of_another_shape_is_named():
  x, ids, weights, w_gate_up, w_down, _ = routed(0)
  with pytest.raises(ValueError, match=r"w_up has shape \(8, 16, 12\); expected the gate's"):
    moejax.moe_mlp(x, ids, weights, w_gate_up[..., :F], w_down, w_up=w_gate_up[..., :12])


def test_an_activation_of_the_callers_own_runs_on_the_tile_loop(request):
  """A (gate, up) -> hidden function as the activation: the tile loop runs it, gradients
  included; kernels are never asked to (the plan says why), and tuning refuses it by name."""
  x, ids, weights, w_gate_up, w_down, mask = routed(seed_of(request.node.name))
  relu2 = lambda gate, up: jnp.square(jax.nn.relu(gate)) * up  # not among the named ones

  def dense_relu2(w_gate_up):
    hi = jax.lax.Precision.HIGHEST
    gate_up = jnp.einsum("td,tkdf->tkf", x, w_gate_up[ids], precision=hi)
    hidden = relu2(gate_up[..., :F], gate_up[..., F:])
    out = jnp.einsum("tkf,tkfd->tkd", hidden, w_down[ids], precision=hi)
    return jnp.where(mask[:, None], jnp.einsum("tk,tkd->td", weights, out), 0.0)

  call = lambda w: moejax.moe_mlp(x, ids, weights, w, w_down, activation=relu2, token_mask=mask)
  assert_close(call(w_gate_up)[0], dense_relu2(w_gate_up), what="y")
  grad = jax.grad(lambda w: jnp.sum(jnp.sin(call(w)[0])))(jnp.asarray(w_gate_up))
  want = jax.grad(lambda w: jnp.sum(jnp.sin(dense_relu2(w))))(jnp.asarray(w_gate_up))
  scale = float(jnp.abs(want).max())  # squared ReLU's gradients span orders of magnitude
  assert_close(grad / scale, want / scale, what="dw_gate_up over its largest")
  config = moejax.MoEConfig(**{**BASE, "activation": relu2, "expert_backend": "pallas"})
  plan = moejax.plan_call(config, (T, 16))
  assert plan.expert.path == "tile_loop"
  assert "falls back to the XLA tile loop: no kernel runs it (triton: activation=<function" in (
    plan.expert_warning
  )
  with pytest.raises(ValueError, match="is a function: tuning files key their entries by"):
    moejax.tune(config)
