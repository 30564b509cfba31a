"""Advantage estimators: plain numpy functions in a name → function registry.

They run in the Advantages role, which needs no accelerator, so nothing here imports torch.
An estimator takes the rewards of one group (the n responses of one prompt) and returns one scalar
advantage per response; :func:`compute_advantages` broadcasts it over each response's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Estimator = Callable[[np.ndarray, bool], np.ndarray]


def grpo(rewards: np.ndarray, normalize_std: bool = True) -> np.ndarray:
    """Group-relative advantage: (r - mean) / (std + 1e-6), std unbiased as in TRL; centring only
    when ``normalize_std`` is False (Dr.GRPO).

    >>> grpo(np.array([1.0, 0.0, 0.0, 1.0])).round(3).tolist()
    [0.866, -0.866, -0.866, 0.866]
    """
    centred = rewards - rewards.mean()
    if not normalize_std:
        return centred
    std = rewards.std(ddof=1) if len(rewards) > 1 else 0.0
    return centred / (std + 1e-6)


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {"grpo": grpo}


def compute_advantages(
    name: str,
    group_ids: Sequence[object],
    rewards: Sequence[float],
    response_lens: Sequence[int],
    normalize_std: bool = True,
) -> list[np.ndarray]:
    """Per-sample token advantages (float32, one per response token), grouping by ``group_ids``."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown --advantage-estimator {name!r}; available: {sorted(ADVANTAGE_ESTIMATORS)}")
    fn = ADVANTAGE_ESTIMATORS[name]
    r = np.asarray(rewards, dtype=np.float64)
    scalar = np.zeros_like(r)
    groups: dict[object, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    for idx in groups.values():
        scalar[idx] = fn(r[idx], normalize_std)
    return [np.full(int(n), scalar[i], dtype=np.float32) for i, n in enumerate(response_lens)]
