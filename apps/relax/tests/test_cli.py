"""`relax train` as a slime / veRL user meets it: a misspelt flag, --help, a name that means something else."""

import pytest

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


def test_an_unknown_reward_is_one_line_before_anything_loads(capsys):
    """Before: a KeyError traceback after Ray started and the models loaded."""
    assert main(["train", "--rm-type", "no_such_reward"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("relax: --rm-type no_such_reward: unknown reward 'no_such_reward'") and "\n" not in err
    )
    assert main(["train", "--eval-rm-type", "relax_rewards.math:nothing"]) == 2
    assert "--eval-rm-type relax_rewards.math:nothing: module 'relax_rewards.math' has no attribute" in (
        capsys.readouterr().err
    )


def empty_hater(response, label, metadata=None):
    if not response:
        raise ValueError("an empty answer")
    return 1.0


def test_a_reward_that_fails_on_the_first_row_is_named_at_start(tmp_path):
    from relax_app.cli_config import build_config
    from relax_app.train import check_inputs

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    flags = ["--prompt-data", str(tmp_path / "p.jsonl"), "--hf-checkpoint", str(tmp_path / "m")]
    cfg = build_config(None, [*flags, "--rm-type", f"{__name__}:empty_hater"])
    (note,) = check_inputs(cfg)
    assert f"--rm-type {__name__}:empty_hater on an empty response to the first row" in note
    assert "raised ValueError: an empty answer" in note
    assert check_inputs(build_config(None, flags)) == []  # (math scores an empty answer 0, no failure)


def test_a_response_length_the_models_context_cannot_hold_is_refused_at_start(tmp_path):
    """The library default (512 tokens) on a model of 128 positions: every row was skipped, then the rollout
    failed with "too many unusable rows"; now one line before anything starts."""
    from relax_app.cli_config import build_config
    from relax_app.train import check_inputs

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "qwen3", "max_position_embeddings": 128}')
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    flags = ["--prompt-data", str(tmp_path / "p.jsonl"), "--hf-checkpoint", str(tmp_path / "m")]
    with pytest.raises(ValueError, match=r"--rollout-max-response-len 512 leaves no room .* context of 128"):
        check_inputs(build_config(None, flags))
    assert check_inputs(build_config(None, [*flags, "--rollout-max-response-len", "64"])) == []


def test_a_lora_target_the_model_lacks_is_one_line_before_anything_loads(tmp_path, capsys):
    """#37: a typo in --lora-target-modules would train nothing there (or fail in peft in every role)."""
    from relax_testing import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path / "m")
    capsys.readouterr()  # (saving it printed progress)
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    flags = [
        "train",
        "--prompt-data",
        str(tmp_path / "p.jsonl"),
        "--hf-checkpoint",
        model,
        "--lora-rank",
        "4",
    ]
    assert main([*flags, "--lora-target-modules", "q_proj", "vproj", "--rollout-max-response-len", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("relax: ") and "--lora-target-modules ['vproj']: no such module" in err
    assert "v_proj" in err and "\n" not in err  # (the names it has)


def test_chat_messages_for_a_model_without_a_chat_template_are_one_line_before_anything_starts(
    tmp_path, capsys
):
    """#50: a dataset of chat messages (or --apply-chat-template) and a tokenizer without a chat template
    failed at the first rollout batch, as a role fault the health manager retried."""
    from relax_testing import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path / "m")  # (a tokenizer with no chat template)
    capsys.readouterr()
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": [{"role": "user", "content": "1+1="}], "label": "2"}\n')
    flags = ["train", "--prompt-data", str(data), "--hf-checkpoint", model, "--rollout-max-response-len", "8"]
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"relax: --prompt-data {data} holds chat messages and the tokenizer of --hf-checkpoint {model} has no "
        "chat template: use a chat model, or give the prompts as text without --apply-chat-template"
    )
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    assert main([*flags, "--apply-chat-template"]) == 2
    assert capsys.readouterr().err.startswith("relax: --apply-chat-template is on and the tokenizer of")


@pytest.mark.parametrize(
    "error, code, line",
    [
        ("relax_core.health:RunFailed", 1, "relax: the run stopped: it broke"),
        ("relax_core.checkpoints:CheckpointWriteError", 1, "relax: the run stopped: it broke"),
        ("relax_core.ownership:DataChanged", 2, "relax: it broke"),
        ("relax_core.ownership:SettingsChanged", 2, "relax: it broke"),
        ("relax_core.ownership:DirectoryInUse", 2, "relax: it broke"),
        ("relax_core.checkpoints:CheckpointNotFound", 2, "relax: it broke"),
    ],
)
def test_every_command_ends_a_known_failure_with_one_line_and_its_exit_code(
    monkeypatch, capsys, error, code, line
):
    """#49: one error boundary for every `relax` command (cli.error_kinds), whichever command raised."""
    import importlib

    from relax_app import cli

    module, _, name = error.partition(":")
    kind = getattr(importlib.import_module(module), name)

    def fails(argv):
        raise kind("it broke\n  (a traceback's worth of detail)")

    monkeypatch.setitem(cli.COMMANDS, "summary", "relax_app.cli:_raise_for_test")
    monkeypatch.setattr(cli, "_raise_for_test", fails, raising=False)
    assert cli.main(["summary", "x"]) == code
    assert capsys.readouterr().err.strip() == line
    monkeypatch.setattr(cli, "_raise_for_test", lambda argv: 1 / 0, raising=False)
    with pytest.raises(ZeroDivisionError):  # (a bug keeps its traceback)
        cli.main(["summary", "x"])


def test_fully_async_on_fewer_cores_than_model_roles_says_so_at_start(tmp_path):
    """#51: on 2-core machines fully async made 0.87-1.04x colocate's samples/s; the run says why at start.
    #52: the roles counted are those of the run's plan that load a model (the old list forgot the teacher)."""
    from relax_app.cli_config import build_config
    from relax_app.train import check_inputs

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    flags = ["--prompt-data", str(tmp_path / "p.jsonl"), "--hf-checkpoint", str(tmp_path / "m")]
    kl = ["--kl-coef", "0.01"]  # (the Reference runs: three roles with a model)
    (note,) = check_inputs(build_config(None, [*flags, *kl, "--fully-async", "--num-cpus", "2"]))
    assert note.startswith(
        "fully async on 2 CPU cores with 3 roles running a model (rollout, reference, actor)"
    )
    # the roles come from the run's plan, not a list of names: a teacher (distillation) runs a model too
    teacher = ["--teacher-checkpoint", str(tmp_path / "m")]
    (note,) = check_inputs(build_config(None, [*flags, *teacher, "--fully-async", "--num-cpus", "2"]))
    assert "3 roles running a model (rollout, teacher, actor)" in note, note
    assert "about --colocate's speed" in note and "devices of their own" in note
    assert check_inputs(build_config(None, [*flags, *kl, "--fully-async", "--num-cpus", "4"])) == []
    assert check_inputs(build_config(None, [*flags, *kl, "--colocate", "--num-cpus", "2"])) == []
