"""`moe_apply`: the functional MoE forward pass, on one device or a (data, expert) mesh.

Flow: check inputs (trace time) -> flatten and pad tokens -> `shard_map` over the mesh ->
on each device `local_forward`: router once on the local tokens -> top-k (or the given expert
ids: routing replay) -> pipelined chunk
loop of send (the expert-axis exchange, `moejax.dispatch`) / local experts and return ->
shared experts -> masked output and router stats.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moejax import expert_capacity, expert_placement, invariance, meshes, remat, routing
from moejax.activations import soft_capped
from moejax.call_plan import plan_for
from moejax.call_record import CallRecord, call_record
from moejax.capacity import fallback_chunk
from moejax.chunking import ChunkStages, TokenLayout, chunk_scan
from moejax.collectives import filled_like, gather_along, sum_over, vary_over
from moejax.config import MoEConfig
from moejax.dispatch import (
  AllToAll,
  Dispatched,
  Exchange,
  crosses_devices,
)
from moejax.experts import (
  latent_projection,
  rms_normalized,
  routed_mlp,
  runs_fp8_kernels,
  shared_mlp,
  with_fp8_blocks,
  with_seeds,
  zero_experts,
)
from moejax.inputs import check_call, check_unmeshed
from moejax.params import (
  PER_EXPERT_FIELDS,
  SHARED_PARAMS,
  ExpertWeights,
  MoEParams,
  TokenSideWeights,
  compute_weights,
)
from moejax.plan import ExpertPlan


class MoEAux(NamedTuple):
  """Auxiliary outputs of one layer call.

  Attributes:
    expert_counts: [E + Z] int32 valid tokens routed to each expert (a token counts K times;
      Z zero-computation experts last).
    load_balancing_loss: [] float32 Switch Transformer loss, 1.0 when perfectly balanced.
    router_z_loss: [] float32 mean squared logsumexp of the router logits.
    chunks_run: [devices] int32 chunks each device ran (the rest were skipped as all-padding),
      devices in the order of the data group's axes, then the expert group's (data-major);
      [1] without a mesh.
    dispatch_rows: [devices] int32 rows each device sent in this call's exchange: (row,
      destination device) pairs, the device itself among the destinations. With
      all_to_all, the ragged volume its routing causes; with all_gather, C times the
      expert-axis size per chunk run.
    physical_counts: [P] int32 valid (token, choice) pairs sent to each physical expert slot
      (P = E + R; equal to `expert_counts[:E]` without redundant experts). A device's load
      is the sum over its P / S slots.
    expert_ids: [..., K] int32 the logical expert ids each token used (x's leading shape):
      the router's top-k, or the given ones; E + Z (no expert) for masked tokens and for
      given ids that routed nowhere. Pass them back as `expert_ids=` to replay the routing.
    expert_weights: [..., K] float32 the combine weight of each of those choices (0 for
      masked tokens and invalid ids).
    invalid_expert_ids: [] int32 given ids of valid tokens that routed nowhere (out of
      [0, E + Z), or a token's repeat of an earlier id): they add nothing to the output.
    score_sums: [E + Z] float32 each expert's router score summed over the valid tokens
      (differentiable): with `expert_counts` and `num_tokens`, the load-balancing loss of
      several calls together (`moejax.balancing.global_load_balancing_loss`).
    num_tokens: [] int32 valid tokens in the call.
    load_max_over_mean: [] float32 the most-loaded routed expert's count over the mean count
      of the E routed experts (1.0 when balanced; 0 without valid tokens).
    overflowed_chunks: [devices] int32 with a receive capacity
      (`MoEConfig.receive_capacity_factor`), the chunks each device ran in sub-chunks because
      some device of its expert group would have received more than its capacity (0
      without one); devices ordered as `chunks_run`.
    overflowed_rows: [devices] int32 the rows each device would have received past its
      capacity in those chunks.
    dropped_assignments: [devices] int32 with an expert capacity
      (`MoEConfig.capacity_factor`), the (token, choice) assignments each device dropped
      (0 without one: dropless); devices ordered as `chunks_run`.
  """

  expert_counts: jax.Array
  load_balancing_loss: jax.Array
  router_z_loss: jax.Array
  chunks_run: jax.Array
  dispatch_rows: jax.Array
  physical_counts: jax.Array
  expert_ids: jax.Array
  expert_weights: jax.Array
  invalid_expert_ids: jax.Array
  score_sums: jax.Array
  num_tokens: jax.Array
  load_max_over_mean: jax.Array
  overflowed_chunks: jax.Array
  overflowed_rows: jax.Array
  dropped_assignments: jax.Array


def moe_apply(
  params: MoEParams,
  x: jax.Array,
  *,
  config: MoEConfig,
  mesh: Mesh | None = None,
  token_mask: jax.Array | None = None,
  router_logits: jax.Array | None = None,
  expert_ids: jax.Array | None = None,
  combine_weights: jax.Array | None = None,
  placement: expert_placement.Placement | None = None,
) -> tuple[jax.Array, MoEAux]:
  """Runs the MoE layer: y = shared(x) + sum_k w_k * expert_{e_k}(x), per token.

  Args:
    params: the layer's `MoEParams`.
    x: [..., D] float tokens (any leading dims; T = their product need not divide the mesh).
    config: the layer's `MoEConfig`.
    mesh: a mesh whose every axis is in `config.data_axis` or `config.expert_axis`; None
      takes the ambient mesh (`jax.set_mesh`; `moejax.meshes.ambient`), else one device.
      Explicit axes (`jax.make_mesh`'s default) and automatic ones alike; a mesh that
      differs from the ambient one is an error naming both.
    token_mask: [...] bool, True for real tokens; None means all real.
    router_logits: [..., E + Z] precomputed router logits (its bias, if any, included); then
      the router is not run again.
    expert_ids: [..., K] integer expert ids (logical, in [0, E + Z)) each token uses instead
      of the router's top-k: routing replay (e.g. a previous call's `MoEAux.expert_ids`).
      The weights stay the router's scores at those ids, renormalized and scaled as the
      config says (the selection bias enters no weight), so the router still gets its
      gradient. Concrete ids out of range or repeated within a valid token are an error;
      under `jit` such an id routes nowhere and is counted in `MoEAux.invalid_expert_ids`.
      Masked tokens' ids are ignored.
    combine_weights: [..., K] float weights of the given `expert_ids` (required with them),
      for a caller that routes itself: y = shared(x) + sum_k combine_weights_k *
      expert_{e_k}(x), the weights used as they are (no renormalization, no
      `routed_scaling_factor`), with their gradient. The router then chooses nothing; it
      runs only for the aux losses, which are 0 for a layer without one
      (`external_router=True`) and no `router_logits`.
    placement: with `config.num_redundant_experts` R > 0 (required then, rejected
      otherwise), the `moejax.eplb.Placement` of the P = E + R physical experts in `params`.
      Data: a new placement runs the same executable.

  Returns:
    (y, aux): y has x's shape and dtype, exactly 0 where the mask is False; aux is `MoEAux`.
  """
  mesh = meshes.of_call(mesh)
  record = call_record(config, mesh)
  args = (params, x, token_mask, router_logits, expert_ids, combine_weights, placement)
  check_call(record, *args)
  if mesh is None:
    check_unmeshed(params, x)
  elif meshes.is_explicit(mesh):
    return _apply_on_explicit_mesh(args, record)
  return _moe_apply_jit(*args, config=config, mesh=mesh)


def _apply_on_explicit_mesh(args, record: CallRecord):
  """The layer on an explicit-axes mesh: y comes back sharded like x (`meshes.with_auto_axes`).

  Each array argument goes in typed for the explicit mesh, and its gradient comes back so
  (`meshes.placed_explicitly`).
  """
  config, mesh, specs = record.config, record.mesh, record.specs
  args = jax.tree.map(functools.partial(meshes.placed_explicitly, mesh=mesh), args)
  x_spec = jax.typeof(args[1]).sharding.spec
  aux_specs = MoEAux(*specs.aux(MoEAux._fields, per_device=_PER_DEVICE))
  ids_spec = P(*x_spec[: args[1].ndim - 1], None)  # the tokens' leading dims, then K
  out_specs = (x_spec, aux_specs._replace(expert_ids=ids_spec, expert_weights=ids_spec))
  apply = lambda auto_mesh, *args: _moe_apply_jit(*args, config=config, mesh=auto_mesh)
  return meshes.with_auto_axes(apply, mesh, out_specs)(*args)


def chunk_layout(config: MoEConfig, num_tokens: int, mesh: Mesh | None = None) -> TokenLayout:
  """How a call on `num_tokens` tokens is laid out: each device's share and its chunk C (the
  config's, or for `chunk_size="auto"` the one the memory budget allows): the layout of its
  `moejax.call_plan.CallPlan`.

  >>> config = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128)
  >>> chunk_layout(config, num_tokens=1000).chunk  # "auto": one chunk holds them all
  1000
  """
  return plan_for(config, num_tokens, mesh).layout


def compiled_executables() -> int:
  """How many executables `moe_apply` has compiled in this process (one per static signature:
  config, mesh, shapes and dtypes; token masks and values never add one)."""
  return _moe_apply_jit._cache_size()


@functools.partial(jax.jit, static_argnames=("config", "mesh"))
def _moe_apply_jit(
  params, x, token_mask, router_logits, expert_ids, combine_weights, placement, *, config, mesh
):
  with meshes.running_on(mesh):  # plan for the mesh's devices, not the default one
    return _moe_apply_traced(
      params, x, token_mask, router_logits, expert_ids, combine_weights, placement, config, mesh
    )


def _moe_apply_traced(
  params, x, token_mask, router_logits, expert_ids, combine_weights, placement, config, mesh
):
  """`moe_apply`'s program (traced under jit)."""
  lead = x.shape[:-1]
  call = plan_for(config, math.prod(lead), mesh)  # every static choice, made here once
  if call.expert_warning is not None:
    warnings.warn(call.expert_warning, stacklevel=4)
  layout = call.layout
  flat = lambda a, fill: layout.pad(a.reshape(layout.num_tokens, *a.shape[len(lead) :]), fill)
  mask = jnp.ones(lead, bool) if token_mask is None else token_mask
  maybe_flat = lambda a: None if a is None else flat(a, 0)
  given_ids = None if expert_ids is None else expert_ids.astype(jnp.int32)
  tokens = TokenInputs(
    flat(x, 0),
    flat(mask, False),
    maybe_flat(router_logits),
    maybe_flat(given_ids),
    maybe_flat(combine_weights),
  )
  body = functools.partial(
    local_forward,
    config=config,
    plan=call.expert,
    chunk_size=layout.chunk,
    exchange=call.exchange,
    all_axes=() if mesh is None else config.data_axes + config.expert_axes,
  )
  if mesh is None:
    y, used, stats, slot_counts, counts = body(params, placement, tokens)
  else:
    y, used, stats, slot_counts, counts = _shard(
      body, mesh, config, call.expert, params, placement, tokens
    )
  y = remat.named(layout.unpad(y).reshape(x.shape).astype(x.dtype), remat.LAYER_OUTPUT)
  # Without a router or its logits there are no scores to take losses of.
  has_router = router_logits is not None or params.router_kernel is not None
  aux_loss = lambda loss: loss if has_router else jnp.zeros((), jnp.float32)
  aux = MoEAux(
    expert_counts=stats.expert_counts,
    load_balancing_loss=aux_loss(routing.load_balancing_loss(stats, config.top_k)),
    router_z_loss=aux_loss(routing.router_z_loss(stats)),
    chunks_run=counts.chunks_run,
    dispatch_rows=counts.rows_sent,
    physical_counts=slot_counts,
    expert_ids=layout.unpad(used[0]).reshape(*lead, config.top_k),
    expert_weights=layout.unpad(used[1]).reshape(*lead, config.top_k),
    invalid_expert_ids=stats.invalid_choices,
    score_sums=stats.score_sums,
    num_tokens=stats.num_tokens,
    load_max_over_mean=routing.load_max_over_mean(stats.expert_counts[: config.num_experts]),
    overflowed_chunks=counts.overflowed_chunks,
    overflowed_rows=counts.overflowed_rows,
    dropped_assignments=counts.dropped,
  )
  return y, aux


class TokenInputs(NamedTuple):
  """The layer's token inputs, flattened and padded to whole chunks ([L, ...] on a device).

  Attributes:
    x: [L, D] tokens.
    token_mask: [L] bool, False for padding.
    router_logits: [L, E + Z] precomputed logits, or None to run the router.
    expert_ids: [L, K] int32 given expert ids (routing replay), or None for the top-k.
    combine_weights: [L, K] the given ids' weights, or None for the router's scores.
  """

  x: jax.Array
  token_mask: jax.Array
  router_logits: jax.Array | None
  expert_ids: jax.Array | None
  combine_weights: jax.Array | None = None


class RoutedRows(NamedTuple):
  """The chunk loop's inputs, row by row ([L, ...]; a chunk's [C, ...]).

  Attributes:
    rows: [L, W] the rows sent to the experts in the compute dtype (padding rows 0): the
      tokens, or with `config.latent_size` their latent projections (W = L).
    expert_ids: [L, K] int32 physical ids of each row's choices.
    weights: [L, K] float32 routing weights.
    latent_tokens: [L, D] the tokens themselves where `rows` are their latent projections
      (for the shared experts), else None.
    shared_weights: [L, S] float32 the shared experts' weights (`config.shared_expert_scores`),
      else None.
  """

  rows: jax.Array
  expert_ids: jax.Array
  weights: jax.Array
  latent_tokens: jax.Array | None = None
  shared_weights: jax.Array | None = None

  @property
  def tokens(self) -> jax.Array:
    """[L, D] the tokens in the compute dtype."""
    return self.rows if self.latent_tokens is None else self.latent_tokens


class DeviceCounts(NamedTuple):
  """What one device did in a call, [1] int32 each (concatenated over devices by `shard_map`).

  Attributes:
    chunks_run: chunks it ran (`MoEAux.chunks_run`).
    rows_sent: (row, destination device) pairs it sent (`MoEAux.dispatch_rows`).
    overflowed_chunks: its chunks that ran in sub-chunks (`MoEAux.overflowed_chunks`).
    overflowed_rows: rows past its capacity in them (`MoEAux.overflowed_rows`).
    dropped: assignments past its expert capacity (`MoEAux.dropped_assignments`).
  """

  chunks_run: jax.Array
  rows_sent: jax.Array
  overflowed_chunks: jax.Array
  overflowed_rows: jax.Array
  dropped: jax.Array


# MoEAux fields with one entry per device (the rest are sums over all devices).
_PER_DEVICE = (
  "chunks_run",
  "dispatch_rows",
  "overflowed_chunks",
  "overflowed_rows",
  "dropped_assignments",
)


def _shard(
  body,
  mesh: Mesh,
  config: MoEConfig,
  plan: ExpertPlan,
  params: MoEParams,
  placement,
  tokens: TokenInputs,
):
  """Runs `body` under `shard_map`: tokens over both groups, experts over the expert group, the
  placement everywhere."""
  specs = call_record(config).specs
  param_specs = specs.params(params)
  tokens = jax.tree.map(lambda a: meshes.constrain(a, mesh, specs.tokens_t), tokens)
  stats_specs = routing.RouterStats(*[specs.replicated] * len(routing.RouterStats._fields))
  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(param_specs, specs.replicated, TokenInputs(*[specs.tokens_t] * 5)),
    out_specs=(
      specs.tokens_t,
      (specs.tokens_t, specs.tokens_t),
      stats_specs,
      specs.replicated,
      DeviceCounts(*[specs.tokens_t] * len(DeviceCounts._fields)),
    ),
    check_vma=plan.check_vma,
  )(params, placement, tokens)


@jax.checkpoint  # its gradient keeps the [L] mask, not the [L, ...] predicate `where` makes
def _zero_padding(x: jax.Array, token_mask: jax.Array) -> jax.Array:
  """`x` with padding rows set to 0: whatever padding holds (NaN, Inf) goes no further."""
  return jnp.where(token_mask.reshape(-1, *[1] * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _route_rows(
  params: MoEParams, tokens: TokenInputs, *, config: MoEConfig
) -> tuple[jax.Array, routing.Routing]:
  """The router (or the given logits) and the top-k choice of some rows: (masked logits
  [R, E + Z] float32, their `Routing`).

  Per row, so that `invariance.in_row_blocks` can run it in fixed blocks: every op of a
  token's routing (the matmul, the soft cap, the scores and their normalization) then has the
  same shape whatever the call holds, and XLA the same program for it.

  Args:
    params: the router's weights (the shared experts' router columns too, if any).
    tokens: R rows' `TokenInputs`, padding rows of x already zero.
    config: the layer's config.
  """
  router_logits = tokens.router_logits
  if router_logits is None and params.router_kernel is None:  # routed by the caller alone
    router_logits = jnp.zeros((tokens.x.shape[0], config.num_router_outputs), jnp.float32)
  elif router_logits is None:  # the router's only run
    router_logits = routing.router_logits(tokens.x, params.router_kernel, params.router_bias)
  router_logits = soft_capped(router_logits, config.router_logit_softcap)
  router_logits = _zero_padding(router_logits, tokens.token_mask)  # the logits' only masking
  router_logits = remat.named(router_logits, remat.ROUTER_LOGITS)
  shared_logits = None
  if params.shared_router_kernel is not None:  # the router's columns of the shared experts
    shared_logits = routing.router_logits(tokens.x, params.shared_router_kernel)
  route = routing.route(
    router_logits,
    tokens.token_mask,
    config,
    params.routing_bias,
    given_ids=tokens.expert_ids,
    shared_logits=shared_logits,
    given_weights=tokens.combine_weights,
  )
  return router_logits, route


def local_forward(
  params: MoEParams,
  placement: expert_placement.Placement | None,
  tokens: TokenInputs,
  *,
  config: MoEConfig,
  plan: ExpertPlan,
  chunk_size: int,
  exchange: Exchange,
  all_axes: tuple[str, ...],
) -> tuple[jax.Array, tuple[jax.Array, jax.Array], routing.RouterStats, jax.Array, DeviceCounts]:
  """One device's part of the layer (the `shard_map` body).

  Args:
    params: replicated router and shared weights; this device's El = P / S physical experts.
    placement: the physical experts' `Placement` (replicated), or None without replicas.
    tokens: this device's `TokenInputs`, L a multiple of `chunk_size`.
    config: the layer's config.
    plan: the call's `ExpertPlan`.
    chunk_size: C, rows per chunk.
    exchange: the expert-axis exchange (`moejax.dispatch.make_exchange`).
    all_axes: every mesh axis the tokens are split over (to sum router stats).

  Returns:
    (y [L, D] in the compute dtype, ([L, K] int32 the logical expert ids used, [L, K]
    float32 their weights), RouterStats summed over all devices, [P] int32 pairs sent to
    each physical expert summed over all devices, this device's `DeviceCounts`).
  """
  token_mask = tokens.token_mask
  x = _zero_padding(tokens.x, token_mask)
  if x.dtype == config.dtype:  # the chunk loop's rows (or the latent's tokens): named here,
    x = remat.named(x, remat.ROUTED_ROWS)  # the one copy the router's gradient keeps too
  router_kernel = params.router_kernel
  if config.shared_fsdp and router_kernel is not None:
    router_kernel = gather_along(router_kernel, all_axes, dim=0)
  router_logits, route = invariance.in_row_blocks(
    functools.partial(_route_rows, params._replace(router_kernel=router_kernel), config=config),
    tokens._replace(x=x),
    invariance.block_rows(config),
  )
  stats = jax.tree.map(
    lambda a: sum_over(a, all_axes), routing.router_stats(router_logits, route, token_mask)
  )
  # Routing is logical; from here on ids are the physical slots the choices are sent to.
  expert_ids = expert_placement.physical_ids(route.expert_ids, placement, config)
  slot_counts = expert_placement.physical_counts(expert_ids, config.num_physical_experts)
  # Expert weights already vary over the expert axis; they are the same on every data rank.
  data_axes = tuple(a for a in all_axes if a not in (exchange.axis or ()))
  stages = ChunkStages(
    prepare=functools.partial(
      _prepare_weights, config=config, plan=plan, axes=(data_axes, all_axes)
    ),
    send=functools.partial(_send_chunk, exchange=exchange),
    finish=functools.partial(_finish_chunk, exchange=exchange, config=config, plan=plan),
  )
  tokens = x.astype(config.dtype)
  if params.latent_in is None:
    routed_rows = RoutedRows(tokens, expert_ids, route.weights)
  else:  # the rows sent are the latent projections; the tokens stay for the shared experts
    latent_in = params.latent_in.astype(config.dtype)
    rows = latent_projection(tokens, latent_in, config=config)
    if config.latent_norm_eps is not None:
      rows = rms_normalized(rows, config.latent_norm_eps).astype(config.dtype)
    routed_rows = RoutedRows(rows, expert_ids, route.weights, tokens)
  routed_rows = routed_rows._replace(shared_weights=route.shared_weights)
  y, chunks_run = chunk_scan(
    stages,
    params,
    jax.tree.map(lambda a: a if a is x else remat.named(a, remat.ROUTED_ROWS), routed_rows),
    token_mask,
    chunk_size=chunk_size,
    lockstep_axis=exchange.axis,
    pipelined=crosses_devices(exchange),
    saved_in_flight=remat.DISPATCHED_ROWS if config.save_dispatched_rows else None,
  )
  rows_sent = exchange.rows_sent(expert_ids, chunks_run, chunk_size).astype(jnp.int32)
  overflowed = exchange.overflows(expert_ids, token_mask, chunk_size)
  if config.capacity_factor is None:
    dropped = filled_like(token_mask, (), 0, jnp.int32)
  else:
    dropped = expert_capacity.dropped(
      expert_ids,
      token_mask,
      chunk_size,
      axis=exchange.axis,
      axis_size=exchange.axis_size,
      local_experts=exchange.local_experts,
      capacity=_capacity(config, chunk_size, exchange),
    )
  counts = DeviceCounts(
    chunks_run[None], rows_sent[None], *(a[None] for a in (*overflowed, dropped))
  )
  if params.output_bias is not None:
    y = y + params.output_bias.astype(y.dtype)[None, :]
  return (
    _zero_padding(y, token_mask),
    (route.expert_ids, route.weights),
    stats,
    sum_over(slot_counts, all_axes),
    counts,
  )


ChunkWeights = tuple[ExpertWeights, TokenSideWeights]  # (seeded, rest): `ChunkStages`


def _prepare_weights(
  params: MoEParams,
  *,
  config: MoEConfig,
  plan: ExpertPlan,
  axes: tuple[tuple[str, ...], tuple[str, ...]],
) -> ChunkWeights:
  """The weights in their compute form (`compute_weights`), marked per-device where they are
  the same on several devices: the expert weights over the data axes `axes[0]`, the shared
  ones over all axes `axes[1]` (`vary_over`: before any chunk's cond). For the fp8 kernels
  (`runs_fp8_kernels`: the Hopper kernels' or the fused path's), the expert matrices' fp8
  blocks too, quantized here once per pass.

  With `expert_fsdp` the expert weights arrive split over the data axes along dim 1, with
  `shared_fsdp` the shared experts' matrices over all axes along dim 0; they are gathered
  here, once per pass and outside every chunk (per-device already): the backward pass turns
  each gather into a reduce-scatter of their gradients.
  """
  data_axes, all_axes = axes
  if config.expert_fsdp:
    params = _gathered(params, PER_EXPERT_FIELDS, data_axes, dim=1)
  if config.shared_fsdp:
    params = _gathered(params, SHARED_PARAMS, all_axes, dim=0)
  experts, side = compute_weights(params, config)
  if not config.expert_fsdp:
    experts = vary_over(experts, data_axes)
  if runs_fp8_kernels(config, plan):
    experts = with_fp8_blocks(experts, plan=plan)
  if side.shared is not None and config.shared_fsdp:  # only the adapters are still the same
    shared = side.shared._replace(lora=vary_over(side.shared.lora, all_axes))
    return experts, TokenSideWeights(shared, vary_over(side.latent_out, all_axes))
  return experts, vary_over(side, all_axes)


def _gathered(
  params: MoEParams, fields: tuple[str, ...], axes: tuple[str, ...], dim: int
) -> MoEParams:
  """`params` with every leaf of `fields` (those present) gathered over `axes` along `dim`."""
  gather = lambda value: jax.tree.map(lambda leaf: gather_along(leaf, axes, dim=dim), value)
  return params._replace(
    **{name: gather(getattr(params, name)) for name in fields if getattr(params, name) is not None}
  )


def _send_chunk(weights: ChunkWeights, chunk: RoutedRows, *, exchange: Exchange) -> Dispatched:
  """Stage 1 of a chunk: sends its rows, ids and routing weights over the expert axis.

  Args:
    weights: unused (the chunk loop passes every stage the same weights).
    chunk: the chunk's `RoutedRows` ([C, ...]).
    exchange: the expert-axis exchange.
  """
  del weights
  return exchange.send(chunk.rows, chunk.expert_ids, chunk.weights)


def _finish_chunk(
  weights: ChunkWeights,
  chunk: RoutedRows,
  dispatched: Dispatched,
  grad_seeds: ExpertWeights | None,
  *,
  exchange: Exchange,
  config: MoEConfig,
  plan: ExpertPlan,
) -> jax.Array:
  """Stage 2 of a chunk: local experts on what arrived, the return exchange, shared experts.

  Args:
    weights: (this device's `ExpertWeights`, the `TokenSideWeights`), in the compute dtype.
    chunk: as `_send_chunk`'s.
    dispatched: what this device received for the chunk.
    grad_seeds: the expert weights' gradient seeds (`ChunkStages`), or None.
    exchange: the expert-axis exchange.
    config: the layer's config.
    plan: the call's `ExpertPlan`.

  Returns:
    [C, D] in the compute dtype.
  """
  arrived = functools.partial(
    _finish_arrived,
    weights,
    chunk,
    dispatched,
    grad_seeds,
    exchange=exchange,
    config=config,
    plan=plan,
  )
  if dispatched.overflow is None:
    return arrived()
  in_sub_chunks = functools.partial(
    _finish_in_sub_chunks, weights, chunk, grad_seeds, exchange=exchange, config=config, plan=plan
  )
  return jax.lax.cond(dispatched.overflow, in_sub_chunks, arrived)


def _finish_arrived(
  weights: ChunkWeights,
  chunk: RoutedRows,
  dispatched: Dispatched,
  grad_seeds: ExpertWeights | None,
  *,
  exchange: Exchange,
  config: MoEConfig,
  plan: ExpertPlan,
) -> jax.Array:
  """`_finish_chunk` on what arrived: the local experts, the return exchange, the experts
  computed where the rows live."""
  experts, side = weights
  local_ids = dispatched.local_ids
  if config.capacity_factor is not None:
    capacity = _capacity(config, chunk.rows.shape[0], exchange)
    local_ids = expert_capacity.within_capacity(local_ids, exchange.local_experts, capacity)
  expert_out = routed_mlp(
    dispatched.rows,
    local_ids,
    dispatched.weights,
    experts,
    config=config,
    plan=plan,
    grad_seeds=grad_seeds,
  )
  out = exchange.combine(expert_out.astype(config.dtype), dispatched)
  if side.latent_out is not None:  # back from the latent width, where the token lives
    out = latent_projection(out, side.latent_out, config=config)
  out = out.astype(jnp.float32)
  if config.num_zero_experts and config.zero_expert_output == "input":
    out = out + zero_experts(chunk.rows, chunk.expert_ids, chunk.weights, config=config)
  if side.shared is not None:
    out = out + shared_mlp(chunk.tokens, side.shared, chunk.shared_weights, config=config)
  return out.astype(config.dtype)


def _capacity(config: MoEConfig, chunk_size: int, exchange: Exchange) -> int:
  """The assignments a device computes per chunk (`moejax.expert_capacity`)."""
  return expert_capacity.assignment_capacity(
    config.capacity_factor, chunk_size, config.top_k, exchange.axis_size, exchange.local_experts
  )


def _finish_in_sub_chunks(
  weights: ChunkWeights,
  chunk: RoutedRows,
  grad_seeds: ExpertWeights | None,
  *,
  exchange: AllToAll,
  config: MoEConfig,
  plan: ExpertPlan,
) -> jax.Array:
  """`_finish_chunk` for a chunk that would overflow a device's receive capacity (nothing was
  sent): a loop of sub-chunks (`moejax.capacity.fallback_chunk`) whose worst case fits it,
  each sent and finished without a capacity. The loop's own backward pass recomputes each
  sub-chunk, so neither pass holds more than a sub-chunk's buffers."""
  chunk_rows = chunk.rows.shape[0]
  capacity = exchange.capacity(chunk_rows, config.top_k)
  worst = exchange.without_capacity()
  stages = ChunkStages(
    prepare=lambda prepared: prepared,
    send=functools.partial(_send_chunk, exchange=worst),
    finish=functools.partial(_finish_chunk, exchange=worst, config=config, plan=plan),
  )
  experts, side = weights
  if grad_seeds is not None:  # this loop sums its own gradients: the seed is added to them
    experts = with_seeds(experts, grad_seeds)
  out, _ = chunk_scan(
    stages,
    (experts, side),
    chunk,
    filled_like(chunk.weights[:, 0], (chunk_rows,), True, bool),  # padding routes nowhere
    chunk_size=fallback_chunk(chunk_rows, capacity, exchange.axis_size),
    lockstep_axis=exchange.axis,
    pipelined=crosses_devices(worst),
  )
  return out
