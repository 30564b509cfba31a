"""The rollout journal as the trainer reads it (the data position of a step, from the journal alone) and
the checkpoint directory's bus-resume file."""

from __future__ import annotations

import json

import pytest

from relax_core.resume import CheckpointDir, Journal, JournalEntry


def test_the_data_position_of_a_step_comes_from_the_journal(tmp_path):
    j = Journal(tmp_path / "rollout_journal.jsonl")
    j.reset()
    for e in [
        JournalEntry.begin(0, {"pos": 0}),
        JournalEntry.drawn(0, {"pos": 4}),
        JournalEntry.put(0, ["a"]),
        JournalEntry.put_group(1, 0),
        JournalEntry.begin(1, {"pos": 4}),
        JournalEntry.drawn(1, {"pos": 8}),
    ]:
        j.log(e)
    # step 2 has not begun: it begins where step 1 drew its prompts
    assert j.data_states([0, 1, 2]) == {0: {"pos": 0}, 1: {"pos": 4}, 2: {"pos": 8}}
    with pytest.raises(TimeoutError, match=r"no data position for step\(s\) \[3\].*has not begun them"):
        j.data_states([2, 3], timeout_s=0.3)
    assert Journal(None).path is None


def test_a_journal_entry_is_one_json_line_and_reads_back_as_itself(tmp_path):
    """The line format is the one the journal always had (a restarted rollout reads an older process's)."""
    entries = [
        (JournalEntry.begin(3, {"pos": 1}), {"begin": 3, "state": {"pos": 1}}),
        (JournalEntry.drawn(3, {"pos": 2}), {"drawn": 3, "state": {"pos": 2}}),
        (JournalEntry.put_group(3, 1), {"put_group": 3, "group": 1}),
        (JournalEntry.put(3, ["a", "b"]), {"put": 3, "prompts": ["a", "b"]}),
        (JournalEntry.put(2, [], restored=True), {"put": 2, "prompts": [], "restored": True}),
    ]
    j = Journal(tmp_path / "j.jsonl")
    for entry, line in entries:
        assert entry.to_json() == line and JournalEntry.from_json(line) == entry
        j.log(entry)
    assert j.entries() == [e for e, _ in entries] and j.torn == 0
    assert JournalEntry.from_json({"later_kind": 1}) is None  # (skipped, not torn)
    with pytest.raises(ValueError, match="'begin' journal entry without its fields"):
        JournalEntry.from_json({"begin": 1})
    with pytest.raises(TypeError, match="not a journal entry"):
        j.log({"begin": 1, "state": {}})


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


def test_the_run_state_lies_beside_the_backends_files_and_old_checkpoints_still_read(tmp_path):
    new = CheckpointDir(tmp_path / "new")
    new.path.mkdir()
    (new.path / "meta.json").write_text(json.dumps({"version": 3}))  # the backend's: the version only
    new.write_run_state([1, 2], [["p1"]], {"epoch": 0, "offset": 6})
    assert new.run_state() == {
        "trained_ids": [1, 2],
        "trained_prompts": [["p1"]],
        "data": {"epoch": 0, "offset": 6},
    }
    old = CheckpointDir(tmp_path / "old")  # relax-core 0.5: the run's state inside the backend's meta.json
    old.path.mkdir()
    (old.path / "meta.json").write_text(json.dumps({"version": 3, "trained_ids": [1], "data": {"offset": 2}}))
    assert old.run_state() == {"trained_ids": [1], "data": {"offset": 2}}
    start = CheckpointDir(tmp_path / "start")
    start.path.mkdir()
    start.write_run_state([], [], None)  # (no data position known: the data's start)
    assert "data" not in start.run_state()


def test_without_a_journal_a_checkpoint_has_no_data_position_and_does_not_wait(tmp_path):
    """A trainer used without our rollout role: nothing journals, and its checkpoints must not wait 300 s
    for entries that never come; step 0 before any entry is the data's start."""
    assert Journal(tmp_path / "none.jsonl").data_states([0, 4], timeout_s=0.1) == {0: None, 4: None}
    j = Journal(tmp_path / "j.jsonl")
    j.reset()
    assert j.data_states([0], timeout_s=0.1) == {0: None}
    with pytest.raises(TimeoutError, match=r"step\(s\) \[2\]"):
        j.data_states([2], timeout_s=0.1)
