"""`moejax.train`: the public name of `moejax.apps.train` (the same module object)."""

import sys

from moejax.apps import train

sys.modules[__name__] = train
