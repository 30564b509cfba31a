"""SharedTorchEngine: an engine server's concurrent single-prompt calls decode together (an --agent-path
rollout's agents); what the continuous batcher does not serve goes to the engine's own batch path."""

import threading

import pytest

pytest.importorskip("torch")

from relax_rollout.engines.base import SamplingParams  # noqa: E402
from relax_rollout.engines.shared import SharedTorchEngine  # noqa: E402


def test_concurrent_calls_decode_together_and_stop_strings_take_the_batch_path(local):
    shared = SharedTorchEngine(local, max_running=8)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1, min_new_tokens=12)
    outs: list = [None] * 4
    go = threading.Barrier(4)

    def call(i: int) -> None:
        go.wait()
        outs[i] = shared.generate([[5, 6, 7 + i]], params)[0]

    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(len(o.token_ids) == 12 for o in outs)
        assert shared.batcher.peak_running >= 2  # (not one after another)
        steps = shared.batcher.steps
        stopped = shared.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, stop=("zz",)))
        assert len(stopped) == 1 and shared.batcher.steps == steps  # (the engine's batch path)
        assert shared.weight_version == local.weight_version and "stream" in shared.features
    finally:
        shared.close()
