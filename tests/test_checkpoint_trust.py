"""A checkpoint is what its manifest says or nothing (#49), through the real `relax` commands: every reader
(`relax train --load`, `relax eval`, `relax export`, a checkpoint's model/ directory given to either)
refuses one without manifest.json unless told --trust-unverified, and one whose files do not match it;
`relax export` never writes inside its source. Before: each was trusted, damaged weights and all (exit 0),
and `relax export S S --overwrite` deleted every checkpoint in S."""

from __future__ import annotations

import shutil

import pytest
from _tiny import run_flags

from relax_app.cli import main
from relax_core.checkpoints import MANIFEST, latest_checkpoint


@pytest.fixture(scope="module")
def saved(tiny_run_inputs, tmp_path_factory):
    """A finished colocate run's --save (one checkpoint, with its manifest)."""
    out = tmp_path_factory.mktemp("trust")
    save = out / "save"
    assert main(["train", *run_flags(tiny_run_inputs, out / "run", num_rollout=1, save=str(save))]) == 0
    return save


def _copy(saved, tmp_path, damage=None):
    save = tmp_path / "save"
    shutil.copytree(saved, save)
    step = save / "step_000001"
    if damage == "no manifest":
        (step / MANIFEST).unlink()
    elif damage == "weights":
        weights = step / "model" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0xFF  # (a flipped byte in the last tensor: the size is right)
        weights.write_bytes(bytes(data))
    return save, step


def test_a_checkpoint_without_a_manifest_is_refused_by_every_reader_unless_trusted(
    saved, tiny_run_inputs, tmp_path, capsys
):
    save, step = _copy(saved, tmp_path, "no manifest")
    data = ["--data", str(tiny_run_inputs.eval_path)]
    for argv in (
        ["eval", str(step), *data],
        ["eval", str(step / "model"), *data],
        ["export", str(step), str(tmp_path / "hf")],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "manifest.json is missing" in err and "--trust-unverified" in err, err
    resumed = run_flags(tiny_run_inputs, tmp_path / "run", num_rollout=2, save=str(save))
    assert main(["train", *resumed, "--load", str(save)]) == 2
    assert "--trust-unverified" in capsys.readouterr().err
    assert main(["export", str(step), str(tmp_path / "hf"), "--trust-unverified"]) == 0
    assert main(["train", *resumed, "--load", str(save), "--trust-unverified"]) == 0
    assert latest_checkpoint(save).endswith("step_000002")  # (the resumed run's, with its manifest)


def test_damaged_weights_are_refused_through_the_model_directory_too(
    saved, tiny_run_inputs, tmp_path, capsys
):
    _, step = _copy(saved, tmp_path, "weights")
    data = ["--data", str(tiny_run_inputs.eval_path)]
    for argv in (["eval", str(step / "model"), *data], ["export", str(step / "model"), str(tmp_path / "hf")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "model/model.safetensors does not match its checksum" in err and "\n" not in err, err


def test_export_never_writes_inside_its_source(saved, tmp_path, capsys):
    save, step = _copy(saved, tmp_path)
    for out in (save, step, step / "hf", save / "exported"):
        assert main(["export", str(save), str(out), "--overwrite"]) == 2, out
        assert "overlap" in capsys.readouterr().err
    assert (step / MANIFEST).is_file() and not (save / "exported").exists()


def test_an_engine_refuses_the_disk_load_of_a_damaged_checkpoint(saved, tiny_run_inputs, tmp_path):
    from relax_rollout.engines.torch_engine import TorchEngine
    from relax_rollout.server import EngineServer
    from relax_rollout.server.protocol import BadRequest

    server = EngineServer(TorchEngine(model_path=tiny_run_inputs.model_path), None)
    _, whole = _copy(saved, tmp_path / "whole")
    assert server.update_from_disk(str(whole / "model"), 5) == 5
    _, damaged = _copy(saved, tmp_path / "damaged", "weights")
    with pytest.raises(BadRequest, match="does not match its checksum"):
        server.update_from_disk(str(damaged / "model"), 6)
    assert server.engine.weight_version == 5
