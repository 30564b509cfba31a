"""relax_rollout."""

__version__ = "0.2.0"
