"""The group reward hook: ``Scorer(group_reward=...)`` and ``score_groups``."""

import pytest

from relax_rewards import RewardResult, Scorer
from relax_rewards.group import GROUP_REWARDS, get_group_reward, register_group


def test_majority_vote_label_free():
    responses = [
        r"\boxed{2}",
        r"\boxed{2.0}",
        r"\boxed{3}",
        "no answer",
        r"\boxed{5}",
        r"\boxed{5}",
        r"\boxed{5}",
        "x",
    ]
    s = Scorer("math", group_reward="majority_vote")
    results = s.score_groups(responses, [None] * 8, None, group_size=4)
    assert [r.score for r in results] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert results[0].details["majority"] == "2"


def test_custom_group_reward_and_errors():
    @register_group("test_rank")
    def rank(responses, labels, metadatas, results):
        order = sorted(range(len(responses)), key=lambda i: len(responses[i]))
        return [RewardResult(float(order.index(i))) for i in range(len(responses))]

    try:
        s = Scorer(lambda r, lab, m=None: 0.0, group_reward="test_rank")
        assert [r.score for r in s.score_groups(["ccc", "a", "bb"], [0] * 3, group_size=3)] == [2.0, 0.0, 1.0]
        with pytest.raises(ValueError, match="whole number of groups"):
            s.score_groups(["a", "b"], [0, 0], group_size=3)
    finally:
        GROUP_REWARDS.pop("test_rank")


def test_failing_group_reward_keeps_per_sample_scores():
    def broken(*args):
        raise RuntimeError("boom")

    s = Scorer(lambda r, lab, m=None: 1.0, group_reward=broken)
    assert [r.score for r in s.score_groups(["a", "b"], [0, 0], group_size=2)] == [1.0, 1.0]
    assert s.stats()["group_raised:RuntimeError"] == 1


def test_unique_bonus_and_lookup():
    s = Scorer(lambda r, lab, m=None: 1.0, group_reward="unique_bonus")
    assert [r.score for r in s.score_groups(["a", "a ", "b"], [0] * 3, group_size=3)] == [1.0, 0.0, 1.0]
    assert get_group_reward("relax_rewards.group:majority_vote") is GROUP_REWARDS["majority_vote"]
    with pytest.raises(KeyError, match="unknown group reward"):
        get_group_reward("nope")
