"""--help: every flag once, in the section a user looks for it in, wrapped to the width asked for (the
terminal's by default), every default a real run's, and beside each default a demo changes, the value it
sets — as rendered (``cli_help``) and as `relax train --help` prints it."""

import re

import pytest

from relax_app.cli import main
from relax_app.cli_config import flag_index, help_text
from relax_app.cli_help import SECTIONS, wrap_columns


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
    assert "--rollout-max-response-len (default 512; demo: 6; omni demo: 6; agent demo: 6)" in out
    assert "--lr / --learning-rate (default 1e-06; demo: 0.0002; omni demo: 0.001; agent demo: 0.0002)" in out
    assert "--weight-decay (default 0.01; demo: 0.0; omni demo: 0.0; agent demo: 0.0)" in out
    assert "--agent-path (default None; agent demo: 'relax_app.demo.agents:messages_agent')" in out


@pytest.mark.parametrize("width", [40, 60, 80, 100, 150])
def test_no_line_is_over_the_width(width):
    text = help_text(width=width, demos={"demo": {"lr": 2e-4, "output_dir": "runs/demo-with-a-long-name"}})
    over = [line for line in text.splitlines() if len(line) > width]
    assert over == []


def test_the_terminal_width_is_the_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "64")
    lines = help_text().splitlines()
    assert max(map(len, lines)) <= 64 and max(map(len, lines)) > 50  # (wrapped to it, not far below)


def test_every_flag_is_listed_once_under_a_section():
    text = help_text(width=100)
    headers = re.findall(r"^  (--[a-z0-9-]+)(?: / --[a-z0-9-]+)* \(", text, flags=re.M)
    assert sorted(headers) == sorted("--" + leaf.replace("_", "-") for leaf in flag_index())
    titles = re.findall(r"^([a-z][^:\n]*):$", text, flags=re.M)
    for title in (
        "rollout",
        "training",
        "algorithm",
        "data",
        "checkpoints",
        "cluster and parallelism",
        "logging",
    ):
        assert title in titles
    section = text[text.index("\ncheckpoints:") : text.index("\ncluster and parallelism:")]
    assert "--save " in section and "--load " in section and "--lr " not in section


def test_the_sections_name_only_real_flags():
    index = flag_index()
    named = [name for names in SECTIONS.values() for name in names]
    assert sorted(set(named)) == sorted(named)  # (each once)
    assert [n for n in named if n not in index] == []


def test_a_demo_value_is_shown_beside_the_default_it_changes():
    text = help_text(width=100, demos={"demo": {"lr": 2e-4, "eps_clip": 0.2}})
    assert "--lr / --learning-rate (default 1e-06; demo: 0.0002)" in text
    assert "--eps-clip (default 0.2)" in text  # (the demo's value is the default: nothing to say)


def test_usage_columns_are_reflowed_under_their_second_column():
    usage = (
        "usage: relax train\n\n"
        "  relax train                 run the CPU demo (tiny Qwen3 model, arithmetic task, GRPO, a few minutes)\n"
        "  relax eval CKPT             short\n"
        "                              continued\n"
    )
    out = wrap_columns(usage, 60).splitlines()
    assert max(map(len, out)) <= 60
    assert out[2].startswith("  relax train                 run the CPU demo")
    assert all(line.startswith(" " * 30) for line in out[3:-2])
    assert out[-2:] == ["  relax eval CKPT             short", " " * 30 + "continued"]  # (fits: kept)
