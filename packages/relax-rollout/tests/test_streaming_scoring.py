"""Streaming rollout's bounds. Groups are scored side by side only within --reward-concurrency: the bound is
per scoring call (a group's n rewards run together), so reward_concurrency // n groups at once at most (two
scoring threads let 16 reward calls run under a bound of 8, found by the judge benchmark). Requests to
engine servers: at most --max-inflight-requests threads."""

from types import SimpleNamespace

import pytest

from relax_app.cli_config import build_config
from relax_core.resume import Journal
from relax_rollout.streaming import GroupStream

FLAGS = ["--prompt-data", "p.jsonl", "--hf-checkpoint", "m", "--fully-async", "--streaming-rollout"]


@pytest.mark.parametrize(("n", "concurrency", "groups"), [(8, 8, 1), (4, 8, 2), (2, 8, 4), (16, 8, 1)])
def test_groups_scored_at_once_stay_within_the_reward_concurrency(n, concurrency, groups):
    cfg = build_config(
        None, [*FLAGS, "--n-samples-per-prompt", str(n), "--reward-concurrency", str(concurrency)]
    )
    # (an engine that is not the torch engine: requests go through threads; nothing is generated here)
    stream = GroupStream(SimpleNamespace(cfg=cfg, engine=object()), Journal(None), lambda: None)
    try:
        assert stream.scoring._max_workers == groups
        assert stream.scoring._max_workers * min(n, concurrency) <= concurrency  # reward calls at once
    finally:
        stream.close()


def test_requests_to_engine_servers_are_bounded_by_max_inflight_requests():
    """Engines in processes or servers get one thread per request in flight: every group's responses at
    once by default (here 4 × (1 + 1) groups × 4), at most --max-inflight-requests."""
    flags = [*FLAGS, "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--max-staleness", "1"]
    for extra, threads in (([], 32), (["--max-inflight-requests", "12"], 12)):
        owner = SimpleNamespace(cfg=build_config(None, [*flags, *extra]), engine=object())
        stream = GroupStream(owner, Journal(None), lambda: None)
        try:
            assert stream.requests._max_workers == threads
        finally:
            stream.close()
