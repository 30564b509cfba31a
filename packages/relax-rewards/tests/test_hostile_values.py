"""What a reward returns is converted inside the guarded call (issue 36): a value past float's range, a
``__float__`` that raises or blocks, a score of ±inf inside a RewardResult — each a counted ``bad_return`` or
``timeout`` for its own sample, never an exception out of the batch or a batch that waits forever; in thread
and process isolation alike. And a reward that cannot be loaded or called is one line, before a run starts."""

import time

import pytest

from relax_rewards import RewardResult, Scorer, check_reward


class BlockingFloat:
    def __float__(self):
        time.sleep(30)
        return 1.0


class RaisingFloat:
    def __float__(self):
        raise RuntimeError("no float for you")


def huge(response, label, metadata=None):
    return 10**400


def huge_result(response, label, metadata=None):
    return RewardResult(10**5000)  # (str() of it raises too: the message must not)


def blocking(response, label, metadata=None):
    return BlockingFloat()


def raising_float(response, label, metadata=None):
    return RaisingFloat()


def fine(response, label, metadata=None):
    return 1.0


def mixed(response, label, metadata=None):
    return {"huge": huge, "raising": raising_float, "fine": fine}[response](response, label, metadata)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_values_float_cannot_hold_are_counted_bad_returns(isolation):
    with Scorer(mixed, timeout_s=5.0, isolation=isolation, max_concurrency=2) as scorer:
        got = scorer.score_batch(["huge", "raising", "fine"], [None] * 3)
    assert [r.score for r in got] == [0.0, 0.0, 1.0]
    assert got[0].failure.startswith("bad return") and "OverflowError" in got[0].failure
    assert "RuntimeError: no float for you" in got[1].failure
    assert scorer.stats()["bad_return"] == 2 and scorer.stats()["failed"] == 2


def test_a_result_holding_a_5000_digit_int_is_a_bad_return_with_a_short_message():
    got = Scorer(huge_result).score("x", None)
    assert got.failure.startswith("bad return") and "digits" in got.failure and len(got.failure) < 400


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_float_that_blocks_is_the_call_s_time_out(isolation):
    """Before: the value was converted after the call returned, outside its deadline: the batch hung."""
    with Scorer(blocking, timeout_s=0.5, isolation=isolation) as scorer:
        t = time.monotonic()
        got = scorer.score("x", None)
        assert time.monotonic() - t < 10
    assert got.failure.startswith("timeout") and scorer.stats()["timeout"] == 1


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 10**400, "1.0", None])
def test_a_score_from_elsewhere_goes_through_the_same_check(value):
    scorer = Scorer(fine)
    got = scorer.check(value)
    assert got.score == 0.0 and got.failure.startswith("bad return")
    assert scorer.stats() == {"bad_return": 1, "failed": 1}
    assert scorer.check(0.5).score == 0.5


def not_a_reward(response):
    return 1.0


NOT_CALLABLE = 3


@pytest.mark.parametrize(
    "name, says",
    [
        ("no_such_reward", "unknown reward 'no_such_reward'"),
        ("no_such_module_xyz:fn", "no_such_module_xyz"),
        (f"{__name__}:missing", "has no attribute 'missing'"),
        (f"{__name__}:NOT_CALLABLE", "is not callable"),
        (f"{__name__}:not_a_reward", "cannot be called as fn(response, label, metadata)"),
    ],
)
def test_a_reward_that_cannot_be_loaded_or_called_is_one_line(name, says):
    with pytest.raises(ValueError) as err:
        check_reward(name, "--rm-type")
    msg = str(err.value)
    assert msg.startswith(f"--rm-type {name}: ") and says in msg and "\n" not in msg
    assert check_reward("math") is not None


EXITING = """
import os, threading
from relax_rewards import Scorer

def exiting(response, label, metadata=None):
    if response == "exit":
        os._exit(7)
    return 1.0

scorer = Scorer(exiting, timeout_s=5.0)
got = scorer.score_batch(["ok", "exit", "ok"], [None] * 3)
print([r.score for r in got], got[1].failure, scorer.stats()["crashed"])
threading.Thread(target=os._exit, args=(5,)).start()  # any other thread: the real os._exit
"""


def test_a_reward_calling_os_exit_fails_its_call_in_thread_isolation(tmp_path):
    """Before: the default thread mode's process (the rollout; in colocate, the run) ended with no message.
    (In a child process: on the old code this test's process would have exited.)"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", EXITING], capture_output=True, text=True, timeout=60)
    assert out.returncode == 5, out.stderr
    assert out.stdout.strip() == (
        "[1.0, 0.0, 1.0] the reward called os._exit(7); a reward must return a score, not end its process 1"
    )
