"""The public contract: the NNX module, one compile per shape, one router run, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import MoEAux, MoEConfig, MoELayer, moe_apply, param_shapes, reference_moe
from moejax.layer import SelectionBias
from moejax.testing import poison, random_params, rank_mask
from tests.helpers import assert_close, count_compiles, mesh_of, seed_of

CONFIG = MoEConfig(
  num_experts=8,
  top_k=2,
  hidden_size=16,
  intermediate_size=32,
  chunk_size=4,
  use_routing_bias=True,
  num_shared_experts=1,
  shared_intermediate_size=8,
)


def masks(seed: int, count: int, shape) -> list[jax.Array]:
  keys = jax.random.split(jax.random.key(seed), count)
  return [
    jax.random.bernoulli(k, p, shape) for k, p in zip(keys, np.linspace(0, 1, count), strict=True)
  ]


def test_layer_parameters_are_the_checkpoint_format():
  """Every parameter under its checkpoint name; the selection bias a `SelectionBias` (state,
  not an `nnx.Param`: no optimizer trains or decays it)."""
  layer = MoELayer(CONFIG, mesh=mesh_of(2, 4), rngs=nnx.Rngs(0))
  state = nnx.state(layer, (nnx.Param, SelectionBias))
  assert list(nnx.state(layer, SelectionBias)) == ["routing_bias"]
  shapes = {name: tuple(v.shape) for name, v in state.items()}
  assert (
    shapes
    == param_shapes(CONFIG)
    == {
      "router_kernel": (16, 8),
      "routing_bias": (8,),
      "w_gate_up": (8, 16, 64),
      "w_down": (8, 32, 16),
      "shared_w_gate_up": (16, 16),
      "shared_w_down": (8, 16),
    }
  )
  specs = nnx.get_partition_spec(state)
  assert specs["w_gate_up"].get_value() == P("expert", None, None)
  assert specs["router_kernel"].get_value() == P(None, None)
  assert layer.w_down[...].sharding.spec == P("expert", None, None)


def test_layer_without_mesh_matches_reference_and_sows_aux(request):
  layer = MoELayer(CONFIG, rngs=nnx.Rngs(seed_of(request.node.name)))
  x = jax.random.normal(jax.random.key(1), (2, 9, 16))
  mask = jax.random.bernoulli(jax.random.key(2), 0.6, (2, 9))
  y, aux = nnx.capture(layer, nnx.Intermediate)(poison(x, mask), mask)
  assert_close(y, reference_moe(layer.moe_params(), x, CONFIG, mask), what="y")
  assert int(aux["expert_counts"][0].sum()) == 2 * int(mask.sum())
  per_device = {"chunks_run", "dispatch_rows", "physical_counts", "overflowed_chunks"}
  per_device |= {"overflowed_rows", "dropped_assignments"}
  assert set(aux) == set(MoEAux._fields) - per_device
  layer(x, mask)  # outside capture: no sow, no warning (warnings are errors here)


def test_no_new_compilation_when_only_the_mask_changes(request):
  mesh = mesh_of(2, 4)
  layer = MoELayer(CONFIG, mesh=mesh, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(seed_of(request.node.name)), (48, 16))
  patterns = [*masks(1, 4, (48,)), rank_mask([0, 6, 0, 6, 0, 0, 0, 0], 6)]

  @nnx.jit
  def jitted(layer, x, mask):
    return layer(x, mask)

  for call in (layer, lambda x, mask: jitted(layer, x, mask)):
    call(x, patterns[0])  # compile once
    with count_compiles() as compiles:
      for mask in patterns[1:]:
        jax.block_until_ready(call(x, mask))
    assert compiles == [], f"{len(compiles)} compilations for new masks"


def sub_jaxprs(value):
  """Jaxprs nested in an equation parameter (jit, shard_map, scan, cond branches...)."""
  values = value if isinstance(value, tuple | list) else (value,)
  for item in values:
    inner = getattr(item, "jaxpr", item)
    if hasattr(inner, "eqns"):
      yield inner


def count_router_matmuls(fn, *args) -> int:
  """dot_generals anywhere in fn's jaxpr with the router kernel [D=16, E=8] as an operand."""

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        yield any(tuple(v.aval.shape) == (16, 8) for v in eqn.invars)
      for param in eqn.params.values():
        for inner in sub_jaxprs(param):
          yield from walk(inner)

  return sum(walk(jax.make_jaxpr(fn)(*args).jaxpr))


def test_router_runs_once_and_not_with_external_logits(request):
  key = jax.random.key(seed_of(request.node.name))
  params = random_params(CONFIG, key)
  x = jax.random.normal(jax.random.fold_in(key, 1), (40, 16))
  mesh = mesh_of(2, 4)
  forward = lambda p, x: moe_apply(p, x, config=CONFIG, mesh=mesh)[0]
  assert count_router_matmuls(forward, params, x) == 1
  logits = jax.random.normal(jax.random.fold_in(key, 2), (40, 8))
  external = lambda p, x, lg: moe_apply(p, x, config=CONFIG, mesh=mesh, router_logits=lg)[0]
  assert count_router_matmuls(external, params, x, logits) == 0
  y = external(params, x, logits)
  assert_close(y, reference_moe(params, x, CONFIG, router_logits=logits), what="y, ext. logits")
  # The router kernel takes no gradient when the logits come from outside.
  grad = jax.grad(lambda p: jnp.sum(external(p, x, logits)))(params)
  assert float(jnp.abs(grad.router_kernel).max()) == 0.0


def test_trains_with_optax(request):
  config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16, chunk_size=8)
  model = MoELayer(config, mesh=mesh_of(2, 4), rngs=nnx.Rngs(seed_of(request.node.name)))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(0), (64, 8))
  target = jnp.tanh(x[:, ::-1])

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(30)]
  assert losses[-1] < 0.7 * losses[0], losses


BAD_CALLS = {
  "hidden size": (dict(x=jnp.ones((4, 15))), ValueError, "hidden_size=16"),
  "mask shape": (dict(token_mask=jnp.ones((5,), bool)), ValueError, "token_mask has shape"),
  "mask dtype": (dict(token_mask=jnp.ones((4,), jnp.int32)), TypeError, "token_mask must be bool"),
  "int x": (dict(x=jnp.ones((4, 16), jnp.int32)), TypeError, "x must be a floating"),
  "logits shape": (dict(router_logits=jnp.ones((4, 7))), ValueError, "router_logits has shape"),
  "missing axis": (dict(mesh=mesh_of(2, 4, ("data", "model"))), ValueError, "config.expert_axis"),
  "expert axis": (dict(mesh=mesh_of(1, 3)), ValueError, "divisible by the size of expert_axis"),
  "mesh type": (dict(mesh="2x4"), TypeError, "mesh must be a jax.sharding.Mesh"),
  "params": (dict(params="drop_bias"), ValueError, "params.routing_bias is missing"),
  "params as a dict": (dict(params="as_dict"), TypeError, "params must be a moejax.MoEParams"),
  "mask as a list": (dict(token_mask=[True] * 4), TypeError, "token_mask must be an array"),
}


@pytest.mark.parametrize("case", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_input_raises_before_xla(case):
  overrides, error, message = case
  params = random_params(CONFIG, jax.random.key(0))
  args = dict(x=jnp.ones((4, 16)), config=CONFIG, mesh=None, token_mask=None, router_logits=None)
  args.update(overrides)
  change = args.pop("params", None)
  if change == "drop_bias":
    params = params._replace(routing_bias=None)
  if change == "as_dict":
    params = params._asdict()
  x = args.pop("x")
  with pytest.raises(error, match=message):
    moe_apply(params, x, **args)


def test_layer_rejects_a_mesh_that_does_not_fit():
  with pytest.raises(ValueError, match="divisible"):
    MoELayer(CONFIG, mesh=mesh_of(1, 3), rngs=nnx.Rngs(0))


def test_a_layer_without_a_mesh_refuses_inputs_split_over_one():
  """Unless a mesh is set (`jax.set_mesh`): then the layer runs on it."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"))  # explicit axes by default
  no_mesh = MoELayer(CONFIG, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (40, 16))
  sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
  with pytest.raises(ValueError, match=r"^x is sharded over explicit mesh axes .* no mesh"):
    no_mesh(sharded)
  with jax.set_mesh(mesh):
    y = no_mesh(sharded)
  assert_close(y, reference_moe(no_mesh.moe_params(), x, CONFIG), what="y")
  on_mesh = MoELayer(CONFIG, mesh=mesh, rngs=nnx.Rngs(0)).moe_params()  # made for the mesh
  with pytest.raises(ValueError, match=r"^params.w_gate_up is sharded over explicit mesh axes"):
    moe_apply(on_mesh, x, config=CONFIG)


def test_the_documented_submodules_are_reachable_from_the_package(monkeypatch):
  """`moejax.hf`, `moejax.checkpoint`, ... after a plain `import moejax` (imported on first
  use): reached through the package even where no import has set them on it yet."""
  import importlib

  import moejax
  import moejax.apps

  for name in moejax.SUBMODULES:
    monkeypatch.delattr(moejax, name, raising=False)  # as before any `import moejax.<name>`
    assert getattr(moejax, name) is importlib.import_module(f"moejax.{name}")
  with pytest.raises(AttributeError, match="no attribute 'hff'"):
    moejax.hff  # noqa: B018
  for name in moejax.apps.PUBLIC_NAMES:  # the applications' public names are the modules
    assert importlib.import_module(f"moejax.{name}") is importlib.import_module(
      f"moejax.apps.{name}"
    )


def test_a_failed_eager_gradient_leaves_later_calls_working():
  """An eager `jax.grad` on an explicit-axes mesh without `jax.set_mesh` fails in JAX (its
  message says to set the mesh); the layer's later calls, forward and gradient, still run
  and agree with the reference."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  params = MoELayer(CONFIG, mesh=mesh, rngs=nnx.Rngs(0)).moe_params()
  x = jax.random.normal(jax.random.key(1), (40, 16))
  loss = lambda p, x: jnp.sum(moe_apply(p, x, config=CONFIG, mesh=mesh)[0] ** 2)
  with pytest.raises(ValueError, match=r"jax\.set_mesh"):
    jax.grad(loss)(params, x)
  with jax.set_mesh(mesh):
    grads = jax.grad(loss)(params, x)
  on_host = jax.device_get(params)
  want = jax.grad(lambda p: jnp.sum(reference_moe(p, x, CONFIG) ** 2))(on_host)
  assert_close(grads.w_down, want.w_down, what="w_down's gradient after the failure")
  assert_close(
    moe_apply(params, x, config=CONFIG, mesh=mesh)[0], reference_moe(params, x, CONFIG), what="y"
  )
