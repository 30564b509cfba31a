"""Streaming rollout scores groups side by side only within --reward-concurrency: the bound is per scoring
call (a group's n rewards run together), so reward_concurrency // n groups at once at most. Two scoring
threads let 16 reward calls run under a bound of 8 (found by the judge benchmark)."""

from types import SimpleNamespace

import pytest

from relax_core.cli_config import build_config
from relax_rollout.streaming import GroupStream

FLAGS = ["--prompt-data", "p.jsonl", "--hf-checkpoint", "m", "--fully-async", "--streaming-rollout"]


@pytest.mark.parametrize(("n", "concurrency", "groups"), [(8, 8, 1), (4, 8, 2), (2, 8, 4), (16, 8, 1)])
def test_groups_scored_at_once_stay_within_the_reward_concurrency(n, concurrency, groups):
    cfg = build_config(
        None, [*FLAGS, "--n-samples-per-prompt", str(n), "--reward-concurrency", str(concurrency)]
    )
    # (an engine that is not the torch engine: requests go through threads; nothing is generated here)
    stream = GroupStream(SimpleNamespace(cfg=cfg, engine=object()))
    try:
        assert stream.scoring._max_workers == groups
        assert stream.scoring._max_workers * min(n, concurrency) <= concurrency  # reward calls at once
    finally:
        stream.close()
