"""moejax: Mixture-of-Experts layers on a (data, expert) mesh, in fixed-size token chunks.

Dimension letters, used in names, docstrings and shape comments throughout:

  T  tokens (flattened leading dims)      E  experts (El: experts on one device)
  D  hidden size                          K  experts chosen per token (top-k)
  F  expert intermediate size             C  tokens per chunk per device
  Fs shared-expert intermediate size      G  expert groups (grouped top-k)
"""

from moejax.config import MoEConfig
from moejax.forward import MoEAux, moe_apply
from moejax.layer import MoELayer, collect_aux
from moejax.params import MoEParams, param_shapes
from moejax.reference import reference_moe

__all__ = [
  "MoEAux",
  "MoEConfig",
  "MoELayer",
  "MoEParams",
  "collect_aux",
  "moe_apply",
  "param_shapes",
  "reference_moe",
]
