"""The scorer: concurrency, failures turned into fallback scores, time-outs, rm_type overrides."""

import threading
import time

import pytest

from relax_rewards import RewardResult, Scorer, register


def exact(response, label, metadata=None):
    return 1.0 if response == label else 0.0


def raising(response, label, metadata=None):
    raise ValueError(f"bad input {response!r}")


def test_scores_in_order():
    scorer = Scorer(exact)
    results = scorer.score_batch(["a", "b", "c"], ["a", "x", "c"], [None, None, None])
    assert [r.score for r in results] == [1.0, 0.0, 1.0]
    assert all(isinstance(r, RewardResult) and r.failure is None for r in results)
    assert scorer.stats() == {"scored": 3}


def test_metadatas_optional_and_lengths_checked():
    scorer = Scorer(exact)
    assert scorer.score_batch(["a"], ["a"])[0].score == 1.0
    with pytest.raises(ValueError, match="same length"):
        scorer.score_batch(["a", "b"], ["a"])


def test_by_name_and_score_single():
    r = Scorer("math").score(r"\boxed{4}", "4")
    assert r.score == 1.0 and r.details["extracted"] == "4"


def test_raising_reward_gets_fallback():
    scorer = Scorer(raising, fallback_score=-0.5)
    results = scorer.score_batch(["x", "y"], [None, None])
    assert [r.score for r in results] == [-0.5, -0.5]
    assert results[0].failure.startswith("raised ValueError: bad input 'x'")
    assert scorer.stats()["raised:ValueError"] == 2
    assert scorer.stats()["failed"] == 2


def test_bad_return_value():
    scorer = Scorer(lambda response, label, metadata=None: "yes")
    r = scorer.score("x", None)
    assert r.score == 0.0 and r.failure.startswith("bad return")
    assert scorer.stats()["bad_return"] == 1


@pytest.mark.parametrize("score", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_score_is_a_failure_not_a_reward(score):
    """±inf as a reward made every advantage of its group ±inf or NaN, and the weights NaN after one step."""
    scorer = Scorer(lambda response, label, metadata=None: RewardResult(score) if score != score else score)
    r = scorer.score("x", None)
    assert r.score == 0.0 and r.failure.startswith("bad return") and "finite" in r.failure
    assert scorer.stats()["bad_return"] == 1


def test_malformed_labels_are_failures_and_missing_ones_are_counted():
    """A dict label (a broken dataset column) used to score 0 like a wrong answer; a missing one too."""
    scorer = Scorer("math")
    got = scorer.score_batch([r"\boxed{2}"] * 4, [{"answer": "2"}, None, True, "2"])
    assert [r.score for r in got] == [0.0, 0.0, 0.0, 1.0]
    assert "label column" in got[0].failure and "label column" in got[2].failure and got[1].failure is None
    assert scorer.stats()["raised:ValueError"] == 2 and scorer.stats()["unlabeled"] == 1


def test_hanging_reward_times_out_without_blocking_the_batch():
    release = threading.Event()

    def sometimes_hangs(response, label, metadata=None):
        if response == "hang":
            release.wait(30)  # released at the end of the test
        return 1.0

    scorer = Scorer(sometimes_hangs, timeout_s=0.5, max_concurrency=4)
    start = time.monotonic()
    try:
        results = scorer.score_batch(["ok", "hang", "ok", "hang", "ok"], [None] * 5)
    finally:
        release.set()
    elapsed = time.monotonic() - start
    assert elapsed < 0.5 + 5.0  # returns within the time-out plus a generous margin
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert results[1].failure == "timeout after 0.5 s"
    assert results[0].failure is None
    assert scorer.stats()["timeout"] == 2


def test_concurrency_runs_calls_in_parallel():
    lock = threading.Lock()
    active = {"now": 0, "max": 0}

    def slow(response, label, metadata=None):
        with lock:
            active["now"] += 1
            active["max"] = max(active["max"], active["now"])
        time.sleep(0.05)
        with lock:
            active["now"] -= 1
        return 1.0

    results = Scorer(slow, max_concurrency=3).score_batch(["x"] * 9, [None] * 9)
    assert all(r.score == 1.0 for r in results)
    assert 1 < active["max"] <= 3


def test_a_batch_of_cheap_calls_runs_on_a_few_threads_not_one_per_call(monkeypatch):
    """A thread per call cost ~20x an exact-match reward: a batch now starts a runner or two, each taking
    calls in turn, and still scores every sample in order. (Before: 256 threads for 256 samples.)"""
    started = []
    real_start = threading.Thread.start

    def counting_start(thread):
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", counting_start)
    labels = [str(k % 7) for k in range(256)]
    results = Scorer(exact, max_concurrency=8).score_batch([str(k % 5) for k in range(256)], labels)
    assert [r.score for r in results] == [float(str(k % 5) == labels[k]) for k in range(256)]
    assert 1 <= started.count("relax-reward") <= 8


def test_a_hung_call_costs_its_own_sample_only_and_its_runner_s_queue_moves_on():
    """One runner is stuck in a call past the time-out: that sample times out, a new runner takes the calls
    queued behind it, and whatever the stuck call returns later is dropped."""
    release = threading.Event()
    seen = []

    def first_hangs(response, label, metadata=None):
        seen.append(response)
        if response == "0":
            release.wait(30)
            return 5.0  # too late: never a score
        return 1.0

    try:
        results = Scorer(first_hangs, timeout_s=0.3, max_concurrency=1).score_batch(
            [str(k) for k in range(6)], [None] * 6
        )
    finally:
        release.set()
    assert [r.score for r in results] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert results[0].failure == "timeout after 0.3 s"
    assert seen == [str(k) for k in range(6)]  # each call made once


def test_async_reward():
    async def async_exact(response, label, metadata=None):
        return RewardResult(1.0 if response == label else 0.0, {"async": True})

    results = Scorer(async_exact).score_batch(["a", "b"], ["a", "a"])
    assert [r.score for r in results] == [1.0, 0.0]
    assert results[0].details == {"async": True}


def test_per_sample_rm_type_override(clean_registry):
    @register("test_const_half")
    def half(response, label, metadata=None):
        return 0.5

    scorer = Scorer("math")
    results = scorer.score_batch(
        [r"\boxed{1}", "whatever", "Answer: 2", "x"],
        ["1", None, "3", None],
        [None, {"rm_type": "test_const_half"}, {"rm_type": "dapo"}, {"rm_type": "nope"}],
    )
    assert [r.score for r in results] == [1.0, 0.5, -1.0, 0.0]
    assert "unknown reward 'nope'" in results[3].failure
    assert scorer.stats()["unknown_reward"] == 1


def test_unknown_default_reward_fails_fast():
    with pytest.raises(KeyError, match="registered rewards"):
        Scorer("definitely_not_a_reward")


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        Scorer(exact, timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        Scorer(exact, max_concurrency=0)


def test_ascore_batch():
    import asyncio

    results = asyncio.run(Scorer(exact).ascore_batch(["a"], ["a"]))
    assert results[0].score == 1.0


def test_empty_batch():
    assert Scorer(exact).score_batch([], []) == []
