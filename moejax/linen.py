"""`MoELayer` for Flax Linen models, through Flax's NNX-to-Linen bridge."""

from __future__ import annotations

from flax import linen as nn
from flax.nnx import bridge
from jax.sharding import Mesh

from moejax.config import MoEConfig
from moejax.layer import MoELayer


def moe_linen(config: MoEConfig, *, mesh: Mesh | None = None, name: str | None = None) -> nn.Module:
  """A Linen module running `MoELayer(config, mesh=mesh)`; call it as `(x, token_mask)`.

  Its parameters sit in the Linen `params` collection under the layer's own names
  (router_kernel, w_gate_up, w_down, ...), boxed with their sharding metadata. The layer's
  other variables get a collection each, named by type: quantized experts' values and scales
  in `QuantizedWeight` (not trained); with redundant experts the placement in
  `ExpertPlacement` and the counted load in `ExpertLoad`, which `apply` updates only when
  told (`mutable=["ExpertLoad"]`).

  >>> import jax, jax.numpy as jnp
  >>> config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16)
  >>> module = moe_linen(config)
  >>> variables = module.init(jax.random.key(0), jnp.ones((2, 8)))
  >>> sorted(variables["params"])
  ['router_kernel', 'w_down', 'w_gate_up']
  """
  return bridge.to_linen(MoELayer, config, mesh=mesh, name=name)
