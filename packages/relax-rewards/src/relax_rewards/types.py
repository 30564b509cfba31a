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

__all__ = ["BadReturn", "RewardFn", "RewardResult", "as_result", "is_async_reward", "short_repr"]

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


class BadReturn(TypeError, ValueError):
    """What a reward returned is not a finite score (None, text, NaN, ±inf, an int past float's range, an
    object whose ``__float__`` raises). Both a TypeError and a ValueError, as the checks it replaces were."""


def as_result(value: Any) -> RewardResult:
    """Normalize what a reward returned into a :class:`RewardResult`; :class:`BadReturn` if it is none.

    Accepts a ``RewardResult``, a real number (``bool`` included) or anything ``float()`` accepts.
    A NaN or infinite score is refused: either one poisons the group's advantages, then the weights.
    The scorer calls this inside the guarded call (its time-out and isolation cover a ``__float__`` that
    blocks or kills its process).

    >>> as_result(1)
    RewardResult(score=1.0, details={}, failure=None)
    >>> as_result(RewardResult(0.5)).score
    0.5
    """
    result = value if isinstance(value, RewardResult) else None
    score = value.score if result is not None else value
    if score is None or isinstance(score, str | bytes):
        raise BadReturn(
            f"a reward must return a float or RewardResult (got {type(score).__name__}: {short_repr(score)})"
        )
    try:
        number = float(score)
    except Exception as exc:  # noqa: BLE001 - OverflowError (10**400), a __float__ that raises anything
        raise BadReturn(
            f"a reward score must be a number float() accepts, not {type(score).__name__} {short_repr(score)} "
            f"({type(exc).__name__}: {exc}): return a bounded float"
        ) from None
    if not math.isfinite(number):
        raise BadReturn(
            f"a reward score must be a finite number, not {number!r} (NaN or ±inf would poison the "
            "group's advantages and the weights): return a bounded score"
        )
    if result is None:
        return RewardResult(number)
    return result if type(result.score) is float else RewardResult(number, result.details, result.failure)


def short_repr(value: Any) -> str:
    """``repr`` of a value someone else made (a reward's return, a client's field) for an error message: at
    most 80 characters, and never raising (a 5,000-digit int has no ``repr`` under Python's digit limit)."""
    try:
        big = isinstance(value, int) and value.bit_length() > 128  # (str() of > 4300 digits raises)
        text = f"<an int of {int(value.bit_length() * 0.30103) + 1} digits>" if big else repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


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
