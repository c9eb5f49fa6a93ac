"""pytest's collection from the repository root (the tiers and fixtures: tests/conftest.py).

`moejax.checkpoint`, `.fit`, `.models` and `.train` are the public names of `moejax.apps`'
modules (the same module objects: `moejax.apps.PUBLIC_NAMES`); their doctests are collected
there, not twice.
"""

collect_ignore = [f"moejax/{name}.py" for name in ("checkpoint", "fit", "models", "train")]
