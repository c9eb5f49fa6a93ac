"""A stack of MoE layers as deep models build it: `nnx.vmap` to create, `nnx.scan` to apply."""

from flax import nnx

from moejax import MoEConfig, MoELayer

CONFIG = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32)
LAYERS = 3


class Stack(nnx.Module):
  """`layers` `MoELayer`s with a leading layer axis; `transform_metadata` as the user passes it."""

  def __init__(
    self,
    transform_metadata: dict | None,
    *,
    rngs: nnx.Rngs,
    config: MoEConfig = CONFIG,
    mesh=None,
    layers: int = LAYERS,
  ):
    self.metadata = (
      {} if transform_metadata is None else dict(transform_metadata=transform_metadata)
    )

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, **self.metadata)
    def make(rngs):
      return MoELayer(config, mesh=mesh, rngs=rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, **self.metadata)
    def apply(x, layer):
      return x + layer(x)

    return apply(x, self.layers)
