"""The rollout journal as the trainer reads it (the data position of a step, from the journal alone) and
the checkpoint directory's bus-resume file."""

from __future__ import annotations

import json

import pytest

from relax_core.resume import CheckpointDir, Journal


def test_the_data_position_of_a_step_comes_from_the_journal(tmp_path):
    j = Journal(tmp_path / "rollout_journal.jsonl")
    j.reset()
    for e in [
        {"begin": 0, "state": {"pos": 0}},
        {"drawn": 0, "state": {"pos": 4}},
        {"put": 0, "prompts": ["a"]},
        {"begin": 1, "state": {"pos": 4}},
        {"drawn": 1, "state": {"pos": 8}},
    ]:
        j.log(e)
    # step 2 has not begun: it begins where step 1 drew its prompts
    assert j.data_states([0, 1, 2]) == {0: {"pos": 0}, 1: {"pos": 4}, 2: {"pos": 8}}
    with pytest.raises(TimeoutError, match=r"no data position for step\(s\) \[3\].*has not begun them"):
        j.data_states([2, 3], timeout_s=0.3)
    assert Journal(None).path is None


def test_a_checkpoint_without_a_whole_bus_snapshot_has_no_bus_resume(tmp_path):
    ck = CheckpointDir.for_step(tmp_path, 7)
    assert ck.path == tmp_path / "step_000007"
    ck.path.mkdir()
    ck.write_bus_resume(9, {7: {"pos": 1}, 8: {"pos": 2}, 9: {"pos": 3}})
    assert ck.bus_resume() is None  # no snapshot manifest: resumed by drawing those prompts again
    ck.bus.mkdir()
    (ck.bus / "manifest.json").write_text("{}")
    assert ck.bus_resume() == {
        "next_step": 9,
        "data": {"pos": 3},
        "begun": {"7": {"pos": 1}, "8": {"pos": 2}, "9": {"pos": 3}},
    }
    assert json.loads((ck.path / "bus_resume.json").read_text())["next_step"] == 9
