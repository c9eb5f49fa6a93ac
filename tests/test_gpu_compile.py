"""The GPU-compile tier: the layer compiled by XLA's real GPU compiler for compile-only GPU
devices (`moejax.targets`), on this CPU. It proves the GPU programs build and fit, and plan as
on the GPUs they are made for; not their numbers (`benchmarks/gpu_check.py` on a GPU).

Needs JAX's CUDA plugin (`pip install 'jax[cuda13]'`), no GPU; skipped without it. In the
`gpu_compile` tier: `pytest --all` (tests/conftest.py).
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from kernels_pallas import platform
from kernels_pallas.gpus import GPUS
from moejax import MoEConfig, MoEParams, moe_apply, param_shapes, targets
from moejax.chunk_budget import budget_bytes
from moejax.plan import ExpertPlan, plan_experts
from moejax.sharding import LayerSpecs
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


def abstract_inputs(config: MoEConfig, mesh):
  """ShapeDtypeStructs of the layer's parameters and tokens, sharded as the layer shards them."""
  specs = LayerSpecs.from_config(config)
  shapes = param_shapes(config)
  present = MoEParams(**{name: True for name in shapes})
  spec_of = specs.params(present)
  params = MoEParams(
    **{
      name: jax.ShapeDtypeStruct(
        shape, config.param_dtype, sharding=NamedSharding(mesh, getattr(spec_of, name))
      )
      for name, shape in shapes.items()
    }
  )
  devices = mesh.devices.size
  x = jax.ShapeDtypeStruct(
    (devices * TOKENS_PER_DEVICE, config.hidden_size),
    config.dtype,
    sharding=NamedSharding(mesh, specs.tokens_t),
  )
  return params, x


def compile_layer(config: MoEConfig, mesh, gradient: bool):
  """The layer's forward, or its gradient with respect to every parameter and x, compiled."""
  forward = lambda p, x: moe_apply(p, x, config=config, mesh=mesh)[0]
  loss = lambda p, x: jnp.sum(forward(p, x).astype(jnp.float32))
  program = jax.grad(loss, argnums=(0, 1)) if gradient else forward
  return jax.jit(program).lower(*abstract_inputs(config, mesh)).compile()


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
