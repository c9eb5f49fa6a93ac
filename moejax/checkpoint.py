"""`moejax.checkpoint`: the public name of `moejax.apps.checkpoint` (the same module object)."""

import sys

from moejax.apps import checkpoint

sys.modules[__name__] = checkpoint
