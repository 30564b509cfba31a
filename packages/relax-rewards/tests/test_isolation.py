"""Process isolation: hangs, os._exit and SIGKILL yield the fallback without stopping the batch,
and time-outs hold within 10% of the limit (plus a fixed allowance for the scorer's bookkeeping)."""

import os
import signal
import time

import pytest

from relax_rewards import Scorer

# Fixed allowance on top of limit * 1.10: waking the scorer's wait() and SIGKILL-ing the worker.
# Worker start-up is not in it: workers are pre-forked when the Scorer is built.
SPAWN_ALLOWANCE_S = 0.15


def misbehaving(response, label, metadata=None):
    if response == "hang":
        while True:
            pass
    if response == "sleep":
        time.sleep(3600)
    if response == "exit":
        os._exit(3)
    if response == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "raise":
        raise ValueError("nope")
    if response == "unpicklable":
        return lambda: None
    return 1.0


@pytest.fixture
def scorer():
    s = Scorer(misbehaving, timeout_s=1.0, max_concurrency=4, isolation="process")
    yield s
    s.close()


def test_hang_exit_and_kill_do_not_stop_the_batch(scorer):
    responses = ["ok", "hang", "exit", "ok", "sigkill", "raise", "ok", "unpicklable"]
    results = scorer.score_batch(responses, [None] * len(responses))
    assert [r.score for r in results] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert results[1].failure == "timeout after 1 s"
    assert results[2].failure == "reward process died (exit code 3)"
    assert results[4].failure == "reward process died (killed by signal 9)"
    assert results[5].failure == "raised ValueError: nope"
    assert results[7].failure.startswith("bad return")  # (converted in the worker, before pickling)
    stats = scorer.stats()
    assert stats["crashed"] == 2 and stats["timeout"] == 1 and stats["failed"] == 5
    # the pool recovered: the next batch runs normally
    assert [r.score for r in scorer.score_batch(["ok"] * 6, [None] * 6)] == [1.0] * 6


@pytest.mark.parametrize("limit", [0.5, 1.0])
def test_timeout_holds_within_ten_percent(limit):
    with Scorer(misbehaving, timeout_s=limit, max_concurrency=2, isolation="process") as s:
        start = time.monotonic()
        results = s.score_batch(["hang", "sleep", "ok"], [None] * 3)
        elapsed = time.monotonic() - start
    assert [r.failure is not None for r in results] == [True, True, False]
    assert limit <= elapsed < limit * 1.10 + SPAWN_ALLOWANCE_S, elapsed


def test_timed_out_worker_is_killed(scorer):
    scorer.score_batch(["hang"], [None])
    busy_pids = [w.process.pid for w in scorer._pool._busy.values()]
    assert busy_pids == []  # the worker was removed and killed, not left spinning


def test_registered_name_and_memory_limit():
    with Scorer("math", isolation="process", max_concurrency=2, memory_limit_mb=1024) as s:
        results = s.score_batch([r"\boxed{\frac12}", "7"], ["0.5", "8"])
    assert [r.score for r in results] == [1.0, 0.0]


def test_thread_timeout_also_within_ten_percent():
    s = Scorer(misbehaving, timeout_s=0.5, max_concurrency=2)
    start = time.monotonic()
    s.score_batch(["sleep", "ok"], [None, None])
    assert time.monotonic() - start < 0.5 * 1.10 + SPAWN_ALLOWANCE_S


def test_bad_isolation_argument():
    with pytest.raises(ValueError, match="isolation"):
        Scorer(misbehaving, isolation="vm")
