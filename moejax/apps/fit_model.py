"""The rest of a model around its MoE layers, as `fit` compiles it: a stand-in at config.json's
shapes, so that its weights, gradients, optimizer state and activations are the compiler's
figures, not a formula's.

Every decoder layer is attention (multi-head latent attention where `kv_lora_rank` is set,
else grouped-query) then an FFN: a gated dense one (`intermediate_size`) in the dense layers,
moejax's layer in the MoE layers; each block behind an RMS norm, the input embedded and the
output projected onto the vocabulary. Every weight is split evenly over all devices (along the
first of its dimensions the device count divides) and gathered where it is used, its
gradient reduce-scattered: fully sharded data parallelism. Each device's tokens are one causal
sequence, attended by cuDNN's flash attention (at most 128 dimensions per head in JAX: wider
query-key heads, multi-head latent attention's 192, are scored on their first 128; flash
attention keeps no scores, so its memory does not depend on it). Rotary embeddings, biases,
attention sinks and the latent norms' weights are left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import hf

_DTYPE = jnp.bfloat16
_FLASH_HEAD_DIM = 128  # the widest head cuDNN's attention takes through JAX


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The rest of a model's dimensions, read from its config.json."""

  hidden: int
  vocab: int
  tied_embeddings: bool
  heads: int
  kv_heads: int
  qk_head_dim: int
  v_head_dim: int
  q_lora_rank: int  # 0: queries projected from the hidden state directly
  kv_lora_rank: int  # 0: grouped-query attention
  qk_rope_head_dim: int
  dense_ffn: int
  dense_layers: int
  moe_layers: int


def shapes(config_json: dict[str, Any]) -> Shapes:
  """The dimensions of the model outside its MoE layers' FFNs (`moejax.hf.moe_layers` says
  which layers those are)."""
  config_json = hf.config_json(config_json)
  read = lambda key, default=None: config_json.get(key, default)
  d, heads = read("hidden_size"), read("num_attention_heads")
  layers = hf.family_of(read("model_type")).layers(config_json)
  moe = len(hf.moe_layers(config_json))
  common = dict(
    hidden=d,
    vocab=read("vocab_size"),
    tied_embeddings=bool(read("tie_word_embeddings", False)),
    heads=heads,
    dense_ffn=read("intermediate_size", 0),
    dense_layers=layers - moe,
    moe_layers=moe,
  )
  if read("kv_lora_rank"):
    return Shapes(
      **common,
      kv_heads=heads,
      qk_head_dim=read("qk_nope_head_dim") + read("qk_rope_head_dim"),
      v_head_dim=read("v_head_dim"),
      q_lora_rank=read("q_lora_rank") or 0,
      kv_lora_rank=read("kv_lora_rank"),
      qk_rope_head_dim=read("qk_rope_head_dim"),
    )
  head_dim = read("head_dim") or d // heads
  return Shapes(
    **common,
    kv_heads=read("num_key_value_heads", heads),
    qk_head_dim=head_dim,
    v_head_dim=head_dim,
    q_lora_rank=0,
    kv_lora_rank=0,
    qk_rope_head_dim=0,
  )


def layer_weights(s: Shapes, dense: bool) -> dict[str, tuple[int, ...]]:
  """One decoder layer's weights outside moejax's layer, by name: its shape."""
  d, h = s.hidden, s.heads
  if s.kv_lora_rank:
    nope = s.qk_head_dim - s.qk_rope_head_dim
    attention = {
      "kv_a": (d, s.kv_lora_rank + s.qk_rope_head_dim),
      "kv_b": (s.kv_lora_rank, h * (nope + s.v_head_dim)),
    }
    if s.q_lora_rank:
      attention |= {"q_a": (d, s.q_lora_rank), "q_b": (s.q_lora_rank, h * s.qk_head_dim)}
    else:
      attention["q"] = (d, h * s.qk_head_dim)
  else:
    attention = {
      "q": (d, h * s.qk_head_dim),
      "kv": (d, 2 * s.kv_heads * s.qk_head_dim),
    }
  weights = {
    **attention,
    "o": (h * s.v_head_dim, d),
    "attention_norm": (d,),
    "ffn_norm": (d,),
  }
  if dense:
    weights |= {"ffn_in": (d, 2 * s.dense_ffn), "ffn_out": (s.dense_ffn, d)}
  return weights


def model_weights(s: Shapes) -> dict[str, tuple[int, ...]]:
  """The weights outside the decoder layers: embeddings, the final norm, an untied output
  projection."""
  weights = {"embedding": (s.vocab, s.hidden), "final_norm": (s.hidden,)}
  if not s.tied_embeddings:
    weights["head"] = (s.hidden, s.vocab)
  return weights


def parameter_count(s: Shapes) -> int:
  """Parameters outside the MoE layers' FFNs: every layer's attention and norms, the dense
  layers' FFNs, embeddings, the output projection."""
  size = lambda weights: sum(math.prod(shape) for shape in weights.values())
  return (
    s.dense_layers * size(layer_weights(s, dense=True))
    + s.moe_layers * size(layer_weights(s, dense=False))
    + size(model_weights(s))
  )


def split_dim(shape: tuple[int, ...], devices: int) -> int | None:
  """The dimension a weight is split along over `devices`: the first they divide (None: kept
  whole on every device)."""
  return next((i for i, n in enumerate(shape) if n % devices == 0), None)


def _spec(shape: tuple[int, ...], mesh: Mesh) -> P:
  dim = split_dim(shape, mesh.devices.size)
  return P() if dim is None else P(*([None] * dim), tuple(mesh.axis_names))


def abstract_weights(s: Shapes, mesh: Mesh) -> dict[str, Any]:
  """The stand-in's weights as sharded shapes: "model" (`model_weights`), "dense" and "moe"
  (`layer_weights`, stacked along a leading layer axis that no mesh axis splits)."""

  def place(weights, layers=None):
    lead = () if layers is None else (layers,)
    unsplit = (None,) * len(lead)
    return {
      name: jax.ShapeDtypeStruct(
        (*lead, *shape), _DTYPE, sharding=NamedSharding(mesh, P(*unsplit, *_spec(shape, mesh)))
      )
      for name, shape in weights.items()
    }

  return {
    "model": place(model_weights(s)),
    "dense": place(layer_weights(s, dense=True), s.dense_layers) if s.dense_layers else None,
    "moe": place(layer_weights(s, dense=False), s.moe_layers),
  }


def _gathered(block: Callable, mesh: Mesh, weight_shapes: dict[str, tuple[int, ...]]) -> Callable:
  """`block(weights, x)` run on each device's tokens with every weight whole: gathered from its
  split (`split_dim`) on the way in, so that its gradient is reduce-scattered."""
  axes = tuple(mesh.axis_names)
  devices = mesh.devices.size

  def local(weights, x):
    whole = {}
    for name, w in weights.items():
      dim = split_dim(weight_shapes[name], devices)
      whole[name] = w if dim is None else jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return block(whole, x)

  specs = {name: _spec(shape, mesh) for name, shape in weight_shapes.items()}
  return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(axes)), out_specs=P(axes))


def _rms_norm(x: jax.Array, weight: jax.Array | None = None) -> jax.Array:
  y = x.astype(jnp.float32)
  y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + 1e-6)
  y = y.astype(x.dtype)
  return y if weight is None else y * weight[None]


def _to_width(x: jax.Array, width: int) -> jax.Array:
  """The last dimension sliced or zero-padded to `width`."""
  if x.shape[-1] >= width:
    return x[..., :width]
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _attention(s: Shapes, w: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """Causal self-attention of one device's tokens [T, D] -> [T, D]."""
  t, h = x.shape[0], s.heads
  if s.kv_lora_rank:
    q = _rms_norm(x @ w["q_a"]) @ w["q_b"] if s.q_lora_rank else x @ w["q"]
    latent = x @ w["kv_a"]
    k_rope = latent[:, s.kv_lora_rank :]
    kv = (_rms_norm(latent[:, : s.kv_lora_rank]) @ w["kv_b"]).reshape(t, h, -1)
    nope = s.qk_head_dim - s.qk_rope_head_dim
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, None], (t, h, s.qk_rope_head_dim))], -1)
  else:
    q = x @ w["q"]
    k, v = jnp.split((x @ w["kv"]).reshape(t, 2 * s.kv_heads, s.qk_head_dim), 2, axis=1)
  q = q.reshape(t, h, s.qk_head_dim)
  width = min(s.qk_head_dim, _FLASH_HEAD_DIM)
  q, k, v_in = (_to_width(a, width)[None] for a in (q, k, v))
  out = jax.nn.dot_product_attention(q, k, v_in, is_causal=True, implementation="cudnn")[0]
  return _to_width(out, s.v_head_dim).reshape(t, h * s.v_head_dim) @ w["o"]


def _dense_ffn(w: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  gate, up = jnp.split(x @ w["ffn_in"], 2, axis=-1)
  return (jax.nn.silu(gate) * up) @ w["ffn_out"]


def decoder_layers(
  s: Shapes, mesh: Mesh, moe_ffn: Callable[[Any, jax.Array], jax.Array], policy
) -> tuple[Callable, Callable]:
  """(dense layer, MoE layer): `layer(x, (weights, moe_params)) -> (x, None)`, bodies of
  `lax.scan` over the stacked layers; `moe_ffn(moe_params, x)` is moejax's layer;
  `policy` a `jax.checkpoint` policy or None."""
  attention_shapes = {n: v for n, v in layer_weights(s, dense=False).items() if n != "ffn_norm"}
  ffn_shapes = {n: layer_weights(s, dense=True)[n] for n in ("ffn_norm", "ffn_in", "ffn_out")}
  attention = _gathered(
    lambda w, x: _attention(s, w, _rms_norm(x, w["attention_norm"])), mesh, attention_shapes
  )
  ffn_norm = _gathered(lambda w, x: _rms_norm(x, w["ffn_norm"]), mesh, {"ffn_norm": (s.hidden,)})
  dense_ffn = _gathered(lambda w, x: _dense_ffn(w, _rms_norm(x, w["ffn_norm"])), mesh, ffn_shapes)
  pick = lambda w, names: {n: w[n] for n in names}

  def dense(x, weights):
    w, _ = weights
    x = x + attention(pick(w, attention_shapes), x)
    return x + dense_ffn(pick(w, ffn_shapes), x), None

  def moe(x, weights):
    w, params = weights
    x = x + attention(pick(w, attention_shapes), x)
    return x + moe_ffn(params, ffn_norm(pick(w, ("ffn_norm",)), x)), None

  if policy is not None:
    dense, moe = jax.checkpoint(dense, policy=policy), jax.checkpoint(moe, policy=policy)
  return dense, moe


def embed(s: Shapes, mesh: Mesh, weights: dict[str, jax.Array], ids: jax.Array) -> jax.Array:
  """Token ids [T] -> hidden states [T, D], each device's rows of the gathered table."""
  shape = {"embedding": model_weights(s)["embedding"]}
  look_up = _gathered(lambda w, ids: w["embedding"][ids], mesh, shape)
  return look_up({"embedding": weights["embedding"]}, ids)


def token_loss(
  s: Shapes,
  mesh: Mesh,
  weights: dict[str, jax.Array],
  x: jax.Array,
  ids: jax.Array,
  last_only: bool = False,
) -> jax.Array:
  """Cross-entropy of each token's logits (float32, over the whole vocabulary) against its own
  id, a stand-in for the next token's: per-token losses [T]; with `last_only`, of each
  device's last token alone (what serving computes logits for): [devices]."""
  names = ("final_norm", "embedding" if s.tied_embeddings else "head")

  def loss(w, x_and_ids):
    x, ids = x_and_ids
    if last_only:
      x, ids = x[-1:], ids[-1:]
    head = w["embedding"].T if s.tied_embeddings else w["head"]
    logits = (_rms_norm(x, w["final_norm"]) @ head).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, ids[:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked

  gathered = _gathered(loss, mesh, {n: model_weights(s)[n] for n in names})
  return gathered({n: weights[n] for n in names}, (x, ids))
