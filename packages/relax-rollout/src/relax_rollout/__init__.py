"""relax_rollout."""

__version__ = "0.7.0"
