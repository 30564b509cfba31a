"""The one shape every reward shares.

Why a single signature: the rollout manager, the scorer and user code call rewards without knowing
which one they hold, so every reward is a plain function

    fn(response: str, label: Any, metadata: dict | None = None) -> float | RewardResult

A bare ``float`` is fine for a quick reward; returning a :class:`RewardResult` lets a reward say
*why* it scored what it did (the extracted answer, whether the format was respected), which is what
one wants to log when a run's reward curve looks wrong. :func:`as_result` turns either into a
``RewardResult`` so consumers deal with one type.

I/O-bound rewards (a remote reward server, an LLM judge) may instead be ``async def`` with the same
parameters; the scorer runs those on an event loop. Nothing here imports torch, Ray or sympy.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RewardFn", "RewardResult", "as_result", "is_async_reward"]

RewardFn = Callable[..., "float | RewardResult | Awaitable[float | RewardResult]"]
"""``fn(response, label, metadata=None)``, sync or ``async def``."""


@dataclass(frozen=True)
class RewardResult:
    """The outcome of scoring one response.

    ``score`` is what the trainer sees. ``details`` is free-form, for logging and debugging
    (e.g. ``{"extracted": "42", "format_ok": True}``). ``failure`` is ``None`` when the reward ran
    to completion; otherwise a short reason such as ``"timeout after 10.0 s"`` or
    ``"raised ValueError: ..."`` set by the :class:`~relax_rewards.scorer.Scorer`.

    >>> RewardResult(1.0, {"extracted": "42"}).ok
    True
    >>> RewardResult(0.0, failure="timeout after 1.0 s").ok
    False
    """

    score: float
    details: dict = field(default_factory=dict)
    failure: str | None = None

    @property
    def ok(self) -> bool:
        """True when the reward ran to completion (no failure)."""
        return self.failure is None


def as_result(value: Any) -> RewardResult:
    """Normalize what a reward returned into a :class:`RewardResult`.

    Accepts a ``RewardResult``, a real number (``bool`` included) or anything ``float()`` accepts.
    A NaN or infinite score is refused: either one poisons the group's advantages, then the weights.

    >>> as_result(1)
    RewardResult(score=1.0, details={}, failure=None)
    >>> as_result(RewardResult(0.5)).score
    0.5
    """
    if isinstance(value, RewardResult):
        result = value
    else:
        if value is None or isinstance(value, str | bytes):
            raise TypeError(
                f"a reward must return a float or RewardResult (got {type(value).__name__}: {value!r})"
            )
        result = RewardResult(float(value))
    if not isinstance(result.score, int | float) or not math.isfinite(result.score):
        raise ValueError(
            f"a reward score must be a finite number, not {result.score!r} (NaN or ±inf would poison the "
            "group's advantages and the weights): return a bounded score"
        )
    if not isinstance(result.score, float):
        result = RewardResult(float(result.score), result.details, result.failure)
    return result


def is_async_reward(fn: Callable) -> bool:
    """True when ``fn`` is an ``async def`` reward (also looks through ``functools.partial``).

    >>> async def judge(response, label, metadata=None): return 1.0
    >>> is_async_reward(judge), is_async_reward(len)
    (True, False)
    """
    while hasattr(fn, "func") and not inspect.iscoroutinefunction(fn):
        fn = fn.func
    call = inspect.getattr_static(type(fn), "__call__", None)  # objects with an ``async def __call__``
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)
