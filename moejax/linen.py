"""`MoELayer` for Flax Linen models, through Flax's NNX-to-Linen bridge."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax.core import FrozenDict, freeze, unfreeze
from flax.nnx import bridge
from jax.sharding import Mesh

from kernels_pallas.quantized import BlockScaled
from moejax import eplb
from moejax.call_record import call_record
from moejax.config import MoEConfig
from moejax.expert_placement import Placement, logical_load
from moejax.layer import MoELayer
from moejax.lora import ExpertLoRA
from moejax.params import MoEParams, expert_arrays


def moe_linen(config: MoEConfig, *, mesh: Mesh | None = None, name: str | None = None) -> nn.Module:
  """A Linen module running `MoELayer(config, mesh=mesh)`; call it as `(x, token_mask)`, with
  the layer's keywords (`router_logits=`, `expert_ids=` for routing replay) as it takes them.

  Its parameters sit in the Linen `params` collection under the layer's own names
  (router_kernel, w_gate_up, w_down, ...), boxed with their sharding metadata. The layer's
  other variables get a collection each, named by type: quantized experts' values and scales
  (and global scales) in `QuantizedWeight` (not trained); the selection bias
  (`use_routing_bias`) in `SelectionBias` (moved by `moejax.balancing`, not trained); with
  redundant experts the placement in `ExpertPlacement` and the counted load in `ExpertLoad`,
  which `apply` updates only when told (`mutable=["ExpertLoad"]`), and which `rebalance`
  uses.

  >>> import jax, jax.numpy as jnp
  >>> config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16)
  >>> module = moe_linen(config)
  >>> variables = module.init(jax.random.key(0), jnp.ones((2, 8)))
  >>> sorted(variables["params"])
  ['router_kernel', 'w_down', 'w_gate_up']
  """
  return bridge.to_linen(MoELayer, config, mesh=mesh, name=name)


def rebalance(
  variables: Mapping[str, Any],
  config: MoEConfig,
  *,
  path: Sequence[str] = (),
  load: np.ndarray | None = None,
) -> tuple[dict[str, Any], Placement]:
  """`MoELayer.rebalance` for a `moe_linen` module's variables: re-places the experts by
  DeepSeek's policy (one node, the expert axis's devices) and moves their weights
  (`moejax.eplb.rebalance_weights`); the load starts again from zero.

  Args:
    variables: the model's variables, as `init` and `apply(..., mutable=...)` give them (boxed
      or not), with the module's own at `path` in each collection.
    config: the module's config (with `num_redundant_experts`).
    path: the module's names from each collection's root, e.g. ("block_0", "moe"); () when
      `variables` are the module's own.
    load: [E] load of each logical expert; None for the `ExpertLoad` counted since the last
      rebalance (summed over each expert's replicas).

  Returns:
    (the variables with the module's expert weights moved, its `ExpertPlacement` the new
    placement and its `ExpertLoad` zero, the rest as given, a `FrozenDict` if they came as
    one; the new placement).

  Raises:
    ValueError: the config has no redundant experts, a collection lacks the module at `path`,
      or `load` is not [E].

  >>> import jax, jax.numpy as jnp
  >>> config = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=16,
  ...                    num_redundant_experts=2)
  >>> variables = moe_linen(config).init(jax.random.key(0), jnp.ones((2, 8)))
  >>> variables, placement = rebalance(variables, config, load=np.array([1, 1, 1, 9]))
  >>> placement.replica_counts.tolist()
  [1, 1, 1, 3]
  """
  if not config.num_redundant_experts:
    raise ValueError("rebalance needs redundant experts: config.num_redundant_experts is 0")
  frozen = isinstance(variables, FrozenDict)
  variables = unfreeze(variables)
  own = {collection: _module_of(variables, collection, path) for collection in _collections(config)}
  params, current, counted = _read(own, config)
  if load is None:
    load = logical_load(counted, current)
  moved, new = eplb.rebalance_weights(params, config, current=current, load=load)
  _write(own, moved, new)
  return (freeze(variables) if frozen else variables), new


def _read(own: dict[str, dict], config: MoEConfig) -> tuple[MoEParams, Placement, np.ndarray]:
  """The module's parameters, placement and counted load [P] (on the host) from its
  variables in each collection."""
  record = call_record(config)
  params = MoEParams(
    **{
      name: _matrix(own["QuantizedWeight"][name], config)
      if name in record.quantized
      else _unboxed(own[_collection_of(name)][name])
      for name in record.params
    }
  )
  if config.lora_rank:
    adapters = own["LoRAParam"]["lora"]
    params = params._replace(
      lora=ExpertLoRA(*(_unboxed(adapters[field]) for field in ExpertLoRA._fields))
    )
  placement = own["ExpertPlacement"]["placement"]
  current = Placement(*(_unboxed(placement[field]) for field in Placement._fields))
  return params, current, jax.device_get(_unboxed(own["ExpertLoad"]["expert_load"]))


def _write(own: dict[str, dict], moved: MoEParams, new: Placement) -> None:
  """Puts the moved expert weights and the new placement in the module's variables, each in
  the place (box, devices) of the value it replaces, and zeroes its load."""
  for name, part, value in expert_arrays(moved):
    if part is None:
      home, key = own["params"], name
    else:  # a quantized matrix's leaf, or an adapter's field
      home, key = own["LoRAParam" if name == "lora" else "QuantizedWeight"][name], part
    home[key] = _reboxed(home[key], value)
  placement = own["ExpertPlacement"]["placement"]
  for field, value in zip(Placement._fields, new, strict=True):
    placement[field] = _host_value_like(placement[field], value)
  load = own["ExpertLoad"]
  counted = _unboxed(load["expert_load"])
  load["expert_load"] = _host_value_like(
    load["expert_load"], np.zeros(counted.shape, counted.dtype)
  )


def _collections(config: MoEConfig) -> tuple[str, ...]:
  """The Linen collections holding what `rebalance` reads and writes."""
  quantized = ("QuantizedWeight",) if config.expert_quant else ()
  adapters = ("LoRAParam",) if config.lora_rank else ()
  bias = ("SelectionBias",) if config.use_routing_bias else ()
  return ("params", "ExpertPlacement", "ExpertLoad", *quantized, *adapters, *bias)


def _collection_of(name: str) -> str:
  """The Linen collection of a float parameter (a `MoEParams` field): the selection bias's
  own (`moejax.layer.SelectionBias`), else `params`."""
  return "SelectionBias" if name == "routing_bias" else "params"


def _module_of(variables: dict, collection: str, path: Sequence[str]) -> dict:
  """The module's variables in one collection (the same dict: writes reach `variables`)."""
  given = "pass every collection, as init and apply(..., mutable=...) give them"
  if collection not in variables:
    raise ValueError(f"variables has no {collection!r} collection: {given}")
  tree = variables[collection]
  for name in path:
    tree = tree.get(name) if isinstance(tree, dict) else None
  if not isinstance(tree, dict):
    raise ValueError(f"variables[{collection!r}] has no module at path={tuple(path)!r}")
  return tree


def _unboxed(leaf):
  return leaf.unbox() if isinstance(leaf, nn.meta.AxisMetadata) else leaf


def _reboxed(leaf, value):
  """`value` in `leaf`'s place, in its box if it has one."""
  return leaf.replace_boxed(value) if isinstance(leaf, nn.meta.AxisMetadata) else value


def _host_value_like(leaf, value: np.ndarray):
  """A host value in `leaf`'s place, on its devices and in its box."""
  return _reboxed(leaf, jax.device_put(np.asarray(value), _unboxed(leaf).sharding))


def _matrix(variables: dict, config: MoEConfig) -> BlockScaled:
  """A quantized expert matrix from its `QuantizedWeight` leaves."""
  return BlockScaled.from_parts(
    {part: _unboxed(leaf) for part, leaf in variables.items()}, config.quant_block
  )
