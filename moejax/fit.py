"""`moejax.fit`: the public name of `moejax.apps.fit` (the same module object)."""

import sys

from moejax.apps import fit

sys.modules[__name__] = fit
