"""relax_multimodal."""

__version__ = "0.1.0"
