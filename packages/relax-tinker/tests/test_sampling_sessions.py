"""Sampling sessions over a long run: the last ``keep`` adapters in memory, older ones on disk and read back
exactly when a request names them (a cookbook loop saves a snapshot every step)."""

from __future__ import annotations

import pytest
import torch

from relax_tinker.checkpoints import UserError
from relax_tinker.sampling import Snapshot
from relax_tinker.sampling_sessions import SamplingSessions


def _sessions(tmp_path, keep: int) -> SamplingSessions:
    return SamplingSessions(
        "unused", "float32", "local", None, lambda _: None, lambda _: "", tmp_path / "spill", keep
    )


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.q_proj.lora_A.weight": torch.randn(4, 16, generator=g),
        "b": torch.randn(16, 4, generator=g),
    }


def test_memory_holds_the_last_snapshots_and_an_old_one_comes_back_exact(tmp_path):
    sessions = _sessions(tmp_path, keep=2)
    sessions.add(Snapshot("base", "m", 0))  # (the base model: no adapter, never spilled)
    for i in range(6):
        sessions.add(Snapshot(f"c:sample:{i}", "m", i, _adapter(i), "c"))
    in_memory = [s for s in sessions.snapshots.values() if s.adapter is not None]
    assert [s.session_id for s in in_memory] == ["c:sample:4", "c:sample:5"]
    assert len(list((tmp_path / "spill").iterdir())) == 4 and "base" in sessions.snapshots

    info = sessions.describe("c:sample:0")  # what it is: no adapter read back, nothing evicted
    assert info.version == 0 and info.adapter is None and "c:sample:0" in sessions.spilled
    old = sessions.snapshot("c:sample:0")  # a request on the first session: read back, the same tensors
    assert old.version == 0 and old.model_id == "c"
    for k, v in _adapter(0).items():
        assert torch.equal(old.adapter[k], v)
    held = [sid for sid, s in sessions.snapshots.items() if s.adapter is not None]
    assert held == ["c:sample:5", "c:sample:0"]  # (the least recently used went to disk instead)
    assert sessions.snapshot("c:sample:4").adapter is not None  # and comes back in its turn

    with pytest.raises(UserError, match="unknown sampling session 'nope'"):
        sessions.snapshot("nope")
    sessions.close()
    assert not (tmp_path / "spill").exists()


def test_a_request_keeps_its_weights_when_its_session_is_spilled_meanwhile(tmp_path):
    sessions = _sessions(tmp_path, keep=1)
    sessions.add(Snapshot("c:sample:0", "m", 0, _adapter(0), "c"))
    taken = sessions.snapshot("c:sample:0")  # what a queued request holds
    sessions.add(Snapshot("c:sample:1", "m", 1, _adapter(1), "c"))  # the next step's save spills it
    assert "c:sample:0" in sessions.spilled and taken.adapter is not None
    assert torch.equal(taken.adapter["b"], _adapter(0)["b"])
