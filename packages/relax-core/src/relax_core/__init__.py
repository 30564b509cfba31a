"""relax_core."""

__version__ = "0.5.0"
