"""Group rewards: scores that look at all n responses of one prompt together.

Why a separate hook: GRPO-style training samples n responses per prompt, and some signals only exist
at the group level — agreement with the group's majority answer (label-free "test-time RL"),
penalties for duplicate responses, ranking. A group reward is a plain function

    fn(responses, labels, metadatas, results) -> list[float | RewardResult]

that receives the group's per-sample :class:`RewardResult` s (already scored by the Scorer's reward)
and returns one score per response. Register it with :func:`register_group` and pass its name as
``Scorer(..., group_reward="majority_vote")``, then call ``scorer.score_groups(..., group_size=n)``.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from relax_rewards.types import RewardResult

__all__ = ["GROUP_REWARDS", "get_group_reward", "majority_vote", "register_group", "unique_bonus"]

GROUP_REWARDS: dict[str, Callable] = {}
"""Name → group reward function."""


def register_group(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering a group reward under ``name``."""

    def decorator(fn: Callable) -> Callable:
        GROUP_REWARDS[name] = fn
        return fn

    return decorator


def get_group_reward(name_or_fn: str | Callable) -> Callable:
    """A registered group reward, a dotted path ``pkg.mod:fn``, or a callable as is."""
    if callable(name_or_fn):
        return name_or_fn
    if name_or_fn in GROUP_REWARDS:
        return GROUP_REWARDS[name_or_fn]
    if ":" in name_or_fn:
        module, _, attr = name_or_fn.partition(":")
        return getattr(importlib.import_module(module), attr)
    raise KeyError(f"unknown group reward {name_or_fn!r}; registered: {', '.join(sorted(GROUP_REWARDS))}")


@register_group("majority_vote")
def majority_vote(
    responses: list[str], labels: list[Any], metadatas: list, results: list[RewardResult]
) -> list[RewardResult]:
    """1.0 for responses whose extracted answer matches the group's most common answer, else 0.0.

    Label-free (TTRL-style): the group's consensus stands in for the label. Answers are compared
    with the math equivalence, so ``0.5`` and ``\\frac{1}{2}`` vote together.

    >>> rs = [RewardResult(0.0, {"extracted": a}) for a in ["2", "2.0", "3", None]]
    >>> [r.score for r in majority_vote(["", "", "", ""], [None] * 4, [None] * 4, rs)]
    [1.0, 1.0, 0.0, 0.0]
    """
    from relax_rewards.math_equiv import is_equiv

    answers = [r.details.get("extracted") for r in results]
    classes: list[list[int]] = []
    for i, a in enumerate(answers):
        if a is None:
            continue
        for cls in classes:
            if is_equiv(a, answers[cls[0]]):
                cls.append(i)
                break
        else:
            classes.append([i])
    largest: list[int] = max(classes, key=len) if classes else []
    winners = set(largest)
    return [
        RewardResult(
            1.0 if i in winners else 0.0,
            {**r.details, "majority": answers[min(winners)] if winners else None},
        )
        for i, r in enumerate(results)
    ]


@register_group("unique_bonus")
def unique_bonus(
    responses: list[str], labels: list[Any], metadatas: list, results: list[RewardResult]
) -> list[RewardResult]:
    """Keep each score, but zero out exact duplicate responses after their first occurrence.

    >>> rs = [RewardResult(1.0)] * 3
    >>> [r.score for r in unique_bonus(["a", "a", "b"], [None] * 3, [None] * 3, rs)]
    [1.0, 0.0, 1.0]
    """
    seen: Counter[str] = Counter()
    out = []
    for text, r in zip(responses, results):
        seen[text.strip()] += 1
        dup = seen[text.strip()] > 1
        out.append(RewardResult(0.0 if dup else r.score, {**r.details, "duplicate": dup}, r.failure))
    return out
