"""moejax's version: what pyproject.toml installs and what a tuning entry records."""

__version__ = "0.1.0"
