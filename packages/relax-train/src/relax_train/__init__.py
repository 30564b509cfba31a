"""relax_train."""

__version__ = "0.7.5"
