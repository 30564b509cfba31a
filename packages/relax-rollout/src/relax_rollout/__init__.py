"""relax_rollout."""

__version__ = "0.5.0"
