"""relax_rollout."""

__version__ = "0.4.4"
