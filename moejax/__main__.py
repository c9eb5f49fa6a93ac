"""`python -m moejax demo|train|fit|bench [flags]`: the command line (`moejax.apps.cli`)."""

from moejax.apps.cli import main

if __name__ == "__main__":
  main()
