"""The GPU-compile tier: the layer compiled by XLA's real GPU compiler for compile-only GPU
devices (`moejax.targets`), on this CPU. It proves the GPU programs build and fit, and plan as
on the GPUs they are made for; not their numbers (`benchmarks/gpu_check.py` on a GPU).

Needs JAX's CUDA plugin (`pip install 'jax[cuda13]'`), no GPU; skipped without it. In the
`gpu_compile` tier: `pytest --all` (tests/conftest.py).
"""

import contextlib
import dataclasses
import functools
import json
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from kernels_pallas import autotune, platform
from kernels_pallas.backends import BACKENDS
from kernels_pallas.gpus import GPUS
from kernels_pallas.ops import KernelSettings, grouped_matmul, transposed_grouped_matmul
from moejax import MoEConfig, MoEParams, moe_apply, param_shapes, targets
from moejax.chunk_budget import budget_bytes
from moejax.lora import expert_lora_shapes, init_like
from moejax.plan import ExpertPlan, plan_experts
from moejax.quant import quantize, quantize_experts
from moejax.sharding import LayerSpecs, map_params
from tests.helpers import expect_triton_deprecation


def _cuda_plugin_missing() -> str | None:
  try:
    targets.compile_only_devices("h200")
  except RuntimeError as error:
    return str(error)
  return None


pytestmark = [
  pytest.mark.gpu_compile,
  pytest.mark.skipif(_cuda_plugin_missing() is not None, reason="needs JAX's CUDA plugin"),
]

# A layer of DeepSeek-V3's shape class at a width that compiles in seconds: 32 experts of
# D=1024, F=512, top 4, bf16, 512 tokens per device.
LAYER = dict(num_experts=32, top_k=4, hidden_size=1024, intermediate_size=512)
TOKENS_PER_DEVICE = 512


def abstract_params(config: MoEConfig, mesh, layers: int | None = None) -> MoEParams:
  """ShapeDtypeStructs of the layer's parameters (quantized and with adapters as `config`
  asks; stacked on a leading layer axis for `layers`), sharded as the layer shards them."""
  float_config = dataclasses.replace(config, expert_quant=None, lora_rank=0)

  def make():
    shapes = param_shapes(float_config)
    params = MoEParams(**{name: jnp.zeros(shape) for name, shape in shapes.items()})
    params = jax.tree.map(lambda leaf: leaf.astype(config.param_dtype), params)
    if config.expert_quant is not None:
      params = quantize_experts(params, float_config, config.expert_quant)[0]
    if config.lora_rank:
      adapters = init_like(expert_lora_shapes(config), jax.random.key(0), config.param_dtype)
      params = params._replace(lora=adapters)
    return params

  params = jax.eval_shape(make)
  stacked = () if layers is None else (layers,)

  def place(leaf, spec):
    spec = PartitionSpec(*[None] * len(stacked), *spec)
    return jax.ShapeDtypeStruct(
      (*stacked, *leaf.shape), leaf.dtype, sharding=NamedSharding(mesh, spec)
    )

  return map_params(place, LayerSpecs.from_config(config).params(params), params)


def abstract_tokens(
  config: MoEConfig, mesh, tokens_per_device: int = TOKENS_PER_DEVICE
) -> jax.ShapeDtypeStruct:
  """`tokens_per_device` tokens on every device, sharded as the layer shards them."""
  return jax.ShapeDtypeStruct(
    (mesh.devices.size * tokens_per_device, config.hidden_size),
    config.dtype,
    sharding=NamedSharding(mesh, LayerSpecs.from_config(config).tokens_t),
  )


def compile_layer(config: MoEConfig, mesh, gradient: bool):
  """The layer's forward, or its gradient with respect to every parameter and x, compiled."""
  forward = lambda p, x: moe_apply(p, x, config=config, mesh=mesh)[0]
  loss = lambda p, x: jnp.sum(forward(p, x).astype(jnp.float32))
  program = jax.grad(loss, argnums=(0, 1)) if gradient else forward
  inputs = abstract_params(config, mesh), abstract_tokens(config, mesh)
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
  config = MoEConfig(**LAYER, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  with platform.running_on(device):
    assert plan_experts(config, num_rows=4096, local_experts=4) == ExpertPlan("ragged_dot", "xla")
    pallas = MoEConfig(**LAYER, dtype=jnp.bfloat16, expert_backend="pallas")
    assert plan_experts(pallas, num_rows=4096, local_experts=4) == ExpertPlan(
      "pallas", pallas_kernel
    )
    assert budget_bytes(config) == GPUS[gpu].memory_bytes // 16
  assert platform.on_cpu()  # the process's own default device is unchanged


@pytest.mark.parametrize(
  "gpu, kernel_call", [("h200", "mosaic_gpu_v2"), ("b200", "__gpu$xla.gpu.triton")]
)
def test_the_pallas_layer_compiles_its_gradient(gpu, kernel_call):
  """expert_backend="pallas" compiles the target's kernel (never the interpreter), forward and
  gradient. The gradient used to fail on a GPU: the Mosaic kernel's weight cotangents came
  back typed as invariant over the mesh axes (`kernels_pallas.compat.vary_like`)."""
  mesh = targets.target_mesh(gpu, (1, 8))
  config = MoEConfig(**LAYER, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, expert_backend="pallas")
  triton = kernel_call.endswith("triton")
  for gradient in (False, True):
    with expect_triton_deprecation() if triton else contextlib.nullcontext():
      calls = custom_calls(compile_layer(config, mesh, gradient))
    assert kernel_call in calls, calls
    assert not any("callback" in call for call in calls), calls


@pytest.mark.parametrize("dispatch", ["all_gather", "all_to_all"])
def test_the_xla_paths_compile_on_two_nodes(dispatch):
  """Both dispatch schemes, forward and gradient, on 2 H200 nodes (data 2 x expert 8)."""
  mesh = targets.target_mesh("h200", (2, 8), nodes=2)
  config = MoEConfig(**LAYER, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, dispatch=dispatch)
  for gradient in (False, True):
    compiled = compile_layer(config, mesh, gradient)
    assert compiled.memory_analysis().temp_size_in_bytes < GPUS["h200"].memory_bytes


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
  config = MoEConfig(
    **LAYER,
    dtype=jnp.bfloat16,
    param_dtype=jnp.bfloat16,
    expert_quant=expert_quant,
    quant_block_size=(32, 1) if expert_quant == "int4_group" else (128, 128),
    lora_rank=lora_rank,
  )
  assert stack_copies_per_layer(config, gradient=lora_rank > 0) <= 0.25


# Row counts and output widths over the sizes a layer's kernels see: every shape class a
# block heuristic tells apart (`Backend.default_blocks`, `tgmm_blocks`).
SHAPE_CLASSES = [(2**rows, 1024, 2**n) for rows in range(3, 17) for n in range(8, 14)]
# Each format's scale block (int4_group's coarser groups reach the kernels as 32-row blocks).
SCALE_BLOCKS = {None: None, "fp8_block": (128, 128), "mxfp4": (32, 1), "int4_group": (32, 1)}
SCALE_BLOCKS["nvfp4"] = (16, 1)
K, N, GROUPS = 512, 1024, 2  # a kernel call's shape: whole blocks of every configuration


def abstract_rhs(expert_quant: str | None, device, shape=(GROUPS, K, N)):
  """A [G, K, N] bf16 weight or `BlockScaled` of the format, as ShapeDtypeStructs on `device`."""
  make = lambda: jnp.zeros(shape, jnp.bfloat16)
  if expert_quant is not None:
    make = lambda: quantize(jnp.zeros(shape), expert_quant, SCALE_BLOCKS[expert_quant])
  sharding = SingleDeviceSharding(device)
  return jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
    jax.eval_shape(make),
  )


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
  if name == "mosaic":
    calls |= {KernelCall("gmm", None, blocks) for blocks in autotune.MOSAIC_CANDIDATES}
  cpu = jax.devices("cpu")[0]
  for expert_quant in (None, *backend.quant_formats):
    rhs = None if expert_quant is None else abstract_rhs(expert_quant, cpu)
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
