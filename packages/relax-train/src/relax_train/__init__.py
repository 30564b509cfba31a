"""relax_train."""

__version__ = "0.5.2"
