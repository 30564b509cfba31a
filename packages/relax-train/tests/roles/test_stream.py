"""The trainer's step under streaming rollout (``roles/stream.py``): it streams only on a backend that
declares streamed steps, and trains a step's parts as the bus delivers them, with the state it is handed
(the heartbeat and π_prox callables, the weights' lock), never the trainer itself."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from relax_app.cli_config import build_config
from relax_bus import BusTimeout
from relax_core.trace import Tracer
from relax_train.roles.stream import streams_training, train_as_it_arrives

FLAGS = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--streaming-rollout", "--fully-async"]


def _cfg(*extra: str):
    return build_config(None, ["--prompt-data", "unused", "--hf-checkpoint", "unused", *FLAGS, *extra])


def test_streaming_asks_the_backend_whether_it_can():
    cfg = _cfg()
    assert streams_training(cfg, SimpleNamespace(supports_streamed_step=True))
    assert not streams_training(cfg, SimpleNamespace(supports_streamed_step=False))  # megatron: whole batch
    refused = _cfg("--global-batch-size", "2")  # two optimizer steps per batch: not streamed
    assert not streams_training(refused, SimpleNamespace(supports_streamed_step=True))


class _Update:
    def __init__(self, n: int) -> None:
        self.n, self.parts = n, []

    def add(self, part):
        self.parts.append(part)

    def finish(self):
        return {"loss": 0.5, "samples": float(sum(len(p["tokens"]) for p in self.parts))}


class _Batch:
    def __init__(self, ids, lease_id, data) -> None:
        self.ids, self.lease_id, self.data = ids, lease_id, data

    def __len__(self) -> int:
        return len(self.ids)


class _Bus:
    """Delivers step 0's four samples in two parts, after one empty poll."""

    def __init__(self) -> None:
        self.calls = 0

    def get(self, consumer, n, partial, trainer_version, timeout, partition):
        assert partial and trainer_version == 0 and partition == "step0"
        self.calls += 1
        if self.calls == 1:
            raise BusTimeout("nothing yet")
        ids = [2 * self.calls - 4, 2 * self.calls - 3]
        data = {"tokens": [[1, 2], [3]], "prompt_len": [1, 1], "advantages": [[1.0], [0.0]]}
        return _Batch(ids, self.calls, data)


def test_a_step_trains_its_parts_as_they_arrive():
    cfg, bus, beats, prox_parts = _cfg(), _Bus(), [], []
    updates: list[_Update] = []

    def streamed_step(n):
        updates.append(_Update(n))
        return updates[-1]

    backend = SimpleNamespace(supports_streamed_step=True, streamed_step=streamed_step)
    lock = threading.Lock()

    def exact_prox(part):
        assert not lock.locked()  # (only the optimizer step holds the weights' lock)
        prox_parts.append(part)
        return {"train/prox_recomputed_frac": 0.25 * len(prox_parts)}

    taken, metrics, waited = train_as_it_arrives(
        0,
        cfg=cfg,
        bus=bus,
        backend=backend,
        tracer=Tracer("actor", False),
        lock=lock,
        exact_prox=exact_prox,
        alive=lambda: beats.append(1),
    )
    assert [u.n for u in updates] == [4] and len(updates[0].parts) == 2 == len(prox_parts)
    assert taken.ids == [0, 1, 2, 3] and taken.lease_ids == [2, 3] and len(taken.taken_at) == 4
    assert taken.data["tokens"] == [[1, 2], [3], [1, 2], [3]]
    assert metrics["train/loss"] == 0.5 and metrics["train/samples"] == 4.0 and metrics["train/parts"] == 2.0
    assert metrics["train/prox_recomputed_frac"] == pytest.approx(0.375)  # the parts' sample-weighted mean
    assert len(beats) == 3 and waited >= 0.0  # a heartbeat at every poll, the empty one included
