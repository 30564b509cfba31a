"""Build the reward scorer a rollout uses, from relax-rewards, honouring the config's reward knobs."""

from __future__ import annotations

import functools
import time
from typing import Any

from relax_core.config import RelaxConfig
from relax_core.ownership import reward_breadcrumb


def build_scorer(cfg: RelaxConfig):
    from relax_rewards import Scorer, get_reward

    r = cfg.rollout
    fn: Any = r.rm_type if r.reward_isolation == "process" else get_reward(r.rm_type)  # (by name: picklable)
    if r.reward_delay_s > 0:
        fn = functools.partial(_delayed, get_reward(r.rm_type), r.reward_delay_s)
    return Scorer(
        fn,
        timeout_s=r.reward_timeout_s,
        max_concurrency=r.reward_concurrency,
        isolation=r.reward_isolation,
        memory_limit_mb=r.reward_memory_limit_mb,
        breadcrumb=reward_breadcrumb(cfg.run.output_dir) if r.reward_isolation == "thread" else None,
        name=r.rm_type,  # (rows naming the run's own reward get its delayed call too)
    )


def _delayed(reward: Any, delay_s: float, response: str, label: Any, metadata: dict | None = None) -> Any:
    """``reward`` after ``delay_s`` seconds: emulates a remote judge's latency (benchmarks)."""
    time.sleep(delay_s)
    return reward(response, label, metadata)
