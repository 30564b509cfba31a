"""relax_train."""

__version__ = "0.2.0"
