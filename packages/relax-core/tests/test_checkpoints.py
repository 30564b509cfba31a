"""Checkpoints are whole or absent; --load takes the newest whole one and says what it passed over."""

from __future__ import annotations

import json
import logging

import pytest

from relax_core.checkpoints import MANIFEST, CheckpointWriteError, latest_checkpoint, problem, save_atomically


def _writer(weights: bytes = b"w" * 1000, fail: bool = False):
    def write(d):
        (d / "model").mkdir()
        (d / "model" / "model.safetensors").write_bytes(weights)
        if fail:
            raise OSError("disk full")
        (d / "meta.json").write_text(json.dumps({"version": 1}))

    return write


def test_a_checkpoint_appears_whole_with_its_manifest_or_not_at_all(tmp_path):
    target = save_atomically(tmp_path / "step_000001", _writer())
    files = json.loads((target / MANIFEST).read_text())["files"]
    assert set(files) == {"model/model.safetensors", "meta.json"} and files["meta.json"]["sha256"]
    assert problem(target) is None
    with pytest.raises(
        CheckpointWriteError, match=r"step_000002 failed \(OSError: disk full; \d+ MiB free there\)"
    ):
        save_atomically(tmp_path / "step_000002", _writer(fail=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # nothing half-written stays


def test_saving_a_step_again_keeps_the_whole_checkpoint_there(tmp_path):
    """The end-of-run save of the step last saved rewrote it in place: a kill then left it unloadable."""
    first = save_atomically(tmp_path / "step_000003", _writer(b"a" * 10))
    save_atomically(first, _writer(b"b" * 10))
    assert (first / "model" / "model.safetensors").read_bytes() == b"a" * 10


def test_load_passes_over_damaged_checkpoints_and_names_why(tmp_path, caplog):
    good = save_atomically(tmp_path / "step_000001", _writer())
    torn = save_atomically(tmp_path / "step_000002", _writer())
    with open(torn / "model" / "model.safetensors", "r+b") as f:
        f.truncate(500)  # a kill mid-copy, a full disk
    flipped = save_atomically(tmp_path / "step_000003", _writer())
    (flipped / "model" / "model.safetensors").write_bytes(b"x" * 1000)  # same size, other bytes
    (tmp_path / ".step_000004.writing-123").mkdir()  # what a kill during a save leaves
    with caplog.at_level(logging.WARNING, logger="relax_core.checkpoints"):
        assert latest_checkpoint(tmp_path) == str(good)
    said = caplog.text
    assert "step_000003" in said and "checksum" in said
    assert "step_000002" in said and "has 500 bytes, the manifest says 1000" in said
    with pytest.raises(FileNotFoundError, match="damaged: model/model.safetensors has 500 bytes"):
        latest_checkpoint(torn)  # named explicitly: an error, not another checkpoint
    (good / "meta.json").unlink()
    with pytest.raises(FileNotFoundError, match="no whole checkpoint.*step_000001: meta.json is missing"):
        latest_checkpoint(tmp_path)


def test_a_checkpoint_without_a_manifest_loads_only_when_trusted(tmp_path):
    """#49: a checkpoint without manifest.json (before relax-core 0.6, or copied in part) was trusted with
    damaged weights; it is refused now, naming --trust-unverified, and loads with it."""
    old = tmp_path / "step_000007"
    (old / "model").mkdir(parents=True)
    (old / "meta.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="manifest.json is missing.*--trust-unverified"):
        latest_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="manifest.json is missing.*--trust-unverified"):
        latest_checkpoint(old)
    assert latest_checkpoint(tmp_path, trust_unverified=True) == str(old)


@pytest.mark.parametrize(
    "manifest",
    [
        '{"files": []}',
        '{"files": {"meta.json": 2}}',
        '{"files": {"meta.json": {"bytes": "2"}}}',
        "[1]",
        '{"files": {}}',
    ],
)
def test_a_manifest_of_another_shape_is_a_problem_named_not_a_traceback(tmp_path, manifest):
    step = tmp_path / "step_000001"
    step.mkdir()
    (step / "meta.json").write_text("{}")
    (step / "manifest.json").write_text(manifest)
    why = problem(step)
    assert why is not None and why.startswith("manifest.json is"), why


def test_a_manifest_cannot_point_outside_its_checkpoint(tmp_path):
    step = tmp_path / "step_000001"
    step.mkdir()
    (step / "meta.json").write_text("{}")
    (tmp_path / "outside").write_text("x")
    files = {"meta.json": {"bytes": 2}, "../outside": {"bytes": 1}}
    (step / "manifest.json").write_text(json.dumps({"files": files}))
    assert problem(step) == "../outside is missing"


def test_a_save_into_a_directory_that_became_read_only_is_a_checkpoint_write_error(tmp_path):
    """#49: the temporary directory was made outside the guarded block, so a --save that turned read-only
    mid-run (a remount, a quota) ended the run with a traceback instead of the one-line error."""
    import shutil
    import subprocess

    save = tmp_path / "save"
    save.mkdir()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(save)]).returncode != 0:
        pytest.skip("chattr +i (an immutable directory, read-only even for root) is not available here")
    try:
        with pytest.raises(CheckpointWriteError, match="writing checkpoint .*step_000002 failed"):
            save_atomically(save / "step_000002", lambda d: (d / "meta.json").write_text("{}"))
    finally:
        subprocess.run(["chattr", "-i", str(save)], check=True)
    assert list(save.iterdir()) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_a_checkpoint_s_files_are_as_readable_as_the_umask_makes_new_files(tmp_path, umask, mode):
    """safetensors (0.8) writes its files 0600: a checkpoint's weights were unreadable to a teammate on a
    shared filesystem while everything beside them was readable."""
    import os

    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    def write(d):
        (d / "model").mkdir()
        save_file({"w": torch.zeros(2)}, str(d / "model" / "model.safetensors"))
        (d / "meta.json").write_text("{}")

    old = os.umask(umask)
    try:
        target = save_atomically(tmp_path / "step_000001", write)
    finally:
        os.umask(old)
    assert oct(os.stat(target / "model" / "model.safetensors").st_mode & 0o777) == oct(mode)
    assert oct(os.stat(target / "meta.json").st_mode & 0o777) == oct(mode)
    assert problem(target) is None  # (the manifest still matches)
