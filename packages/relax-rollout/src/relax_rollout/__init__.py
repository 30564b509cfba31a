"""relax_rollout."""

from importlib import metadata as _metadata

try:  # one source: the installed distribution's metadata, written from pyproject.toml
    __version__ = _metadata.version("relax-rollout")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
