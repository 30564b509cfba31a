"""`relax train` as a slime / veRL user meets it: a misspelt flag, --help, a name that means something else."""

from relax_app.cli import main


def test_unknown_flag_exits_2_with_the_closest_flag(capsys):
    assert main(["train", "--rollout-batchsize", "4"]) == 2
    err = capsys.readouterr().err
    assert "unknown flag --rollout-batchsize (did you mean --rollout-batch-size?)" in err


def test_help_has_required_or_real_defaults_only(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "PydanticUndefined" not in out and "--kl-coef / --kl-loss-coef" in out


def test_kl_coef_warns_at_start(tmp_path, capsys):
    # (a missing model stops the run right after the warning, before anything starts)
    argv = [
        "train",
        "--prompt-data",
        str(tmp_path / "p.jsonl"),
        "--hf-checkpoint",
        str(tmp_path / "m"),
        "--kl-coef",
        "0.01",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "relax: WARNING: --kl-coef 0.01: in slime (--kl-coef) and veRL" in err
