"""moejax's applications, built on the library and never imported by it: the command line
(`python -m moejax demo|train|fit|bench`), the demo, a small MoE transformer, its training
loop and orbax checkpoints, and the fit planner.

`moejax.models`, `moejax.train`, `moejax.checkpoint` and `moejax.fit` are their public names:
`moejax.<name>` is the module `moejax.apps.<name>`.
"""

PUBLIC_NAMES = ("checkpoint", "fit", "models", "train")
