"""`moejax.models`: the public name of `moejax.apps.models` (the same module object)."""

import sys

from moejax.apps import models

sys.modules[__name__] = models
