"""Autotune: picks the fastest candidate, caches it as JSON, and the API reads it back."""

import jax.numpy as jnp

from kernels_pallas import TritonBlocks, autotune


def test_autotune_picks_fastest_and_caches(tmp_path):
  path = autotune.cache_file("NVIDIA H200", directory=tmp_path)
  assert path.name == "nvidia_h200.json"
  candidates = [TritonBlocks(16, 16, 16), TritonBlocks(32, 16, 16), TritonBlocks(16, 32, 16)]
  fake_ms = {candidates[0]: 3.0, candidates[1]: 1.0, candidates[2]: 2.0}

  def make_call(blocks):
    if blocks == candidates[2]:
      raise ValueError("does not fit")  # a failing candidate is skipped
    return lambda: jnp.zeros(())

  timer_calls = iter(fake_ms[c] for c in candidates[:2])
  key = autotune.cache_key("gmm", "triton", (64, 32, 32, 4), jnp.bfloat16)
  assert key == "gmm/triton/M=64,K=32,N=32,G=4/bfloat16"
  best = autotune.autotune(
    key, candidates, make_call, path=path, timer=lambda fn: next(timer_calls)
  )
  assert best == candidates[1]
  assert autotune.lookup(key, path) == candidates[1]
  assert autotune.lookup("gmm/triton/other", path) is None
