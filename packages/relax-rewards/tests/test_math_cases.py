"""The labelled math set (``math_cases.py``): ours must match the truth on every case, and where
math-verify disagrees with the truth the case must be documented (README, "math-verify")."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from math_cases import CASES, MATH_VERIFY_WRONG  # noqa: E402

from relax_rewards.math import math_reward  # noqa: E402


def test_the_set_is_big_and_balanced():
    assert len(CASES) >= 300
    assert sum(ok for *_, ok in CASES) > 100 and sum(not ok for *_, ok in CASES) > 80
    assert set(MATH_VERIFY_WRONG) <= {(r, lab) for r, lab, _ in CASES}


@pytest.mark.parametrize("response,label,correct", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_math_reward_matches_truth(response, label, correct):
    result = math_reward(response, label)
    assert (result.score == 1.0) is correct, result.details


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="pip install math-verify")
def test_math_verify_only_errs_where_documented():
    from math_verify import parse, verify

    wrong = set()
    for response, label, correct in CASES:
        try:
            got = bool(verify(parse("$" + label + "$"), parse(response), timeout_seconds=1))
        except Exception:
            got = False
        if got != correct:
            wrong.add((response, label))
    undocumented = wrong - set(MATH_VERIFY_WRONG)
    assert not undocumented, f"math-verify disagrees on undocumented cases: {sorted(undocumented)}"
