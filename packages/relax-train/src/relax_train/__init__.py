"""relax_train."""

__version__ = "0.4.0"
