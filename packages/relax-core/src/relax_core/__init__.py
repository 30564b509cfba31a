"""relax_core."""

__version__ = "0.4.9"
