"""The call plan: every static choice a layer call makes before it computes, made once, in
order, each with the evidence it read. `moe_apply` computes from it; `moejax.plan_call` (and
`MoELayer.plan`) shows it, to answer "what will this call do, and why?".

The order is the decisions' dependency order: the devices the call runs on (its mesh's, not
the process's default) -> the exchange scheme (`moejax.dispatch`) -> the chunk (the config's,
or the largest the memory budget allows for that scheme, `moejax.chunk_budget`) -> the rows
each device receives per chunk (N = S·C) -> the expert path for N·K assignments
(`moejax.plan`) and the tile loop's rows per tile.

>>> config = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=128)
>>> call = plan_call(config, (4, 250, 64))  # one device, a CPU
>>> call.layout.chunk, call.scheme, call.expert.path
(1000, 'all_gather', 'tile_loop')
>>> call.expert_reason.endswith("on a CPU ragged_dot is an order of magnitude slower")
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, Mesh

from kernels_pallas import platform
from moejax import axis_groups, meshes, tuning
from moejax.call_record import call_record
from moejax.capacity import received_rows
from moejax.chunk_budget import (
  PathOf,
  auto_chunk,
  budget_bytes,
  budget_source,
  chunk_bytes_by_term,
)
from moejax.chunking import TokenLayout
from moejax.config import MoEConfig, Scheme
from moejax.dispatch import Exchange, dispatch_choice, make_exchange
from moejax.experts import tile_rows_for
from moejax.inputs import check_mesh
from moejax.plan import ExpertPlan, choose_plan

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallPlan:
  """What one layer call does, decided before it computes (static; read, never re-decided).

  Attributes:
    target: the device the decisions were made for (`kernels_pallas.platform.Target`).
    layout: the tokens' split: T, devices, each device's share, the chunk C, padded rows L.
    chunk_reason: why C.
    scheme: the exchange, "all_gather" or "all_to_all".
    scheme_reason: why that scheme.
    exchange: the scheme's `moejax.dispatch.Exchange` over the expert group (S, El).
    received_rows: N, the rows a device receives per chunk (S·C, or all_to_all's receive
      capacity: `moejax.capacity`).
    expert: the `moejax.plan.ExpertPlan` (path, backend, interpreted or not) for N·K rows.
    expert_reason: why that path.
    expert_warning: what running the plan warns of (a kernel interpreted on a CPU, a
      requested kernel that cannot run), or None.
    tuned: the tuning entry the expert path followed (`moejax.tuning.Measured`: the file, the
      entry, the winner's times), or None.
    tile_rows: B, the tile loop's rows per tile (None on the other paths).
    chunk_terms: ((term, bytes), ...) of one chunk (`moejax.chunk_budget.chunk_bytes_by_term`).
    budget: the chunk budget in bytes where `chunk_size="auto"` chose C, else None.
  """

  target: platform.Target
  layout: TokenLayout
  chunk_reason: str
  scheme: Scheme
  scheme_reason: str
  exchange: Exchange
  received_rows: int
  expert: ExpertPlan
  expert_reason: str
  expert_warning: str | None
  tuned: tuning.Measured | None
  tile_rows: int | None
  chunk_terms: tuple[tuple[str, int], ...]
  budget: int | None

  @property
  def chunks(self) -> int:
    """Chunks per device (L / C)."""
    return self.layout.local // self.layout.chunk

  def __str__(self) -> str:
    layout, exchange = self.layout, self.exchange
    chunk_mib = sum(b for _, b in self.chunk_terms) / _MIB
    backend = "" if self.expert.backend is None else f" ({self.expert.backend})"
    lines = [
      f"on {self.target.name}: {_counted(layout.num_tokens, 'token')} over "
      f"{layout.devices} device(s), {layout.share} each, {self.chunks} chunk(s) of "
      f"{layout.chunk} rows",
      f"  chunk: {self.chunk_reason}",
      f"  exchange: {self.scheme} over S={exchange.axis_size} ({self.scheme_reason})",
      f"  experts: {self.expert.path}{backend} for N={self.received_rows} received rows x "
      f"K, El={exchange.local_experts} ({self.expert_reason})",
      f"  one chunk holds {chunk_mib:.1f} MiB: "
      + ", ".join(f"{name} {b / _MIB:.1f}" for name, b in self.chunk_terms if b),
    ]
    if self.expert_warning is not None:
      lines.append(f"  warning: {self.expert_warning}")
    return "\n".join(lines)


def plan_call(
  config: MoEConfig,
  x: jax.Array | jax.ShapeDtypeStruct | Sequence[int],
  *,
  mesh: Mesh | AbstractMesh | None = None,
) -> CallPlan:
  """The plan of `moe_apply(params, x, config=config, mesh=mesh)`: what that call would do.

  Args:
    config: the layer's config.
    x: the tokens [..., D], their `jax.ShapeDtypeStruct`, or their shape.
    mesh: as `moe_apply` takes it (None: the ambient mesh, else one device).

  Raises:
    ValueError: x's last dimension is not D, or the mesh does not fit the config.
  """
  if not isinstance(x, Sequence) and not hasattr(x, "shape"):
    raise TypeError(
      f"x must be the tokens [..., D], their jax.ShapeDtypeStruct or their shape (a tuple), "
      f"got {x!r}: for T tokens pass (T, hidden_size)"
    )
  shape = tuple(x) if isinstance(x, Sequence) else tuple(x.shape)
  mesh = meshes.of_call(mesh)
  record = call_record(config, mesh)
  if not shape or shape[-1] != record.widths["x"]:
    raise ValueError(f"x has shape {shape}: expected [..., hidden_size={record.widths['x']}]")
  if mesh is not None:
    check_mesh(record)
  return plan_for(config, math.prod(shape[:-1]), mesh)


def plan_for(config: MoEConfig, num_tokens: int, mesh: Mesh | AbstractMesh | None) -> CallPlan:
  """`plan_call` for T = `num_tokens` on a resolved, checked `mesh`: what `moe_apply` runs."""
  axis_size = axis_groups.size(mesh, config.expert_axis)
  devices = axis_groups.size(mesh, config.data_axis) * axis_size
  with meshes.running_on(mesh):
    scheme, scheme_reason = dispatch_choice(config.dispatch, axis_size, platform.platform())
    exchange = make_exchange(
      config, None if mesh is None else config.expert_axes, axis_size, scheme
    )
    # The expert path depends on the chunk (its received rows); the budget asks for each size.
    choice_at = lambda chunk: choose_plan(
      config, received_rows(config, chunk, axis_size, scheme) * config.top_k, exchange.local_experts
    )
    path_of = lambda chunk: choice_at(chunk).plan.path
    layout, budget = _layout(config, num_tokens, devices, exchange, scheme, path_of)
    received = received_rows(config, layout.chunk, axis_size, scheme)
    assignments = received * config.top_k
    choice = choice_at(layout.chunk)
    terms = chunk_bytes_by_term(config, layout.chunk, axis_size, scheme, choice.plan.path)
    chunk_reason = _chunk_reason(config, layout, sum(terms.values()), budget)
    target = platform.target()
  tiled = choice.plan.path == "tile_loop"
  return CallPlan(
    target=target,
    layout=layout,
    chunk_reason=chunk_reason,
    scheme=scheme,
    scheme_reason=scheme_reason,
    exchange=exchange,
    received_rows=received,
    expert=choice.plan,
    expert_reason=choice.reason,
    expert_warning=choice.warning,
    tuned=choice.measured,
    tile_rows=tile_rows_for(config, assignments) if tiled else None,
    chunk_terms=tuple(terms.items()),
    budget=budget,
  )


def _layout(
  config: MoEConfig,
  num_tokens: int,
  devices: int,
  exchange: Exchange,
  scheme: Scheme,
  path_of: PathOf,
) -> tuple[TokenLayout, int | None]:
  """The tokens' layout, and the budget that chose its chunk (None: the config did)."""
  if config.chunk_size != "auto":
    return TokenLayout.plan(num_tokens, devices, config.chunk_size), None
  share = max(-(-num_tokens // devices), 1)
  chunk = auto_chunk(config, share, exchange.axis_size, scheme, path_of)
  return TokenLayout.plan(num_tokens, devices, chunk), budget_bytes(config)


def _chunk_reason(config: MoEConfig, layout: TokenLayout, held: int, budget: int | None) -> str:
  """Why the layout's chunk: the config's (cut to a device's share), or the budget's."""
  if budget is None:
    cut = f", cut to the {layout.share} tokens a device holds" * (layout.chunk < config.chunk_size)
    return f"config.chunk_size={config.chunk_size}{cut}"
  fits = f"{held / _MIB:.1f} MiB within the {budget / _MIB:.0f} MiB budget"
  which = (
    "one chunk holds a device's tokens" if layout.chunk == layout.share else "the largest that fits"
  )
  return f"chunk_size='auto': {which}, {fits} ({budget_source(config)})"


def _counted(number: int, noun: str) -> str:
  """'1 token', '2 tokens'."""
  return f"{number} {noun}{'' if number == 1 else 's'}"
