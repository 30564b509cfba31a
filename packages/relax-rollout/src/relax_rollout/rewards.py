"""Build the reward scorer a rollout uses, from relax-rewards, honouring the config's reward knobs."""

from __future__ import annotations

import time
from typing import Any

from relax_core.config import RelaxConfig


def build_scorer(cfg: RelaxConfig):
    from relax_rewards import Scorer, get_reward

    r = cfg.rollout
    fn = get_reward(r.rm_type)
    if r.reward_delay_s > 0:
        base, delay = fn, r.reward_delay_s

        def fn(response: str, label: Any, metadata: dict | None = None):  # noqa: F811 - wraps the reward
            time.sleep(delay)  # emulates a remote judge's latency (benchmarks)
            return base(response, label, metadata)

    return Scorer(fn, timeout_s=r.reward_timeout_s, max_concurrency=r.reward_concurrency)
