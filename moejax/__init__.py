"""moejax: Mixture-of-Experts layers on a (data, expert) mesh, in fixed-size token chunks.

Shape letters, one meaning each, in names, docstrings and shape comments throughout:

  T  tokens of a call                     E  experts of the router (logical)
  L  rows on one device (padded)          R  redundant experts (replicas; 0 without EPLB)
  C  rows per chunk per device            P  physical expert slots, E + R
  D  hidden size                          El slots on one device, P / S
  F  expert intermediate size             Z  zero-computation experts (LongCat-Flash)
  Fs shared-expert intermediate size      K  experts chosen per token (top-k)
  S  devices on the expert axis           G  expert groups (grouped top-k)
  N  rows of a row-wise step (C, or the S*C rows a device received)
  Q  (row, device) pair slots of a chunk: C * min(K, S)
  B  rows per tile (tile loop)            r  LoRA rank (`lora_rank`)

`kernels_pallas` uses matmul letters of its own (lhs [M, K], rhs [G, K, N]; Ma tile-aligned rows).
"""

import importlib

from kernels_pallas.quantized import BlockScaled
from moejax import targets
from moejax.call_plan import CallPlan, plan_call
from moejax.call_record import param_shapes
from moejax.config import MoEConfig
from moejax.forward import MoEAux, chunk_layout, moe_apply
from moejax.functional import moe_mlp
from moejax.layer import MoELayer, collect_aux
from moejax.params import MoEParams
from moejax.reference import reference_moe
from moejax.remat import CHECKPOINT_NAMES
from moejax.tuner import tune
from moejax.version import __version__

__all__ = [
  "CHECKPOINT_NAMES",
  "BlockScaled",
  "CallPlan",
  "MoEAux",
  "MoEConfig",
  "MoELayer",
  "MoEParams",
  "__version__",
  "chunk_layout",
  "collect_aux",
  "moe_apply",
  "moe_mlp",
  "param_shapes",
  "plan_call",
  "reference_moe",
  "targets",
  "tune",
]

# Submodules the docs write as `moejax.<name>`: reachable after a plain `import moejax`,
# imported on first use (orbax, safetensors and Linen load only for those who use them).
SUBMODULES = (
  "balancing",
  "checkpoint",
  "eplb",
  "fit",
  "hf",
  "linen",
  "lora",
  "models",
  "quant",
  "targets",
  "testing",
  "train",
  "tuning",
)


def __getattr__(name: str):
  if name in SUBMODULES:
    return importlib.import_module(f"moejax.{name}")
  raise AttributeError(f"module 'moejax' has no attribute {name!r}")
