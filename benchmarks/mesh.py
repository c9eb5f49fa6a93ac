"""`python -m moejax bench --sections mesh`: past the two-axis mesh.

Three tables, float32 unless said, E=8, K=2, D=256, F=512, 4096 tokens (512 per device):
  fsdp       expert weights replicated over data vs split over it (`expert_fsdp`) on the 2x4
             mesh: expert-weight bytes at rest per device, compiled temp of the forward pass
             and of the gradient, their times and the FSDP / replicated time ratio
  groups     the (2, 4) mesh against (data, expert, tensor) = (2, 2, 2) with
             expert_axis=("expert", "tensor") (tokens arriving replicated over tensor, as
             attention's outputs do): times, their ratio, and the rows each sent
  deepseek   DeepSeek-V3's 58 MoE layers (E=256, D=7168, F=2048, one shared expert): weight
             bytes per device for expert parallelism 8 / 16 / 64 x FSDP 1 / 2 / 4 / 8, bf16
             and fp8 (128x128 float32 block scales), from the layer's own parameter shapes
             and PartitionSpecs (`jax.eval_shape`: nothing is allocated)

The 8 simulated CPU devices share the machine's cores, so the times measure what the
arrangement adds (collectives, gathers, bookkeeping), not what parallel devices would gain.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import autotune
from moejax import MoEConfig, MoELayer, axis_groups, moe_apply
from moejax.params import EXPERT_PARAMS, MoEParams
from moejax.sharding import LayerSpecs
from moejax.testing import abstract_params

CONFIG = MoEConfig(num_experts=8, top_k=2, hidden_size=256, intermediate_size=512, chunk_size=256)
TOKENS = 4096
DEEPSEEK_V3 = MoEConfig(
  num_experts=256,
  top_k=8,
  hidden_size=7168,
  intermediate_size=2048,
  num_expert_groups=8,
  topk_groups=4,
  use_routing_bias=True,
  renormalize=True,
  scoring="sigmoid",
  routed_scaling_factor=2.5,
  num_shared_experts=1,
  shared_intermediate_size=2048,
  param_dtype=jnp.bfloat16,
)
DEEPSEEK_V3_MOE_LAYERS = 58


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
  devices = np.array(jax.devices()[: math.prod(shape)]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def _timed_calls(config: MoEConfig, mesh: Mesh, params: MoEParams, x: jax.Array, repeats: int):
  """(forward, gradient) as jitted calls of `params`, x, and their compiled temps in MiB."""
  forward = jax.jit(lambda p, x: moe_apply(p, x, config=config, mesh=mesh)[0])
  gradient = jax.jit(jax.grad(lambda p, x: jnp.sum(forward(p, x) ** 2)))
  row = {}
  for name, fn in (("forward", forward), ("gradient", gradient)):
    compiled = fn.lower(params, x).compile()
    row[f"{name}_temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
    row[f"{name}_ms"] = 1e3 * autotune.time_call(functools.partial(compiled, params, x), repeats)
  return row


def _expert_bytes_on(device, params: MoEParams) -> int:
  """Bytes of the expert weights stored on `device`."""
  leaves = jax.tree.leaves([getattr(params, name) for name in EXPERT_PARAMS])
  return sum(
    s.data.nbytes for leaf in leaves for s in leaf.addressable_shards if s.device == device
  )


def fsdp_rows(repeats: int) -> list[dict]:
  mesh = _mesh((2, 4), ("data", "expert"))
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (TOKENS, CONFIG.hidden_size)),
    NamedSharding(mesh, LayerSpecs.from_config(CONFIG).tokens_t),
  )
  rows = []
  for fsdp in (False, True):
    config = dataclasses.replace(CONFIG, expert_fsdp=fsdp)
    params = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(0)).moe_params()
    row = dict(section="mesh", table="fsdp", expert_fsdp=fsdp)
    row["expert_mib_per_device"] = _expert_bytes_on(mesh.devices.flat[0], params) / 2**20
    row.update(_timed_calls(config, mesh, params, x, repeats))
    rows.append(row)
  for key in ("forward_ms", "gradient_ms", "gradient_temp_mib"):
    rows[1][f"{key}_of_replicated"] = rows[1][key] / rows[0][key]
    rows[0][f"{key}_of_replicated"] = 1.0
  return rows


def group_rows(repeats: int) -> list[dict]:
  flat = _mesh((2, 4), ("data", "expert"))
  tensor = _mesh((2, 2, 2), ("data", "expert", "tensor"))
  grouped = dataclasses.replace(CONFIG, expert_axis=("expert", "tensor"))
  x = jax.random.normal(jax.random.key(1), (TOKENS, CONFIG.hidden_size))
  rows = []
  for name, config, mesh, x_spec in (
    ("(2, 4)", CONFIG, flat, P(("data", "expert"))),
    ("(2, 2, 2) expert_axis=(expert, tensor)", grouped, tensor, P(("data", "expert"))),
  ):
    params = MoELayer(config, mesh=mesh, rngs=nnx.Rngs(0)).moe_params()
    x_placed = jax.device_put(x, NamedSharding(mesh, x_spec))  # replicated over tensor
    aux = moe_apply(params, x_placed, config=config, mesh=mesh)[1]
    row = dict(section="mesh", table="groups", mesh=name, rows_sent=int(aux.dispatch_rows.sum()))
    row.update(_timed_calls(config, mesh, params, x_placed, repeats))
    rows.append(row)
  for key in ("forward_ms", "gradient_ms"):
    for row in rows:
      row[f"{key}_of_2x4"] = row[key] / rows[0][key]
  return rows


def shard_bytes(shape: tuple[int, ...], dtype, spec: P, axis_sizes: dict[str, int]) -> int:
  """Bytes of one device's shard of an array of `shape` laid out as `spec` on a mesh of
  `axis_sizes` (each dimension divided by the size of the axes its entry names)."""
  entries = [*spec, *[None] * (len(shape) - len(spec))]
  local = [
    dim if entry is None else -(-dim // math.prod(axis_sizes[a] for a in axis_groups.names(entry)))
    for dim, entry in zip(shape, entries, strict=True)
  ]
  return math.prod(local) * jnp.dtype(dtype).itemsize


def deepseek_rows() -> list[dict]:
  """Weight bytes per device of DeepSeek-V3's MoE layers, by expert parallelism and FSDP."""
  rows = []
  for weights in ("bf16", "fp8"):
    for experts in (8, 16, 64):
      for fsdp in (1, 2, 4, 8):
        config = dataclasses.replace(DEEPSEEK_V3, expert_fsdp=fsdp > 1)
        routed, total = _layer_bytes(config, weights, {"expert": experts, "data": fsdp})
        rows.append(
          dict(
            section="mesh",
            table="deepseek",
            weights=weights,
            expert_parallel=experts,
            fsdp=fsdp,
            routed_gib=DEEPSEEK_V3_MOE_LAYERS * routed / 2**30,
            all_moe_gib=DEEPSEEK_V3_MOE_LAYERS * total / 2**30,
          )
        )
  return rows


def _layer_bytes(config: MoEConfig, weights: str, axis_sizes: dict[str, int]) -> tuple[int, int]:
  """(routed experts', all) weight bytes of one layer on one device."""
  quantized = dataclasses.replace(config, expert_quant="fp8_block") if weights == "fp8" else config
  abstract = abstract_params(quantized)
  specs = LayerSpecs.from_config(config).params(abstract)
  routed = total = 0
  for name, value, spec in zip(MoEParams._fields, abstract, specs, strict=True):
    if value is None:
      continue
    size = sum(
      shard_bytes(leaf.shape, leaf.dtype, spec, axis_sizes) for leaf in jax.tree.leaves(value)
    )
    total += size
    routed += size if name in EXPERT_PARAMS else 0
  return routed, total


def mesh_section(repeats: int, table: Callable[[str, list[dict], list[str]], None]) -> list[dict]:
  """The three tables, printed with `table(title, rows, columns)`; returns their rows."""
  fsdp = fsdp_rows(repeats)
  table(
    "mesh: expert weights replicated over data vs split over it (expert_fsdp), 2x4",
    fsdp,
    [
      "expert_fsdp",
      "expert_mib_per_device",
      "forward_temp_mib",
      "gradient_temp_mib",
      "forward_ms",
      "gradient_ms",
      "forward_ms_of_replicated",
      "gradient_ms_of_replicated",
    ],
  )
  groups = group_rows(repeats)
  table(
    "mesh: an expert group (expert, tensor) on (2, 2, 2) vs the (2, 4) mesh",
    groups,
    ["mesh", "rows_sent", "forward_ms", "gradient_ms", "forward_ms_of_2x4", "gradient_ms_of_2x4"],
  )
  deepseek = deepseek_rows()
  table(
    f"mesh: DeepSeek-V3's {DEEPSEEK_V3_MOE_LAYERS} MoE layers, weight GiB per device",
    deepseek,
    ["weights", "expert_parallel", "fsdp", "routed_gib", "all_moe_gib"],
  )
  return fsdp + groups + deepseek
