"""A small decoder-only transformer whose FFN blocks are `MoELayer`s, and a synthetic task.

The model exists to show the layer in a real model: padded sequences feed the layer's token
mask, the aux losses are summed over layers, and parameters are placed on the mesh by their
sharding metadata (`shard_model`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from moejax import meshes, sharding
from moejax.config import MoEConfig, check_field_types
from moejax.layer import MoELayer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Shape of `MoETransformer`.

  Attributes:
    vocab_size: V.
    num_layers: transformer blocks.
    num_heads: attention heads (hidden_size must divide by it).
    moe: the `MoEConfig` of each MoE block (its hidden_size is the model width D).
    moe_every: 1 = every block's FFN is an MoE layer, 2 = every other one (dense between).
    dense_ffn_size: hidden width of the dense FFN blocks.
    scan_layers: build the blocks as one stack (`nnx.vmap`, a leading layer axis on no mesh
      axis) applied with `nnx.scan`: one step's program compiled however deep the model.
      num_layers must then divide by moe_every: each step is moe_every blocks, the MoE one
      last.
    remat_policy: None to save what autodiff needs; else every block (every scanned group)
      is rematerialized by `nnx.remat` with this `jax.checkpoint` policy, e.g.
      `jax.checkpoint_policies.nothing_saveable`, or
      `save_only_these_names(*moejax.CHECKPOINT_NAMES)` to keep the MoE layer's named values.
  """

  vocab_size: int
  num_layers: int
  num_heads: int
  moe: MoEConfig
  moe_every: int = 1
  dense_ffn_size: int = 128
  scan_layers: bool = False
  remat_policy: Callable | None = None

  def __post_init__(self) -> None:
    check_field_types(self)
    if not isinstance(self.moe, MoEConfig):
      raise TypeError(f"moe must be a moejax.MoEConfig, got {type(self.moe).__name__}")
    for name in ("vocab_size", "num_layers", "num_heads", "dense_ffn_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be a positive int, got {getattr(self, name)}")
    if self.moe.hidden_size % self.num_heads:
      raise ValueError(
        f"hidden_size={self.moe.hidden_size} must divide by num_heads={self.num_heads}"
      )
    if self.moe_every not in (1, 2):
      raise ValueError(f"moe_every must be 1 or 2, got {self.moe_every}")
    if self.num_layers < self.moe_every:
      raise ValueError(
        f"num_layers={self.num_layers} with moe_every={self.moe_every} has no MoE block: "
        f"num_layers must be at least moe_every"
      )
    if self.remat_policy is not None and not callable(self.remat_policy):
      raise TypeError(
        f"remat_policy must be None or a jax.checkpoint policy (e.g. "
        f"jax.checkpoint_policies.nothing_saveable), got {self.remat_policy!r}"
      )
    if self.scan_layers and self.num_layers % self.moe_every:
      raise ValueError(
        f"scan_layers=True scans groups of moe_every={self.moe_every} blocks: num_layers="
        f"{self.num_layers} must divide by it"
      )


class DenseFFN(nnx.Module):
  """A gated SiLU MLP, [..., D] -> [..., D], for the non-MoE blocks."""

  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(dim, 2 * hidden, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
    gate, up = jnp.split(self.up(x), 2, axis=-1)
    return self.down(jax.nn.silu(gate) * up)


class Block(nnx.Module):
  """Pre-norm causal self-attention, then a pre-norm FFN (MoE or dense)."""

  def __init__(self, config: TransformerConfig, use_moe: bool, mesh: Mesh | None, rngs: nnx.Rngs):
    self.config = config
    dim = config.moe.hidden_size
    self.attention_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=config.num_heads, in_features=dim, decode=False, use_bias=False, rngs=rngs
    )
    self.ffn_norm = nnx.RMSNorm(dim, rngs=rngs)
    if use_moe:
      self.ffn = MoELayer(config.moe, mesh=mesh, rngs=rngs)
    else:
      self.ffn = DenseFFN(dim, config.dense_ffn_size, rngs=rngs)

  def __call__(self, x: jax.Array, token_mask: jax.Array) -> jax.Array:
    """x [batch, seq, D], token_mask [batch, seq] -> [batch, seq, D]."""
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    attend = causal[None, None] & token_mask[:, None, None, :]  # [batch, 1, seq, seq]
    x = x + self.attention(self.attention_norm(x), mask=attend)
    return x + self.ffn(self.ffn_norm(x), token_mask)


class BlockGroup(nnx.Module):
  """The step of a scanned stack: with moe_every=2 a dense block, then the MoE block."""

  def __init__(self, config: TransformerConfig, mesh: Mesh | None, rngs: nnx.Rngs):
    self.config = config
    self.dense = Block(config, False, mesh, rngs) if config.moe_every == 2 else None
    self.moe = Block(config, True, mesh, rngs)

  def __call__(self, x: jax.Array, token_mask: jax.Array) -> jax.Array:
    if self.dense is not None:
      x = self.dense(x, token_mask)
    return self.moe(x, token_mask)


# Every variable of a scanned stack has the layer axis first, on no mesh axis: None in its
# sharding metadata (a name the mesh lacks, such as "layers", would fail where flax places
# a variable eagerly, as optax's state is).
_STACKED = dict(transform_metadata={nnx.PARTITION_NAME: None})


class BlockStack(nnx.Module):
  """num_layers / moe_every `BlockGroup`s with a leading layer axis (built by `nnx.vmap`),
  applied in order by `nnx.scan`: the same blocks and the same output as unrolled ones."""

  def __init__(self, config: TransformerConfig, mesh: Mesh | None, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=config.num_layers // config.moe_every)
    @nnx.vmap(in_axes=(0,), out_axes=0, **_STACKED)
    def stacked(rngs: nnx.Rngs) -> BlockGroup:
      return BlockGroup(config, mesh, rngs)

    self.groups = stacked(rngs)

  def __call__(self, x: jax.Array, token_mask: jax.Array) -> jax.Array:
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, **_STACKED)
    def apply(x: jax.Array, group: BlockGroup) -> jax.Array:
      return _apply_block(group, x, token_mask)

    return apply(x, self.groups)


def _apply_block(module: Block | BlockGroup, x: jax.Array, token_mask: jax.Array) -> jax.Array:
  """`module(x, token_mask)`, rematerialized as its config's `remat_policy` asks."""
  policy = module.config.remat_policy
  if policy is None:
    return module(x, token_mask)
  return nnx.remat(lambda module, x, mask: module(x, mask), policy=policy)(module, x, token_mask)


class MoETransformer(nnx.Module):
  """Embedding, `num_layers` blocks (a list, or a `BlockStack` with `scan_layers`), final
  norm, tied output projection.

  >>> moe = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=32)
  >>> shape = TransformerConfig(vocab_size=32, num_layers=2, num_heads=2, moe=moe)
  >>> model = MoETransformer(shape, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5), bool)).shape
  (2, 5, 32)
  """

  def __init__(self, config: TransformerConfig, *, mesh: Mesh | None = None, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.moe.hidden_size, rngs=rngs)
    if config.scan_layers:
      self.blocks = BlockStack(config, mesh, rngs)
    else:
      self.blocks = nnx.List(
        [
          Block(config, use_moe=i % config.moe_every == config.moe_every - 1, mesh=mesh, rngs=rngs)
          for i in range(config.num_layers)
        ]
      )
    self.final_norm = nnx.RMSNorm(config.moe.hidden_size, rngs=rngs)

  def __call__(self, tokens: jax.Array, token_mask: jax.Array) -> jax.Array:
    """tokens [batch, seq] int, token_mask [batch, seq] bool -> logits [batch, seq, V] float32."""
    x = self.embed(tokens, out_sharding=meshes.rows_sharded_like(tokens))
    if self.config.scan_layers:
      x = self.blocks(x, token_mask)
    else:
      for block in self.blocks:
        x = _apply_block(block, x, token_mask)
    return self.embed.attend(self.final_norm(x)).astype(jnp.float32)


def shard_model(model: nnx.Module | nnx.Optimizer, mesh: Mesh) -> None:
  """Places every variable of a model (or optimizer) on `mesh` as its sharding metadata says,
  replicated where it has none (`sharding.metadata_placement`: a stacked layer axis named
  None or "layers" goes on no mesh axis).

  Raises:
    ValueError: naming the variable, before anything is placed, where a spec's rank is not
      its array's (a layer stack built without `transform_metadata`).
  """
  state = nnx.state(model)
  specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
  shardings = {
    path: sharding.metadata_placement(
      ".".join(map(str, path)), variable.get_value(), specs[path].get_value(), mesh
    )
    for path, variable in nnx.to_flat_state(state)
  }
  placed = nnx.from_flat_state(
    [
      (path, variable.replace(jax.device_put(variable.get_value(), shardings[path])))
      for path, variable in nnx.to_flat_state(state)
    ]
  )
  nnx.update(model, placed)


@dataclasses.dataclass(frozen=True)
class ClusterTask:
  """Synthetic task an MoE learns fast: the target of a token is a permutation of it, and the
  permutation depends on the token's cluster (token // cluster_size), so experts specialise.

  Sequences have random lengths; positions past the length are padding (mask False).
  """

  vocab_size: int = 64
  clusters: int = 4
  seq_len: int = 16
  seed: int = 0

  def permutations(self) -> np.ndarray:
    """[clusters, V] the target of token t in cluster c's rule is permutations[c, t]."""
    rng = np.random.default_rng(self.seed)
    return np.stack([rng.permutation(self.vocab_size) for _ in range(self.clusters)])

  def batch(self, batch_size: int, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, targets [batch, seq] int32, mask [batch, seq] bool) for one step."""
    rng = np.random.default_rng((self.seed, step))
    tokens = rng.integers(0, self.vocab_size, (batch_size, self.seq_len), dtype=np.int32)
    cluster = tokens // (self.vocab_size // self.clusters)
    targets = self.permutations()[cluster, tokens].astype(np.int32)
    lengths = rng.integers(self.seq_len // 4, self.seq_len + 1, batch_size)
    mask = np.arange(self.seq_len)[None, :] < lengths[:, None]
    return tokens, targets, mask
