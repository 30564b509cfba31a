"""The rollout's scorer (``relax_rollout.rewards.build_scorer``) honours the config's reward knobs."""

import time

from relax_core.config import RelaxConfig
from relax_rollout.rewards import build_scorer


def test_the_reward_delay_applies_to_rows_that_name_the_run_s_own_reward():
    """--reward-delay-s wraps the run's reward; rows whose metadata names that same reward (the omni demo's
    all do) were scored by the registry's plain function, without the delay (the scorer compared the name
    with the wrapper)."""
    cfg = RelaxConfig.model_validate({"rollout": {"rm_type": "math", "reward_delay_s": 0.3}})
    scorer = build_scorer(cfg)
    try:
        t0 = time.perf_counter()
        got = scorer.score_batch(["4", "5"], ["4", "4"], [{"rm_type": "math"}, None])
        assert time.perf_counter() - t0 >= 0.3
        assert [r.score for r in got] == [1.0, 0.0]
        t0 = time.perf_counter()
        scorer.score_batch(["4"], ["4"], [{"rm_type": "math"}])  # (the row naming it alone: delayed too)
        assert time.perf_counter() - t0 >= 0.3
    finally:
        scorer.close()
