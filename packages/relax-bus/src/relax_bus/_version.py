"""The installed relax-bus version (its own module: the snapshot format records it without importing the
package's ``__init__``, which imports the snapshot)."""

from importlib import metadata as _metadata

try:  # one source: the installed distribution's metadata, written from pyproject.toml
    __version__ = _metadata.version("relax-bus")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
