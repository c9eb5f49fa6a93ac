"""Stacks of MoE layers as deep models build them (`nnx.vmap` to create, `nnx.scan` to apply):
placed by their metadata without silent mis-sharding, and aux losses summed as unrolled."""

import chex
import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from moejax import MoEConfig, MoELayer, param_shapes
from moejax.models import shard_model
from moejax.train import summed_aux
from tests.helpers import mesh_of, seed_of, tolerance

CONFIG = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32)
LAYERS = 3


class Stack(nnx.Module):
  """LAYERS `MoELayer`s with a leading layer axis; `transform_metadata` as the user passes it."""

  def __init__(self, transform_metadata: dict | None, *, rngs: nnx.Rngs):
    self.metadata = (
      {} if transform_metadata is None else dict(transform_metadata=transform_metadata)
    )

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0, **self.metadata)
    def make(rngs):
      return MoELayer(CONFIG, rngs=rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, **self.metadata)
    def apply(x, layer):
      return x + layer(x)

    return apply(x, self.layers)


class Unrolled(nnx.Module):
  """The same layers as a list, weights copied from a `Stack`."""

  def __init__(self, stack: Stack):
    self.layers = nnx.List([MoELayer(CONFIG, rngs=nnx.Rngs(0)) for _ in range(LAYERS)])
    for i, layer in enumerate(self.layers):
      for name in param_shapes(CONFIG):
        getattr(layer, name).set_value(getattr(stack.layers, name).get_value()[i])

  def __call__(self, x):
    for layer in self.layers:
      x = x + layer(x)
    return x


def test_a_stack_without_layer_metadata_is_refused_not_mis_sharded():
  """Without `transform_metadata` a stacked weight [N, E, D, 2F] keeps the spec of one layer,
  ("expert", None, None): placed as is it would split the layer axis over "expert"."""
  with pytest.raises(
    ValueError, match=r"layers\.\w+: .* rank \d, the array .* rank \d.*transform_metadata"
  ):
    shard_model(Stack(None, rngs=nnx.Rngs(0)), mesh_of(2, 4))


@pytest.mark.parametrize("layer_axis", [None, "layers"])
def test_a_stack_with_its_layer_axis_named_none_or_layers_is_placed(layer_axis):
  stack = Stack({nnx.PARTITION_NAME: layer_axis}, rngs=nnx.Rngs(0))
  shard_model(stack, mesh_of(2, 4))
  weight = stack.layers.w_gate_up.get_value()
  chex.assert_shape(weight, (LAYERS, 8, 16, 64))
  assert weight.sharding.spec == P(None, "expert", None, None), weight.sharding


def test_scanned_aux_losses_sum_as_unrolled(request):
  """A scanned stack equals the unrolled layers, and `summed_aux` gives the same losses and
  per-layer expert counts for both (collect_aux: one [N] entry against N [] entries)."""
  stack = Stack({nnx.PARTITION_NAME: None}, rngs=nnx.Rngs(seed_of(request.node.name) % 2**31))
  unrolled = Unrolled(stack)
  x = jax.random.normal(jax.random.key(1), (24, CONFIG.hidden_size))
  y_stack, stacked = nnx.capture(stack, nnx.Intermediate)(x)
  y_unrolled, each = nnx.capture(unrolled, nnx.Intermediate)(x)
  chex.assert_trees_all_close(y_stack, y_unrolled, **tolerance())
  got, want = summed_aux(stacked), summed_aux(each)
  chex.assert_shape(got["expert_counts"], (LAYERS, CONFIG.num_experts))
  chex.assert_trees_all_close(got, want, **tolerance())
  assert float(got["load_balancing_loss"]) > LAYERS * 0.5  # three layers' losses, each ~1
