"""relax_rewards: the Relax reward hub.

A reward is a plain function ``fn(response, label, metadata=None) -> float | RewardResult``
registered by name; :class:`Scorer` runs one over a batch concurrently with per-call time-outs.

Importing this package is cheap on purpose (no torch, Ray or sympy): rollout workers and data
tools import it everywhere. Built-in rewards register on the first :func:`get_reward` call, and
sympy loads only when a math comparison needs it.
"""

from importlib import metadata as _metadata

from relax_rewards.registry import (
    ENTRY_POINT_GROUP,
    REWARDS,
    check_reward,
    get_reward,
    list_rewards,
    register,
    resolve_reward_type,
)
from relax_rewards.scorer import Scorer
from relax_rewards.types import BadReturn, RewardFn, RewardResult, as_result, is_async_reward

try:  # one source: the installed distribution's metadata, written from pyproject.toml
    __version__ = _metadata.version("relax-rewards")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BadReturn",
    "ENTRY_POINT_GROUP",
    "REWARDS",
    "RewardFn",
    "RewardResult",
    "Scorer",
    "__version__",
    "as_result",
    "check_reward",
    "get_reward",
    "is_async_reward",
    "list_rewards",
    "register",
    "resolve_reward_type",
]
