"""relax_train."""

__version__ = "0.6.0"
