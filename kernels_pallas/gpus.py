"""GPUs by their device facts, as vendors and XLA's target descriptions state them: the kinds
moejax plans and compiles for without one (`moejax.targets`), and the memory of a compile-only
device, which reports none (`kernels_pallas.platform`).

>>> GPUS["h200"].memory_bytes / 2**30
141.0
>>> BY_DEVICE_KIND["NVIDIA H200"].sm_count
132
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gpu:
  """One GPU kind's device facts, as its vendor and XLA's target descriptions state them.

  Attributes:
    name: the short name ("h200").
    device_kind: the kind its compile-only devices report (`jax.Device.device_kind`).
    compute_capability: (major, minor).
    sm_count: streaming multiprocessors.
    memory_bytes: HBM.
    memory_bandwidth: HBM bytes per second.
    shared_memory_per_block: the most shared memory one block may opt in to, bytes.
    shared_memory_per_sm: bytes.
    l2_cache_bytes: bytes.
    clock_ghz: the SM clock.
    fpus_per_sm: float32 FMA units per SM.
    peak_bf16_flops: the dense bf16 matmul rate (vendor figure, no sparsity), FLOP/s.
    nvlink_bandwidth: NVLink bytes per second each way per GPU, within a node.
  """

  name: str
  device_kind: str
  compute_capability: tuple[int, int]
  sm_count: int
  memory_bytes: int
  memory_bandwidth: float
  shared_memory_per_block: int
  shared_memory_per_sm: int
  l2_cache_bytes: int
  clock_ghz: float
  fpus_per_sm: int
  peak_bf16_flops: float
  nvlink_bandwidth: float

  @property
  def peak_f32_flops(self) -> float:
    """The float32 FMA rate of the SMs' CUDA cores (no tensor cores), FLOP/s: what a float32
    matmul at full precision runs at."""
    return 2 * self.sm_count * self.fpus_per_sm * self.clock_ghz * 1e9

  def description(self) -> str:
    """The target description XLA compiles for (`GpuTargetConfigProto` text format)."""
    major, minor = self.compute_capability
    info = {
      "threads_per_block_limit": 1024,
      "threads_per_warp": 32,
      "shared_memory_per_block": 48 * 1024,
      "shared_memory_per_core": self.shared_memory_per_sm,
      "threads_per_core_limit": 2048,
      "core_count": self.sm_count,
      "fpus_per_core": self.fpus_per_sm,
      "block_dim_limit_x": 2**31 - 1,
      "block_dim_limit_y": 65535,
      "block_dim_limit_z": 65535,
      "memory_bandwidth": int(self.memory_bandwidth),
      "l2_cache_size": self.l2_cache_bytes,
      "clock_rate_ghz": self.clock_ghz,
      "device_memory_size": self.memory_bytes,
      "shared_memory_per_block_optin": self.shared_memory_per_block,
      "registers_per_core_limit": 65536,
      "registers_per_block_limit": 65536,
      "thread_dim_limit_x": 1024,
      "thread_dim_limit_y": 1024,
      "thread_dim_limit_z": 64,
    }
    fields = "".join(f"  {key}: {value}\n" for key, value in info.items())
    capability = f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
    return (
      f"gpu_device_info {{\n{fields}{capability}}}\n"
      'platform_name: "CUDA"\n'
      "dnn_version_info { major: 9 minor: 10 }\n"
      f'device_description_str: "{self.device_kind}"\n'
    )


# The SXM parts, as sold in 8-GPU nodes.
GPUS = {
  gpu.name: gpu
  for gpu in (
    Gpu(
      name="a100",
      device_kind="NVIDIA A100-SXM4-80GB",
      compute_capability=(8, 0),
      sm_count=108,
      memory_bytes=85_100_068_864,
      memory_bandwidth=2.039e12,
      shared_memory_per_block=166_912,
      shared_memory_per_sm=167_936,
      l2_cache_bytes=40 * 2**20,
      clock_ghz=1.41,
      fpus_per_sm=64,
      peak_bf16_flops=312e12,
      nvlink_bandwidth=300e9,
    ),
    Gpu(
      name="h100",
      device_kind="NVIDIA H100 80GB HBM3",
      compute_capability=(9, 0),
      sm_count=132,
      memory_bytes=84_942_979_072,
      memory_bandwidth=3.35232e12,
      shared_memory_per_block=232_448,
      shared_memory_per_sm=233_472,
      l2_cache_bytes=50 * 2**20,
      clock_ghz=1.98,
      fpus_per_sm=128,
      peak_bf16_flops=989e12,
      nvlink_bandwidth=450e9,
    ),
    Gpu(
      name="h200",
      device_kind="NVIDIA H200",
      compute_capability=(9, 0),
      sm_count=132,
      memory_bytes=141 * 2**30,
      memory_bandwidth=4.8e12,
      shared_memory_per_block=232_448,
      shared_memory_per_sm=233_472,
      l2_cache_bytes=50 * 2**20,
      clock_ghz=1.98,
      fpus_per_sm=128,
      peak_bf16_flops=989e12,
      nvlink_bandwidth=450e9,
    ),
    Gpu(
      name="b200",
      device_kind="NVIDIA B200",
      compute_capability=(10, 0),
      sm_count=148,
      memory_bytes=191_514_411_008,
      memory_bandwidth=7.67232e12,
      shared_memory_per_block=232_448,
      shared_memory_per_sm=233_472,
      l2_cache_bytes=126 * 2**20 + 512 * 2**10,
      clock_ghz=1.965,
      fpus_per_sm=128,
      peak_bf16_flops=2250e12,
      nvlink_bandwidth=900e9,
    ),
  )
}
BY_DEVICE_KIND = {gpu.device_kind: gpu for gpu in GPUS.values()}
