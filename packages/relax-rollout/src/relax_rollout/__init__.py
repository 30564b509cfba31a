"""relax_rollout."""

__version__ = "0.6.2"
