"""Every part of a checkpoint is in its manifest and checked at load (issue 36): the bus snapshot written
after the checkpoint was renamed into place, a damaged or foreign snapshot, torn journal lines, and the
temporary directories of saves that were killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from relax_bus import BusConfig, BusError, ConsumerSpec, DataBus
from relax_bus import snapshot as bus_snapshot
from relax_core.checkpoints import latest_checkpoint, problem, save_atomically
from relax_core.resume import CheckpointDir, Journal, JournalEntry


def _checkpoint(root, version: int, with_bus: bool = True) -> CheckpointDir:
    """A checkpoint as the trainer writes one: the backend's files atomically, then (fully async) the bus
    snapshot and bus_resume.json beside them, sealed into the manifest."""

    def write(d):
        (d / "meta.json").write_text(json.dumps({"version": version}))
        (d / "weights.bin").write_bytes(b"w" * 100)

    ck = CheckpointDir(save_atomically(CheckpointDir.for_step(root, version).path, write))
    if with_bus:
        bus = DataBus(BusConfig(consumers={"actor": ConsumerSpec()}, capacity=10))
        bus.put([{"tokens": [1, 2, 3], "rollout_step": version}])
        bus.snapshot(ck.bus)
        ck.write_bus_resume(version + 1, {version: {"pos": 1}, version + 1: {"pos": 2}})
        ck.seal_bus()
    return ck


def test_the_bus_snapshot_is_in_the_manifest_and_a_truncated_one_skips_that_checkpoint(tmp_path, caplog):
    """Before: bus/ was written after the manifest, so a truncated bus/state.pkl passed every check and
    the resume died with an UnpicklingError traceback. Now the newest checkpoint is passed over, named."""
    _checkpoint(tmp_path, 3)
    newer = _checkpoint(tmp_path, 5)
    assert newer.bus_resume()["next_step"] == 6 and problem(newer.path) is None
    state = newer.bus / "state.pkl"
    state.write_bytes(state.read_bytes()[:20])
    assert "bus/state.pkl has 20 bytes" in problem(newer.path)
    with caplog.at_level("WARNING"):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "step_000003")
    assert "step_000005 is not whole (bus/state.pkl has 20 bytes" in caplog.text
    with pytest.raises(FileNotFoundError, match="step_000005: the checkpoint is damaged: bus/state.pkl"):
        latest_checkpoint(newer.path)


def test_a_snapshot_a_kill_left_out_of_the_manifest_is_not_trusted(tmp_path):
    ck = _checkpoint(tmp_path, 2, with_bus=False)
    bus = DataBus(BusConfig(consumers={"actor": ConsumerSpec()}, capacity=10))
    bus.snapshot(ck.bus)  # written, then killed before seal_bus
    ck.write_bus_resume(3, {2: {"pos": 1}, 3: {"pos": 2}})
    assert problem(ck.path) is None  # the checkpoint itself is whole
    assert ck.bus_resume() is None  # resumed by drawing those prompts again, not from an unchecked file


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:10]), "cannot be read (UnpicklingError"),
        (
            lambda p: p.write_bytes(__import__("pickle").dumps({"not": "a bus"})),
            "is not a bus state (no config",
        ),
    ],
)
def test_a_damaged_or_foreign_snapshot_is_an_error_naming_its_file(tmp_path, damage, says):
    """Before: an UnpicklingError traceback, or ``KeyError: 'config'`` naming no file."""
    bus = DataBus(BusConfig(consumers={"actor": ConsumerSpec()}, capacity=10))
    bus.snapshot(tmp_path / "bus")
    damage(tmp_path / "bus" / "state.pkl")
    with pytest.raises(BusError) as err:
        bus_snapshot.read(tmp_path / "bus")
    assert str(tmp_path / "bus" / "state.pkl") in str(err.value) and says in str(err.value)


def test_torn_journal_lines_are_skipped_and_counted(tmp_path):
    """Before: a JSONDecodeError in the trainer's checkpoint (data_states) and the rollout's restart."""
    j = Journal(tmp_path / "rollout_journal.jsonl")
    j.log(JournalEntry.begin(0, {"pos": 0}))
    j.log(JournalEntry.drawn(0, {"pos": 4}))
    j.log(JournalEntry.put(0, ["a"]))
    with open(j.path, "a") as f:
        f.write('{"begin": 1, "sta\n[1, 2]\n')  # a line torn by a kill, and one that is no entry
    assert j.data_states([1]) == {1: {"pos": 4}} and j.torn == 2
    rec = j.recover()
    assert (rec.start, rec.state, rec.prompt_log) == (1, {"pos": 4}, [(0, ["a"])])
    assert j.torn_lines() == 2


def test_a_killed_save_s_directory_is_removed_at_the_next_save(tmp_path):
    """Before: ``.step_N.writing-PID`` of a killed save stayed for ever (a model's size each)."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".step_000004.writing-{int(dead.stdout)}"
    (stale / "model").mkdir(parents=True)
    alive = tmp_path / f".step_000004.writing-{os.getppid()}"  # a save still running elsewhere: kept
    alive.mkdir()
    _checkpoint(tmp_path, 5, with_bus=False)
    assert not stale.exists() and alive.exists()
