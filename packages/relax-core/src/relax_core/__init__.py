"""relax_core."""

__version__ = "0.2.0"
