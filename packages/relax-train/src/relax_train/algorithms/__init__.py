"""RL algorithms: advantage estimators (numpy, CPU-only) and policy losses (torch)."""

from relax_train.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages

__all__ = ["ADVANTAGE_ESTIMATORS", "compute_advantages"]
