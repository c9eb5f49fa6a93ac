"""One process of the 2-process test (`tests/test_multihost.py`); not a test module itself.

  python tests/multihost_worker.py PROCESS_ID PORT [INIT_TIMEOUT_S]

Joins a 2-process JAX runtime on 127.0.0.1:PORT with gloo CPU collectives, 4 CPU devices per
process, builds a 2x4 (data, expert) mesh spanning both, runs the layer with each dispatch
scheme (all_gather, all_to_all) on uneven per-rank token counts (one rank empty) and checks
this process's output shards against the reference; then an `MoELayer` with redundant experts
on the same mesh, before and after `rebalance` (the load summed over both processes, the
weights moved across them); then each process with a tuning file of its own, which differ:
both take process 0's path. Prints "OK ..." and exits 0 on success.
"""

import dataclasses
import os
import sys


def main() -> None:
  # Set up here, not at import: pytest's doctest collection imports this module in the test
  # process, which must keep its own 8 devices.
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  process_id, port = int(sys.argv[1]), sys.argv[2]
  timeout = int(sys.argv[3]) if len(sys.argv) > 3 else 60
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=timeout,
  )
  import numpy as np
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from moejax import MoEConfig, MoELayer, moe_apply, param_shapes, reference_moe
  from moejax.params import MoEParams

  base = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=32, chunk_size=4)
  rng = np.random.default_rng(0)  # the same values in both processes
  params = MoEParams(
    **{
      name: (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)
      for name, shape in param_shapes(base).items()
    }
  )
  rows = 6
  x_host = rng.standard_normal((8 * rows, 16)).astype(np.float32)
  counts = np.array([0, 6, 3, 5, 1, 6, 2, 4])  # rank 0 empty
  mask_host = (np.arange(rows)[None, :] < counts[:, None]).reshape(-1)
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))
  tokens = NamedSharding(mesh, P(("data", "expert")))
  x = jax.make_array_from_callback(x_host.shape, tokens, lambda index: x_host[index])
  mask = jax.make_array_from_callback(mask_host.shape, tokens, lambda index: mask_host[index])
  expected = np.asarray(reference_moe(params, x_host, base, mask_host))

  def check(y, expected, what: str) -> None:
    errors = [
      float(np.max(np.abs(np.asarray(shard.data) - expected[shard.index])))
      for shard in y.addressable_shards
    ]
    worst = max(errors)
    if worst > 1e-4 or len(errors) != 4:
      print(f"FAIL process {process_id} ({what}): shard errors {errors}", flush=True)
      sys.exit(1)
    print(
      f"OK process {process_id} ({what}): {len(errors)} shards, max error {worst:.2e}", flush=True
    )

  for dispatch in ("all_gather", "all_to_all"):
    config = dataclasses.replace(base, dispatch=dispatch)
    y, _ = jax.jit(lambda p, x, m, c=config: moe_apply(p, x, config=c, mesh=mesh, token_mask=m))(
      params, x, mask
    )
    check(y, expected, dispatch)

  layer = MoELayer(dataclasses.replace(base, num_redundant_experts=4), mesh=mesh, rngs=nnx.Rngs(0))
  on_host = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))  # whole on each process
  weights = layer.moe_params()
  logical = MoEParams(
    on_host(weights.router_kernel),
    *(on_host(w)[: base.num_experts] for w in (weights.w_gate_up, weights.w_down)),
  )
  expected = np.asarray(reference_moe(jax.device_get(logical), x_host, base, mask_host))
  check(layer(x, mask), expected, "redundant experts")
  load = np.asarray(jax.device_get(layer.expert_load.get_value()))
  if load.sum() != base.top_k * mask_host.sum():
    print(f"FAIL process {process_id}: expert load {load.tolist()}", flush=True)
    sys.exit(1)
  before = np.asarray(layer.placement.get_value().physical_to_logical)
  placement = layer.rebalance()
  if np.array_equal(np.asarray(placement.physical_to_logical), before):
    print(f"FAIL process {process_id}: rebalance moved no expert", flush=True)
    sys.exit(1)
  check(layer(x, mask), expected, "rebalanced")
  print(f"placement {np.asarray(placement.physical_to_logical).tolist()}", flush=True)

  # Tuning files that differ: process 0's names ragged_dot for the call, process 1's the tile
  # loop. Both plan process 0's choice (process 1 says so) and compile one program.
  import tempfile
  import warnings

  from moejax import plan_call, tuning

  os.environ["MOEJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"moejax-tuning-{process_id}-")
  call = plan_call(base, x, mesh=mesh)
  winner = tuning.Candidate(
    path=("ragged_dot", "tile_loop")[process_id],
    backend=("xla", None)[process_id],
    status="passed",
  )
  entry = tuning.Entry(
    case=tuning.case_of(base, call.exchange.local_experts),
    rows=call.received_rows * base.top_k,
    objective="train",
    candidates=(winner,),
    winner=winner.name,
    versions=tuning.versions_now(),
  )
  path = tuning.user_file("cpu")
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(tuning.TuningFile(device_kind="cpu", entries=(entry,)).to_json())
  with warnings.catch_warnings(record=True) as notices:
    warnings.simplefilter("always")
    taken = plan_call(base, x, mesh=mesh).expert.path
  told = any("process 0's" in str(notice.message) for notice in notices)
  if taken != "ragged_dot" or told != (process_id == 1):
    print(f"FAIL process {process_id}: tuned path {taken}, notice {told}", flush=True)
    sys.exit(1)
  y, _ = jax.jit(lambda p, x, m: moe_apply(p, x, config=base, mesh=mesh, token_mask=m))(
    params, x, mask
  )
  check(y, np.asarray(reference_moe(params, x_host, base, mask_host)), "tuned")
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
