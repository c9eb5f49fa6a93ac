"""One layer of a stack and back: the pytrees of layers built with a leading layer axis
(`nnx.vmap`, `nn.scan`), taken apart and put together where per-layer host work needs it
(`moejax.eplb.rebalance_weights`), each array on the devices it came from."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Tree = TypeVar("Tree")


def stacked_sharding(sharding: NamedSharding) -> NamedSharding:
  """A layer's sharding -> its stack's: a leading layer axis on no mesh axis."""
  return NamedSharding(sharding.mesh, P(None, *sharding.spec))


def layer_sharding(sharding: NamedSharding) -> NamedSharding:
  """A stack's sharding -> one layer's: the inverse of `stacked_sharding`."""
  return NamedSharding(sharding.mesh, P(*sharding.spec[1:]))


def layer_of(tree: Tree, index: int) -> Tree:
  """Layer `index` of every leaf [layers, ...] -> [...]: a sharded leaf keeps the rest of its spec
  (a layer's expert weights stay split over the expert axis), a host one stays on the host.

  >>> layer_of({"w": np.arange(6).reshape(3, 2)}, 1)["w"].tolist()
  [2, 3]
  """
  return jax.tree.map(lambda leaf: _slice(leaf, index), tree)


def _slice(leaf, index: int):
  if not isinstance(leaf, jax.Array):
    return np.asarray(leaf)[index]
  found = leaf.sharding
  if isinstance(found, NamedSharding):
    return jax.device_put(leaf[index], layer_sharding(found))
  return leaf[index]


def stack_layers(layers: list[Tree], *, like: Tree) -> Tree:
  """The inverse of `layer_of`: the layers' pytrees -> one with a leading layer axis, each
  leaf laid out as its stacked counterpart in `like`."""
  return jax.tree.map(lambda ref, *leaves: _stacked(ref, leaves), like, *layers)


def _stacked(ref: Any, leaves: tuple) -> Any:
  if not isinstance(ref, jax.Array):
    return np.stack(leaves)
  return jax.device_put(jnp.stack(leaves), ref.sharding)
