"""The rollout role's restart journal: it lives in :mod:`relax_core.resume` (the trainer reads it too);
re-exported here for the rollout's imports."""

from relax_core.resume import Journal, Recovered

__all__ = ["Journal", "Recovered"]
