"""ZAYA's router, which its MoE layer does not hold (`MoEConfig.external_router`): an MLP over
a narrow projection of the token, to which every layer but the first adds the previous
layer's projection, the router state that flows from MoE layer to MoE layer. The model runs
it and passes its logits to the layer (`router_logits=`): `load_zaya_router` reads a layer's
router, `zaya_router_logits` computes its logits and the state for the next layer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from moejax.hf.configs import check_moe_layer, text_model
from moejax.hf.families import Read, family_of
from moejax.hf.safetensors_files import SafetensorsFiles


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ZayaRouter:
  """One layer's router weights as [in, out] matrices (R: `router_hidden_size`; E + 1
  classes: the E experts, then the skip class).

  Attributes:
    down_kernel: [D, R] the token's projection; down_bias: [R].
    state_scale: [R] the scale of the previous layer's state, or None (the first layer).
    norm_scale: [R] the scale of the RMS norm the MLP starts with.
    fc1_kernel, fc2_kernel: [R, R], each followed by its bias ([R]) and an exact GELU.
    fc1_bias, fc2_bias: [R].
    out_kernel: [R, E + 1] the logits.
    eps: the norm's epsilon (config.json's `rms_norm_eps`); static.
  """

  down_kernel: jax.Array
  down_bias: jax.Array
  state_scale: jax.Array | None
  norm_scale: jax.Array
  fc1_kernel: jax.Array
  fc1_bias: jax.Array
  fc2_kernel: jax.Array
  fc2_bias: jax.Array
  out_kernel: jax.Array
  eps: float = dataclasses.field(default=1e-5, metadata=dict(static=True))


def load_zaya_router(path: str | Path, layer: int) -> ZayaRouter:
  """The router of ZAYA's MoE layer `layer` from a checkpoint folder, as float32 arrays.

  Raises:
    ValueError: the checkpoint is not a ZAYA model, or `layer` is not one of its MoE layers.
    KeyError: a router tensor is missing (named).
  """
  path = Path(path)
  hf = text_model(json.loads((path / "config.json").read_text()))
  if hf.get("model_type") != "zaya":
    raise ValueError(f"{path} holds a {hf.get('model_type')!r} model, not ZAYA ('zaya')")
  family = family_of("zaya")
  check_moe_layer(hf, family, layer)
  d, r = Read("hidden_size")(hf), Read("router_hidden_size", 256)(hf)
  classes = Read("num_experts", 16)(hf) + 1
  gate = f"{family.block.format(layer=layer)}.gate"
  with SafetensorsFiles(path) as files:
    get = lambda name, shape: jnp.asarray(files.get(f"{gate}.{name}", shape))
    first_layer = f"{gate}.router_states_scale" not in files
    return ZayaRouter(
      down_kernel=get("down_proj.weight", (r, d)).T,
      down_bias=get("down_proj.bias", (r,)),
      state_scale=None if first_layer else get("router_states_scale", (r,)),
      norm_scale=get("router_mlp.norm.weight", (r,)),
      fc1_kernel=get("router_mlp.fc1.weight", (r, r)).T,
      fc1_bias=get("router_mlp.fc1.bias", (r,)),
      fc2_kernel=get("router_mlp.fc2.weight", (r, r)).T,
      fc2_bias=get("router_mlp.fc2.bias", (r,)),
      out_kernel=get("router_mlp.out_proj.weight", (classes, r)).T,
      eps=float(Read("rms_norm_eps", 1e-5)(hf)),
    )


def zaya_router_logits(
  router: ZayaRouter, x: jax.Array, state: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """A ZAYA layer's router logits, for its MoE layer's `router_logits=`.

  Args:
    router: the layer's `ZayaRouter`.
    x: [..., D] the tokens, the MoE layer's input.
    state: [..., R] the previous MoE layer's router state (what this function returned for
      it), or None for the first layer (which has no `state_scale` and takes none).

  Returns:
    (logits [..., E + 1] float32: the experts' and the skip class's, the state [..., R] for
    the next layer).

  Raises:
    ValueError: x is not [..., D] or state not [..., R] over x's tokens (named).
  """
  d, r = router.down_kernel.shape
  if x.ndim < 1 or x.shape[-1] != d:
    raise ValueError(f"x has shape {x.shape}; expected [..., hidden_size={d}]")
  if state is not None and state.shape != (*x.shape[:-1], r):
    raise ValueError(f"state has shape {state.shape}; expected {(*x.shape[:-1], r)}")
  lead = x.shape[:-1]
  row = lambda vector: vector[None, :]  # [R] -> [1, R], against [T, R]
  h = x.reshape(-1, x.shape[-1]).astype(jnp.float32) @ router.down_kernel + row(router.down_bias)
  if state is not None and router.state_scale is not None:
    h = h + state.reshape(h.shape) * row(router.state_scale)
  normed = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + router.eps)
  hidden = normed * row(router.norm_scale) @ router.fc1_kernel + row(router.fc1_bias)
  hidden = jax.nn.gelu(hidden, approximate=False)
  hidden = jax.nn.gelu(hidden @ router.fc2_kernel + row(router.fc2_bias), approximate=False)
  logits = hidden @ router.out_kernel
  return logits.reshape(*lead, -1), h.reshape(*lead, -1)
