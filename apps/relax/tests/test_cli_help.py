"""`relax train --help` as printed: wrapped to the terminal (no line over it), every default a real run's,
and beside each default the demos change, the value they set."""

import pytest

from relax_app.cli import main


@pytest.mark.parametrize("columns", [100, 72])
def test_train_help_fits_the_terminal(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if len(line) > columns] == []
    assert "relax train --omni-demo" in out and "\nrollout:\n" in out and "\nslime / veRL names:\n" in out


def test_train_help_says_which_defaults_the_demos_override(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--rollout-max-response-len (default 512; demo: 6; omni demo: 6)" in out
    assert "--lr / --learning-rate (default 1e-06; demo: 0.0002; omni demo: 0.001)" in out
    assert "--weight-decay (default 0.01; demo: 0.0; omni demo: 0.0)" in out
