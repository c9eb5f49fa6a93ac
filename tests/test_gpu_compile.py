"""The GPU-compile tier: the layer compiled by XLA's real GPU compiler for compile-only GPU
devices (`moejax.targets`), on this CPU. It proves the GPU programs build and fit, and plan as
on the GPUs they are made for; not their numbers (`benchmarks/gpu_check.py` on a GPU).

Needs JAX's CUDA plugin (`pip install 'jax[cuda13]'`), no GPU; skipped without it. In the
`gpu_compile` tier: `pytest --all` (tests/conftest.py).
"""

import collections
import contextlib
import dataclasses
import functools
import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from kernels_pallas import autotune, platform
from kernels_pallas.backends import BACKENDS
from kernels_pallas.formats import FORMATS
from kernels_pallas.gmm_fp8 import Fp8Blocks, gmm_fp8_vjp
from kernels_pallas.gpus import GPUS
from kernels_pallas.ops import KernelSettings, grouped_matmul, transposed_grouped_matmul
from moejax import (
  MoEConfig,
  MoEParams,
  moe_apply,
  param_shapes,
  plan_call,
  targets,
  tuner,
  tuning,
)
from moejax.call_record import call_record
from moejax.chunk_budget import budget_bytes, chunk_bytes, outside_chunks
from moejax.params import EXPERT_PARAMS
from moejax.plan import ExpertPlan, plan_experts
from moejax.sharding import map_params
from tests.gpu_tier import GPU_COMPILE_TIER, no_persistent_compilation_cache  # noqa: F401
from tests.helpers import expect_triton_deprecation
from tests.lowering import block_scaled_spec, branch_depths, collectives, instructions

pytestmark = GPU_COMPILE_TIER

# A layer of DeepSeek-V3's shape class at a width that compiles in seconds: 32 experts of
# D=1024, F=512, top 4, bf16, 512 tokens per device.
LAYER = dict(num_experts=32, top_k=4, hidden_size=1024, intermediate_size=512)
BF16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
TOKENS_PER_DEVICE = 512


def abstract_params(config: MoEConfig, mesh, layers: int | None = None) -> MoEParams:
  """ShapeDtypeStructs of the layer's parameters (quantized and with adapters as `config`
  asks; stacked on a leading layer axis for `layers`), sharded as the layer shards them."""
  record = call_record(config)
  params = record.abstract_params()
  stacked = () if layers is None else (layers,)

  def place(leaf, spec):
    spec = PartitionSpec(*[None] * len(stacked), *spec)
    return jax.ShapeDtypeStruct(
      (*stacked, *leaf.shape), leaf.dtype, sharding=NamedSharding(mesh, spec)
    )

  return map_params(place, record.specs.params(params), params)


def abstract_tokens(
  config: MoEConfig, mesh, tokens_per_device: int = TOKENS_PER_DEVICE
) -> jax.ShapeDtypeStruct:
  """`tokens_per_device` tokens on every device, sharded as the layer shards them."""
  return jax.ShapeDtypeStruct(
    (mesh.devices.size * tokens_per_device, config.hidden_size),
    config.dtype,
    sharding=NamedSharding(mesh, call_record(config).specs.tokens_t),
  )


def compile_layer(config: MoEConfig, mesh, gradient: bool, tokens_per_device=TOKENS_PER_DEVICE):
  """The layer's forward, or its gradient with respect to every float parameter and x,
  compiled."""
  forward = lambda p, x: moe_apply(p, x, config=config, mesh=mesh)[0]
  loss = lambda p, x: jnp.sum(forward(p, x).astype(jnp.float32))
  program = jax.grad(loss, argnums=(0, 1), allow_int=True) if gradient else forward
  inputs = abstract_params(config, mesh), abstract_tokens(config, mesh, tokens_per_device)
  return jax.jit(program).lower(*inputs).compile()


def custom_calls(compiled) -> set[str]:
  return set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))


def test_compile_only_devices_are_the_gpus_they_describe():
  h200 = targets.compile_only_devices("h200")
  assert len(h200) == 8
  device = h200[0]
  assert (device.platform, device.device_kind) == ("gpu", "NVIDIA H200")
  assert str(device.compute_capability) == "9.0" and device.core_count == 132
  assert platform.Target.of(device).memory_bytes == GPUS["h200"].memory_bytes
  two_nodes = targets.compile_only_devices("b200", nodes=2)
  assert sorted({d.process_index for d in two_nodes}) == [0, 1]
  mesh = targets.target_mesh("h100", (2, 4))
  assert (
    mesh.devices.shape == (2, 4) and mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"
  )
  with pytest.raises(ValueError, match=r"target='v100'; expected one of"):
    targets.compile_only_devices("v100")
  with pytest.raises(ValueError, match=r"axis_shape=\(4, 4\) holds 16 devices"):
    targets.target_mesh("h200", (4, 4))


@pytest.mark.parametrize(
  "gpu, pallas_kernel", [("h200", "mosaic"), ("b200", "triton"), ("a100", "triton")]
)
def test_decisions_follow_the_call_devices(gpu, pallas_kernel):
  """Planned for a GPU mesh from this CPU process: as on those GPUs, nothing patched."""
  device = targets.compile_only_devices(gpu)[0]
  config = MoEConfig(**LAYER, **BF16)
  with platform.running_on(device):
    assert plan_experts(config, num_rows=512, local_experts=4) == ExpertPlan(
      path="ragged_dot", backend="xla"
    )
    assert plan_experts(config, num_rows=4096, local_experts=4) == ExpertPlan(path="tile_loop")
    pallas = MoEConfig(**LAYER, dtype=jnp.bfloat16, expert_backend="pallas")
    assert plan_experts(pallas, num_rows=4096, local_experts=4) == ExpertPlan(
      path="pallas", backend=pallas_kernel
    )
    assert budget_bytes(config) == GPUS[gpu].memory_bytes // 16
  assert platform.on_cpu()  # the process's own default device is unchanged


@pytest.mark.parametrize(
  "gpu, kernel_call", [("h200", "mosaic_gpu_v2"), ("b200", "__gpu$xla.gpu.triton")]
)
def test_the_pallas_layer_compiles_its_gradient(gpu, kernel_call):
  """expert_backend="pallas" compiles the target's kernel (never the interpreter), forward and
  gradient. The gradient used to fail on a GPU: the Mosaic kernel's weight cotangents came
  back typed as invariant over the mesh axes (`kernels_pallas.compat.vary_like`).

  What the program writes besides: the weight-gradient kernels write the weights' bf16 (they
  used to write float32, which XLA then converted), and no scatter writes rows of D: the rows
  go into expert order and back by gathers both ways (`moejax.sorted_rows`; they used to be
  scattered back over [T·K, D] zeros, and x's gradient scatter-added), so only the chunk
  loop's puts of a chunk's rows into the device's 512 remain. Mosaic's products keep the rows
  in whole tiles from one to the next (`kernels_pallas.ops.row_layout`): only x and the output
  gradient are regrouped into tiles (the hidden rows and d(gate|up) used to be taken back and
  regrouped for the next product, and the weight-gradient kernel had tiles of its own)."""
  mesh = targets.target_mesh(gpu, (1, 8))
  config = MoEConfig(**LAYER, **BF16, expert_backend="pallas")
  triton = kernel_call.endswith("triton")
  for gradient in (False, True):
    with expect_triton_deprecation() if triton else contextlib.nullcontext():
      compiled = compile_layer(config, mesh, gradient)
    calls = custom_calls(compiled)
    assert kernel_call in calls, calls
    assert not any("callback" in call for call in calls), calls
    hlo = compiled.as_text()
    scattered = [(t, s) for t, s in written_arrays(hlo, "scatter") if t in ("bf16", "f32", "u32")]
    rows_of_d = [(t, s) for t, s in scattered if s[-1:] == (LAYER["hidden_size"],)]
    assert rows_of_d and all(s[0] <= TOKENS_PER_DEVICE for _, s in rows_of_d), scattered
  if not triton:  # rows regrouped into tiles (more rows than sorted), wider than a weight
    sorted_rows = mesh.size * TOKENS_PER_DEVICE * LAYER["top_k"]
    gathered = written_arrays(hlo, "gather")
    regrouped = [s for t, s in gathered if t == "bf16" and s[0] > sorted_rows and s[-1] > 1]
    assert len(regrouped) == 2 and all(s[-1] == LAYER["hidden_size"] for s in regrouped), regrouped
  local_experts = LAYER["num_experts"] // 8
  weight_grads = [  # in the gradient's program, the loop's last
    (t, s) for t, s in written_arrays(hlo, "custom-call") if s[:1] == (local_experts,)
  ]
  assert sorted(weight_grads) == [
    ("bf16", (local_experts, LAYER["intermediate_size"], LAYER["hidden_size"])),
    ("bf16", (local_experts, LAYER["hidden_size"], 2 * LAYER["intermediate_size"])),
  ], weight_grads


def written_arrays(hlo: str, op: str) -> list[tuple[str, tuple[int, ...]]]:
  """(element type, shape) of the array each `op` instruction of `hlo` writes (in fused
  computations too; tuple-shaped ones are left out)."""
  found = re.findall(rf"= (\w+)\[([\d,]*)\]\S* {op}\(", hlo)
  return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in found]


@pytest.mark.parametrize(
  "gpu, normed", [("h100", {}), ("h200", dict(expert_output_norm_eps=1e-6)), ("b200", {})]
)
def test_the_fused_layer_compiles_forward_and_gradient(gpu, normed):
  """expert_backend="fused": its Triton kernels (gathered loads, the biases, the activation
  and its derivative in the epilogues), forward and gradient, on 8 GPUs of each target; on
  the H200 with output norms (the down-projection's backward reading aligned rows)."""
  mesh = targets.target_mesh(gpu, (1, 8))
  config = MoEConfig(**LAYER, **BF16, **normed, expert_backend="fused", expert_bias=True)
  for gradient in (False, True):
    with expect_triton_deprecation():
      compiled = compile_layer(config, mesh, gradient)
    calls = custom_calls(compiled)
    assert "__gpu$xla.gpu.triton" in calls and not any("callback" in c for c in calls), calls
    assert 0 < compiled.memory_analysis().temp_size_in_bytes < GPUS[gpu].memory_bytes


def test_the_fused_gradient_sums_the_matrices_gradients_in_its_kernels():
  """Over 4 chunks, each chunk's weight-gradient kernels add their sums onto the running
  gradients in place (`grad_seeds`): in the program compiled for 8 H100s the only ops
  outside the kernels that write a matrix-shaped array are the seeds' zeros, once each (no
  per-chunk add, no float32 copy, no copy when a chunk is skipped)."""
  mesh = targets.target_mesh("h100", (1, 8))
  config = MoEConfig(**LAYER, **BF16, expert_backend="fused", chunk_size=128)
  with expect_triton_deprecation():
    hlo = compile_layer(config, mesh, gradient=True).as_text()
  local, dim, hidden = LAYER["num_experts"] // 8, LAYER["hidden_size"], LAYER["intermediate_size"]
  matrix = rf"bf16\[(?:{local},{dim},{2 * hidden}|{local},{hidden},{dim})\]\{{[^}}]*\}}"
  writes, computation = [], ""
  for line in hlo.splitlines():
    if line and not line[0].isspace():
      computation = line
    elif not computation.startswith(("%fused", "%wrapped")):  # a fusion's body: its own op
      writes += re.findall(rf"^\s*(?:ROOT )?(%\S+) = {matrix} ([\w-]+)\(", line)
  ops = collections.Counter(op for _, op in writes)
  assert ops["fusion"] == 2 and all("broadcast" in name for name, op in writes if op == "fusion")
  assert set(ops) <= {"custom-call", "fusion", "get-tuple-element", "parameter", "tuple"}, ops
  sums = [
    line for line in hlo.splitlines() if "fused_moe_weight_grad" in line and "custom-call(" in line
  ]
  assert len(sums) == 2 and all("output_to_operand_aliasing" in line for line in sums), sums


def test_the_fused_gradient_writes_little_outside_its_kernels(monkeypatch):
  """benchmarks/glue_bytes.py's count, on a one-chunk layer compiled for an H100: XLA's own
  ops in the fused path's gradient write under a tenth of what its kernels write (the
  zeros, per-chunk adds and float32 copies of the matrices' gradients were 0.9 of it)."""
  monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
  import glue_bytes

  config = MoEConfig(**LAYER, **BF16, expert_backend="fused", chunk_size=512)
  written = glue_bytes.written_bytes(glue_bytes.compiled_hlo(config, True, tokens=512))
  assert 0 < written["glue"] < 0.1 * written["kernels"], written


@pytest.mark.parametrize(
  "gpu, quantized",
  [
    ("h100", dict(expert_quant="mxfp4", activation="swiglu_oai", expert_bias=True, lora_rank=8)),
    ("h200", dict(expert_quant="fp8_block")),
    ("h100", dict(compute_quant="fp8_deepseek", expert_bias=True, lora_rank=8)),
    ("b200", dict(compute_quant="fp8_deepseek")),
  ],
  ids=["h100-gpt-oss-mxfp4-lora", "h200-fp8_block", "h100-fp8-compute-lora", "b200-fp8-compute"],
)
def test_the_fused_layer_compiles_quantized_experts(gpu, quantized):
  """expert_backend="fused" on quantized experts: the kernels decode each tile of the bits
  (paired nibbles by parity, stored by strided columns), forward and gradient; with LoRA
  adapters (QLoRA), their rank-r products in the same kernels. And with
  compute_quant="fp8_deepseek": Triton's dots on e4m3 tiles (both operands, the weight
  gradients' transposed), scaled every 128 of the contraction: the base products' kernels
  take e4m3 operands (forward: up and down; the gradient's, whose forward output is unused:
  up, down-backward, dx and the two weight gradients; the adapters' stay unquantized)."""
  mesh = targets.target_mesh(gpu, (1, 8))
  config = MoEConfig(**LAYER, **BF16, **quantized, expert_backend="fused")
  for gradient in (False, True):
    with expect_triton_deprecation():
      compiled = compile_layer(config, mesh, gradient)
    calls = custom_calls(compiled)
    assert "__gpu$xla.gpu.triton" in calls and not any("callback" in c for c in calls), calls
    kernels = [line for line in compiled.as_text().splitlines() if "xla.gpu.triton" in line]
    fp8_kernels = sum("f8E4M3FN" in line for line in kernels)
    assert fp8_kernels == (0 if config.compute_quant is None else 5 if gradient else 2)


def test_training_only_the_adapters_runs_no_base_weight_gradient_kernel():
  """The fused backward computes every gradient it can (a `custom_vjp` cannot ask which are
  wanted), but on the GPU XLA drops the kernels whose results are unused: the gradient of the
  adapters alone keeps their four weight-gradient kernels ([El, ., r] or [El, r, .]) and
  none of the base matrices' ([El, D, 2F], [El, F, D])."""
  mesh = targets.target_mesh("h100", (1, 8))
  config = MoEConfig(**LAYER, **BF16, lora_rank=8, expert_backend="fused")
  params, x = abstract_params(config, mesh), abstract_tokens(config, mesh)

  def loss(lora, params, x):
    y = moe_apply(params._replace(lora=lora), x, config=config, mesh=mesh)[0]
    return jnp.sum(y.astype(jnp.float32))

  with platform.running_on(mesh.devices.flat[0]), jax.set_mesh(mesh), expect_triton_deprecation():
    compiled = jax.jit(jax.grad(loss)).lower(params.lora, params, x).compile()
  weight_grads = [
    re.search(r"= \w+\[(\d+),(\d+),(\d+)\]", line).groups()
    for line in compiled.as_text().splitlines()
    if "xla.gpu.triton" in line and "fused_moe_weight_grad" in line
  ]
  rank = 64  # the rank padded to the kernels' blocks
  assert len(weight_grads) == 4 and all(str(rank) in shape[1:] for shape in weight_grads), (
    weight_grads
  )


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_fp8_kernels_compile_for_hopper(gpu):
  """kernels_pallas/gmm_fp8.py's forward, and its VJP's dgrad and wgrad (wgmma on e4m3 tiles
  read K-major, the sums promoted every 128): three Mosaic GPU kernels that compile and fit
  the target's shared memory at the largest blocks `Fp8Blocks` allows, at DeepSeek-V3's
  expert widths over 4096 rows."""
  mesh = targets.target_mesh(gpu, (1,), ("gpu",), gpus_per_node=1)
  device = mesh.devices.flat[0]
  spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
    shape, dtype, sharding=SingleDeviceSharding(device)
  )
  rows, hidden, intermediate, groups = 4096, 7168, 2048, 8
  largest = Fp8Blocks(block_m=128, block_n=128, max_concurrent_steps=4)
  product = lambda x, w, sizes: gmm_fp8_vjp(x, w, sizes, None, largest, False).sum()
  with platform.running_on(device), jax.set_mesh(mesh):
    compiled = (
      jax.jit(jax.value_and_grad(product, argnums=(0, 1)))
      .lower(spec((rows, hidden)), spec((groups, hidden, intermediate)), spec((groups,), jnp.int32))
      .compile()
    )
  kernels = re.findall(r'custom_call_target="mosaic_gpu_v2"', compiled.as_text())
  assert len(kernels) == 3, custom_calls(compiled)


def test_the_layer_takes_the_fp8_kernels_on_hopper_alone():
  """compute_quant="fp8_deepseek" with expert_backend="pallas": on 8 H200s the layer compiles
  its products to the fp8 kernels (forward: gate|up and down; the gradient adds each one's
  dgrad and wgrad), within the GPU's memory; a B200 (no wgmma) keeps the tile loop and says
  why."""
  config = MoEConfig(**LAYER, **BF16, expert_backend="pallas", compute_quant="fp8_deepseek")
  mesh = targets.target_mesh("h200", (1, 8))
  for gradient, kernels in ((False, 2), (True, 6)):
    compiled = compile_layer(config, mesh, gradient)
    found = re.findall(r'custom_call_target="mosaic_gpu_v2"', compiled.as_text())
    assert len(found) == kernels, custom_calls(compiled)
    assert 0 < compiled.memory_analysis().temp_size_in_bytes < GPUS["h200"].memory_bytes
  with (
    platform.running_on(targets.compile_only_devices("b200")[0]),
    pytest.warns(UserWarning, match=r"they are made for Hopper \(wgmma\), not GPU capability 10"),
  ):
    assert plan_experts(config, num_rows=4096, local_experts=4) == ExpertPlan(path="tile_loop")


@pytest.mark.parametrize(
  "scheme",
  [dict(dispatch="all_gather"), dict(dispatch="all_to_all", receive_capacity_factor=1.0)],
  ids=["all_gather", "all_to_all-capacity"],
)
def test_the_xla_paths_compile_on_two_nodes(scheme):
  """Both dispatch schemes, forward and gradient, on 2 H200 nodes (data 2 x expert 8);
  all_to_all with a receive capacity (half the worst case: C·K of S·C rows), whose program
  holds both its exchanges (at capacity, and the worst case of an overflowed chunk's
  sub-chunks)."""
  mesh = targets.target_mesh("h200", (2, 8), nodes=2)
  config = MoEConfig(**LAYER, **BF16, **scheme)
  for gradient in (False, True):
    compiled = compile_layer(config, mesh, gradient)
    assert compiled.memory_analysis().temp_size_in_bytes < GPUS["h200"].memory_bytes


# Each quantized format's fields, in its own block (`QuantFormat.block_for`).
QUANTIZED = {name: dict(expert_quant=name) for name in FORMATS}
EXPERT_MESH = ((1, 8), ("data", "expert"))
DATA_EXPERT_MESH = ((2, 4), ("data", "expert"))
FAMILY_OPTIONS = dict(
  latent_size=256, activation="swiglu_softcapped", scoring="sqrtsoftplus", use_routing_bias=True,
  routing_bias_on="logits", num_expert_groups=4, topk_groups=2, dropped_groups="zeroed",
  output_bias=True, num_shared_experts=2, shared_intermediate_size=512, renormalize=True,
  shared_expert_scores=True, shared_activation="swiglu_clamped_after", shared_swiglu_limit=5.0,
  latent_norm_eps=1e-5, expert_output_norm_eps=1e-8,
)  # fmt: skip
# (config fields, (mesh shape, mesh axis names)) of each path and option on 8 H200s.
PATHS = {
  "tile-loop": (dict(num_experts=128), EXPERT_MESH),  # 16 local experts
  "lora-ragged-dot": (dict(lora_rank=8), EXPERT_MESH),
  "lora-pallas": (dict(lora_rank=8, expert_backend="pallas"), EXPERT_MESH),
  "axis-group": (dict(expert_axis=("expert", "tensor")), ((2, 2, 2), ("data", "expert", "tensor"))),
  # The families' options at once: a latent width between norms, their routing, activations,
  # output bias and shared experts the router scores.
  "family-options": (FAMILY_OPTIONS, EXPERT_MESH),
  "latent-pallas": (
    dict(latent_size=256, expert_output_norm_eps=1e-8, expert_backend="pallas"),
    EXPERT_MESH,
  ),
  # fp8 compute: every product's operands quantized, forward and backward (emulated in XLA)
  "compute-quant-fp8-deepseek": (dict(compute_quant="fp8_deepseek"), EXPERT_MESH),
  "compute-quant-mxfp8": (dict(compute_quant="mxfp8"), EXPERT_MESH),  # power-of-two scales
  # the fp8 exchange: fp8 rows and scales over all_gather / ragged_all_to_all
  **{
    f"fp8-exchange-{scheme}": (
      dict(compute_quant="fp8_deepseek", dispatch_quant="fp8", dispatch=scheme),
      DATA_EXPERT_MESH,
    )
    for scheme in ("all_gather", "all_to_all")
  },
  # capacity dropping: the chunk's double argsort inside its cond, the pre-loop count
  **{
    f"capacity-{scheme}": (dict(capacity_factor=1.25, dispatch=scheme), DATA_EXPERT_MESH)
    for scheme in ("all_gather", "all_to_all")
  },
  **{f"tile-loop-{name}": (fields, EXPERT_MESH) for name, fields in QUANTIZED.items()},
  **{
    f"pallas-{name}": (fields | dict(expert_backend="pallas"), EXPERT_MESH)
    for name, fields in QUANTIZED.items()
  },
}


@pytest.mark.parametrize("path", PATHS)
def test_every_path_compiles_its_gradient(path):
  """Each expert path the plan takes on an H200 and each option, with every quantized format
  on the tile loop and the Mosaic kernels, the gradient of every float parameter (LoRA's
  adapters, an axis group's experts) and x: XLA's GPU compiler builds it."""
  fields, (shape, names) = PATHS[path]
  config = MoEConfig(**LAYER | fields, **BF16)
  mesh = targets.target_mesh("h200", shape, names)
  compiled = compile_layer(config, mesh, gradient=True)
  assert 0 < compiled.memory_analysis().temp_size_in_bytes < GPUS["h200"].memory_bytes
  if config.expert_backend == "pallas":  # the Hopper kernel, never the interpreter
    assert "mosaic_gpu_v2" in custom_calls(compiled), custom_calls(compiled)


def test_fsdp_gathers_outside_the_chunk_loop_on_the_gpu():
  """FSDP over a data axis of 2 on 8 H200s: the gradient's program gathers the expert weights
  once, before the chunk loop, reduce-scatters their gradients, and all-reduces nothing as
  large as a device's gathered weights."""
  config = MoEConfig(**LAYER, **BF16, expert_fsdp=True, dispatch="all_to_all", chunk_size=128)
  compiled = compile_layer(config, targets.target_mesh("h200", (2, 4)), gradient=True)
  text = compiled.as_text()
  assert " while(" in text  # the chunk loop is there (4 chunks)
  shapes, local_experts = param_shapes(config), config.num_experts // 4
  gathered = sum(2 * local_experts * math.prod(shapes[name][1:]) for name in EXPERT_PARAMS[:2])
  ops = collectives(text)
  size = lambda kind, in_entry=True: sum(
    b for op, b, entry in ops if op == kind and entry == in_entry
  )
  assert size("all-gather") >= gathered and size("all-gather", in_entry=False) == 0, ops
  assert size("reduce-scatter") >= gathered / 2, ops  # each device keeps its half
  assert max(b for op, b, _ in ops if op == "all-reduce") < gathered / 4, ops


def test_a_decode_size_call_reads_only_the_experts_it_uses_on_the_gpu():
  """One token per device over 64 local experts (8 tokens x 2 choices reach each device; more
  experts than ragged_dot takes): the GPU program reads an expert's weights only two branches
  deep, in the branch that runs for a chunk with tokens and, inside it, the one that runs for
  a tile with rows (XLA:GPU keeps the tile loop's conditionals; ragged_dot reads all)."""
  config = MoEConfig(**LAYER | dict(num_experts=512, top_k=2), **BF16)
  mesh = targets.target_mesh("h200", (1, 8))
  text = compile_layer(config, mesh, gradient=False, tokens_per_device=1).as_text()
  one_expert = ("bf16[1,1024,1024]", "bf16[1,512,1024]")  # [1, D, 2F] and [1, F, D]
  reads = [
    computation
    for computation, line in instructions(text)
    if "dynamic-slice(" in line and line.split(" = ")[1].startswith(one_expert)
  ]
  depths = branch_depths(text)
  assert len(reads) >= 2 and all(depths[read] >= 2 for read in reads), (reads, depths)


@pytest.mark.parametrize(
  "num_experts, path", [(32, "ragged_dot"), (256, "tile_loop"), (32, "fused")]
)
def test_the_chunk_budget_bounds_the_gpu_gradient(num_experts, path):
  """On a (2, 4) H200 mesh at 16,384 tokens per device and a 64 MiB budget, for both XLA
  paths (8 local experts: ragged_dot at the small chunk the budget allows; 64, more than
  ragged_dot takes: the tile loop, at chunk 8 too) and the fused path (its aligned rows,
  `fused_bytes`): the chunk "auto" picks adds at most its
  `chunk_bytes` to the gradient's compiled temp (against chunks of 8 rows), and the whole
  temp is at most the budget plus what no chunk bounds. (ragged_dot's gradient used to add
  6x its estimate: `ragged_dot_bytes`.)"""
  mesh, tokens = targets.target_mesh("h200", (2, 4)), 16384
  backend = dict(expert_backend="fused") if path == "fused" else {}
  config = MoEConfig(
    **LAYER | dict(num_experts=num_experts, top_k=2), **BF16, **backend,
    chunk_memory_bytes=64 << 20,
  )  # fmt: skip
  with platform.running_on(mesh.devices.flat[0]):
    call = plan_call(config, (tokens * 8, config.hidden_size), mesh=mesh)
    layout, local_experts = call.layout, num_experts // 4
    assert call.expert.path == path
    estimate = chunk_bytes(config, layout.chunk, 4, call.scheme, path)
    slack = outside_chunks(config, layout.local, local_experts)
  assert 8 < layout.chunk < layout.share, layout

  def temp(config):
    with expect_triton_deprecation() if path == "fused" else contextlib.nullcontext():
      return compile_layer(config, mesh, True, tokens).memory_analysis().temp_size_in_bytes

  smallest, chosen = temp(dataclasses.replace(config, chunk_size=8)), temp(config)
  assert chosen - smallest <= estimate, (chosen - smallest, estimate)
  assert chosen <= (64 << 20) + slack


def stack_copies_per_layer(config: MoEConfig, gradient: bool) -> float:
  """How much the compiled temp of a scanned stack (`lax.scan` over stacked `MoEParams`, as deep
  models apply their layers) grows per added layer, in layers' weights: 0 where each layer's
  weights are read as stored, 1 where the program copies the whole stack. The forward, or the
  gradient of the adapters and x (LoRA training over a frozen base); 16 tokens per device,
  so that the activations a gradient keeps per layer are small next to the weights."""
  mesh = targets.target_mesh("h200", (1, 8))

  def forward(stack, x):
    body = lambda x, layer: (x + moe_apply(layer, x, config=config, mesh=mesh)[0], None)
    return jax.lax.scan(body, x, stack)[0]

  def program(stack, x):
    if not gradient:
      return forward(stack, x)
    loss = lambda lora, x: jnp.sum(forward(stack._replace(lora=lora), x).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))(stack.lora, x)

  sizes = {}
  for layers in (2, 4):
    inputs = abstract_params(config, mesh, layers), abstract_tokens(config, mesh, 16)
    memory = jax.jit(program).lower(*inputs).compile().memory_analysis()
    sizes[layers] = memory.temp_size_in_bytes, memory.argument_size_in_bytes
  (temp_2, weights_2), (temp_4, weights_4) = sizes[2], sizes[4]
  return (temp_4 - temp_2) / (weights_4 - weights_2)


@pytest.mark.parametrize(
  "expert_quant, lora_rank",
  [(None, 0), ("fp8_block", 0), ("mxfp4", 0), ("int4_group", 0), ("nvfp4", 0), ("int4_group", 8)],
)
def test_a_scanned_stack_keeps_one_copy_of_its_weights(expert_quant, lora_rank):
  """Each layer's weights read in place, for every format; LoRA's gradient over INT4 (a
  Kimi-K2-Thinking tune). The 4-bit formats used to copy the whole stack (0.98 copies per
  layer): XLA:GPU gave the stacked values the decode's layout before the loop
  (`moejax.params.as_stored`)."""
  config = MoEConfig(**LAYER, **BF16, **QUANTIZED.get(expert_quant, {}), lora_rank=lora_rank)
  assert stack_copies_per_layer(config, gradient=lora_rank > 0) <= 0.25


# Row counts and output widths over the sizes a layer's kernels see: every shape class a
# block heuristic tells apart (`Backend.default_blocks`, `tgmm_blocks`).
SHAPE_CLASSES = [(2**rows, 1024, 2**n) for rows in range(3, 17) for n in range(8, 14)]
K, N, GROUPS = 512, 1024, 2  # a kernel call's shape: whole blocks of every configuration


def abstract_rhs(expert_quant: str | None, device, shape=(GROUPS, K, N)):
  """A [G, K, N] bf16 weight or `BlockScaled` of the format, as ShapeDtypeStructs on `device`."""
  rhs = (
    jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    if expert_quant is None
    else block_scaled_spec(shape, expert_quant)
  )
  sharding = SingleDeviceSharding(device)
  return jax.tree.map(lambda leaf: leaf.update(sharding=sharding), rhs)


class KernelCall(NamedTuple):
  """One kernel the library may compile: "gmm" (plain, "gated" epilogue, or "transposed" rhs,
  as a layer's forward and backward run it) or "tgmm", its rhs format and its blocks."""

  op: str
  expert_quant: str | None
  blocks: object


def kernel_calls(name: str, device_kind: str) -> set[KernelCall]:
  """Every kernel call the library can make on backend `name`, with the blocks it would pick:
  each shape class's defaults, fitted to each quantized format it takes; the tuned configs
  shipped for `device_kind`; Mosaic's autotune candidates (bf16 gmm, what tuning times)."""
  backend = BACKENDS[name]
  forward = {backend.default_blocks(*shape) for shape in SHAPE_CLASSES}
  tuned = autotune.cache_file(device_kind)
  if tuned.exists():
    forward |= {
      autotune.lookup(key, tuned) for key in json.loads(tuned.read_text()) if f"/{name}/" in key
    }
  calls = {KernelCall("tgmm", None, backend.tgmm_blocks(*shape)) for shape in SHAPE_CLASSES}
  calls |= {KernelCall("gmm", None, blocks) for blocks in backend.candidate_blocks}
  for expert_quant in (None, *backend.quant_formats):
    rhs = None if expert_quant is None else block_scaled_spec((GROUPS, K, N), expert_quant)
    rhs = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), rhs)  # fitting reads it
    for op, transposed in (("gmm", False), ("gated", False), ("transposed", True)):
      for blocks in forward:
        fitted = blocks if rhs is None else backend.fit_blocks(blocks, rhs, transposed)
        calls.add(KernelCall(op, expert_quant, fitted))
  return calls


def largest(calls: set[KernelCall]) -> list[KernelCall]:
  """The calls no other call of the same op and format covers: a kernel whose every block
  size (and stage count) is at most another's needs no more shared memory than it."""

  def covers(big: KernelCall, small: KernelCall) -> bool:
    same = (big.op, big.expert_quant) == (small.op, small.expert_quant)
    sizes = lambda call: dataclasses.astuple(call.blocks)
    return same and all(b >= s for b, s in zip(sizes(big), sizes(small), strict=True))

  return sorted(
    (call for call in calls if not any(other != call and covers(other, call) for other in calls)),
    key=str,
  )


def compile_kernel(call: KernelCall, name: str, mesh) -> None:
  """Compiles one kernel call for the single GPU of `mesh` (raises if it does not fit)."""
  device = mesh.devices.flat[0]
  rhs = abstract_rhs(call.expert_quant, device)
  settings = KernelSettings(name, blocks=call.blocks, tgmm_blocks=call.blocks)
  rows = lambda width, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
    (1024, width), dtype, sharding=SingleDeviceSharding(device)
  )
  sizes = jax.ShapeDtypeStruct((GROUPS,), jnp.int32, sharding=SingleDeviceSharding(device))
  if call.op == "tgmm":
    fn, inputs = functools.partial(transposed_grouped_matmul, settings=settings), (rows(K), rows(N))
  else:
    options = dict(transpose_rhs=call.op == "transposed")
    options |= dict(activation="silu") if call.op == "gated" else {}
    fn = functools.partial(grouped_matmul, settings=settings, **options)
    inputs = (rows(N if call.op == "transposed" else K), rhs)
  # Pallas Triton reads the GPU it compiles for from the abstract mesh.
  with platform.running_on(device), jax.set_mesh(mesh):
    jax.jit(fn).lower(*inputs, sizes).compile()


def kernel_targets() -> list[tuple[str, str]]:
  """Each kernel backend with each GPU it is made for, one GPU per distinct (compute
  capability, shared memory per block): the H200 compiles as the H100 does."""
  pairs, seen = [], set()
  for name, backend in BACKENDS.items():
    for gpu in GPUS.values():
      capability = "{}.{}".format(*gpu.compute_capability)
      facts = (name, gpu.compute_capability, gpu.shared_memory_per_block)
      if backend.made_for(capability) and facts not in seen:
        seen.add(facts)
        pairs.append((name, gpu.name))
  return pairs


@pytest.mark.parametrize("name, gpu", kernel_targets())
def test_every_kernel_block_configuration_fits(name, gpu):
  """Every block configuration the library can pick compiles for the target: fits its shared
  memory (which no interpreter checks). A configuration too large is refused, so a misfit
  would fail here."""
  mesh = targets.target_mesh(gpu, (1,), ("gpu",), gpus_per_node=1)
  calls = largest(kernel_calls(name, GPUS[gpu].device_kind))
  failed = {}
  for call in calls:
    try:
      with expect_triton_deprecation() if name == "triton" else contextlib.nullcontext():
        compile_kernel(call, name, mesh)
    except Exception as error:  # every misfit reported at once
      failed[call] = f"{type(error).__name__}: {str(error)[:200]}"
  assert not failed, failed
  stages = "max_concurrent_steps" if name == "mosaic" else "num_stages"
  too_large = dataclasses.replace(calls[0].blocks, block_n=256, block_k=64, **{stages: 8})
  with (
    pytest.raises(Exception, match=r"(?i)shared memory"),
    expect_triton_deprecation() if name == "triton" else contextlib.nullcontext(),
  ):
    compile_kernel(KernelCall("gmm", None, too_large), name, mesh)


def test_tuning_times_the_block_configurations_the_registry_names():
  """On an H100, `moejax.tune`'s candidates are the XLA paths, then each kernel made for it
  with its own choice and every `candidate_blocks` of its registry entry, then the fused
  path."""
  mesh = targets.target_mesh("h100", (1, 8))
  names = [c.name for c in tuner.candidates(MoEConfig(**LAYER, **BF16), mesh)]
  made_for = [b for b in BACKENDS.values() if b.made_for("9.0") and b.name != "xla"]
  kernels = [
    tuning.Candidate(
      path="pallas", backend=b.name, blocks=blocks and dataclasses.asdict(blocks), status=""
    ).name
    for b in made_for
    for blocks in (None, *b.candidate_blocks)
  ]
  assert names[-len(kernels) - 1 :] == [*kernels, "fused"]
  assert len(BACKENDS["mosaic"].candidate_blocks) > 1 and names[0] == "tile_loop"


def test_tuning_fp8_compute_times_the_kernels_that_run_the_recipe():
  """With compute_quant="fp8_deepseek", `moejax.tune`'s candidates are the emulating tile
  loop and the fp8 kernels: on an H100 the Hopper ones and the fused path's, on a B200 (no
  wgmma) the fused path's alone."""
  config = MoEConfig(**LAYER, **BF16, compute_quant="fp8_deepseek")
  names = lambda gpu: [c.name for c in tuner.candidates(config, targets.target_mesh(gpu, (1, 8)))]
  assert names("h100") == ["tile_loop", "pallas:mosaic", "fused"]
  assert names("b200") == ["tile_loop", "fused"]


def test_auto_follows_a_tuning_entry_for_the_h200(tmp_path, monkeypatch):
  """With an entry naming the Mosaic kernel for the call, the H200 program runs it; without
  one, XLA; with an entry of another JAX version, XLA and a notice."""
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(tmp_path))
  mesh = targets.target_mesh("h200", (1, 8))
  config = MoEConfig(**LAYER, **BF16)  # expert_backend="auto"
  call = plan_call(config, abstract_tokens(config, mesh), mesh=mesh)
  with platform.running_on(mesh.devices.flat[0]):
    entry = tuning.Entry(
      case=tuning.case_of(config, call.exchange.local_experts),
      rows=call.received_rows * config.top_k,
      objective="train",
      candidates=(tuning.Candidate(path="pallas", backend="mosaic", status="passed"),),
      winner="pallas:mosaic",
      versions=tuning.versions_now(),
    )

  def kernels(versions=None) -> bool:
    if versions is not None:
      stale = dataclasses.replace(entry, versions=versions)
      table = tuning.TuningFile(device_kind="NVIDIA H200", entries=(stale,))
      tuning.user_file("NVIDIA H200").parent.mkdir(parents=True, exist_ok=True)
      tuning.user_file("NVIDIA H200").write_text(table.to_json())
    jax.clear_caches()  # the same signature compiled on another path
    return "mosaic_gpu_v2" in custom_calls(compile_layer(config, mesh, gradient=False))

  assert not kernels()
  assert "no tuning entry" in call.expert_reason
  assert kernels(entry.versions)
  assert (
    "measured pallas:mosaic fastest"
    in plan_call(config, abstract_tokens(config, mesh), mesh=mesh).expert_reason
  )
  with pytest.warns(UserWarning, match="other versions"):
    assert not kernels({**entry.versions, "jax": "0.0.1"})


def test_the_gradient_holds_the_scatter_adds_that_need_deterministic_ops():
  """docs/design.md, "Batch invariance": a batch-invariant layer's gradient on an H200 sums
  rows by scatter-adds (the tile loop's row gradients, the routing weights'), which XLA:GPU
  runs with atomics unless `--xla_gpu_deterministic_ops` is set. (Compiling with the flag
  needs a real GPU: it leaves compile-only devices no GEMM configs to choose from.)"""
  config = MoEConfig(**LAYER, **BF16, batch_invariant=True, dispatch="all_to_all", chunk_size=128)
  compiled = compile_layer(config, targets.target_mesh("h200", (2, 4)), True, tokens_per_device=256)
  lines = [line for _, line in instructions(compiled.as_text())]
  assert any(re.search(r"= f32\[\d+,\d+\]\S* scatter\(", line) for line in lines), "no scatter"
  assert sum("scatter-add" in line.split("=")[0] for line in lines) >= 3
