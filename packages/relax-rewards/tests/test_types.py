"""RewardResult and return-value normalization."""

import dataclasses
import functools
import math

import pytest

from relax_rewards.types import RewardResult, as_result, is_async_reward


def test_reward_result_is_frozen():
    r = RewardResult(1.0, {"extracted": "1"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.score = 0.0  # type: ignore[misc]
    assert r.ok and not RewardResult(0.0, failure="x").ok


def test_as_result_accepts_numbers_and_results():
    assert as_result(True) == RewardResult(1.0)
    assert as_result(0) == RewardResult(0.0)
    assert as_result(RewardResult(2)).score == 2.0 and isinstance(as_result(RewardResult(2)).score, float)


@pytest.mark.parametrize("bad", [None, "1.0", b"1", math.nan])
def test_as_result_rejects_garbage(bad):
    with pytest.raises((TypeError, ValueError)):
        as_result(bad)


def test_is_async_reward():
    async def a(response, label, metadata=None):
        return 1.0

    def s(response, label, metadata=None):
        return 1.0

    assert is_async_reward(a) and not is_async_reward(s)
    assert is_async_reward(functools.partial(a))

    class AsyncJudge:
        async def __call__(self, response, label, metadata=None):
            return 1.0

    assert is_async_reward(AsyncJudge())
