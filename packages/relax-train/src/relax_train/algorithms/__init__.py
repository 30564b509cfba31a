"""RL algorithms: advantage estimators (numpy, CPU-only) and policy losses (torch).

Importing this package imports numpy only; the torch modules (``losses``, ``aggregation``,
``correction``) are imported by name where a trainer needs them.
"""

from relax_train.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages

__all__ = ["ADVANTAGE_ESTIMATORS", "compute_advantages"]
