"""slime's flag names: aliases for the same knob, a refusal where there is none, a note where ours means
something else."""

import pytest

from relax_core.cli_config import ConfigError, build_config, help_text


def test_slime_names_set_our_flags():
    cfg = build_config(
        argv=[
            "--kl-loss-coef",
            "0.01",
            "--ref-load",
            "/ckpt/ref",
            "--eval-prompt-data",
            "aime",
            "/data/aime.jsonl",
            "--lr",
            "1e-6",
        ]
    )
    assert cfg.algo.kl_coef == 0.01 and cfg.algo.use_kl_loss  # slime's KL loss: ours, in the loss
    assert cfg.model.ref_checkpoint == "/ckpt/ref"
    assert cfg.data.eval_data == "/data/aime.jsonl" and cfg.train.lr == 1e-6
    assert build_config(argv=["--eval-prompt-data", "/data/aime.jsonl"]).data.eval_data == "/data/aime.jsonl"
    assert build_config(argv=["--kl-loss-coef=0.02"]).algo.kl_coef == 0.02


def test_slime_names_in_yaml(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("kl-loss-coef: 0.03\nref_load: /r\neval_prompt_data: [aime, /a.jsonl]\n")
    cfg = build_config(path)
    assert (cfg.algo.kl_coef, cfg.model.ref_checkpoint, cfg.data.eval_data) == (0.03, "/r", "/a.jsonl")


def test_several_eval_sets_are_refused():
    with pytest.raises(
        ConfigError, match="--eval-prompt-data: relax evaluates one held-out set; give --eval-data"
    ):
        build_config(argv=["--eval-prompt-data", "aime", "/a.jsonl", "math", "/m.jsonl"])


def test_kl_loss_coef_with_slimes_kl_coef():
    # slime scripts set both; --kl-coef 0 there means "no KL in the reward"
    assert build_config(argv=["--kl-loss-coef", "0.01", "--kl-coef", "0.00"]).algo.kl_coef == 0.01
    assert build_config(argv=["--kl-coef", "0", "--kl-loss-coef", "0.01"]).algo.kl_coef == 0.01
    assert build_config(argv=["--kl-coef", "0.01", "--kl-loss-coef", "0.01"]).algo.kl_coef == 0.01
    with pytest.raises(
        ConfigError, match="--kl-loss-coef 0.01 and --kl-coef 0.02: in slime these are two KL"
    ):
        build_config(argv=["--kl-loss-coef", "0.01", "--kl-coef", "0.02"])


def test_rollout_top_k_has_no_equivalent():
    with pytest.raises(ConfigError, match="--rollout-top-k 20: no equivalent in relax; .*--rollout-top-p"):
        build_config(argv=["--rollout-top-k", "20"])
    assert build_config(argv=["--rollout-top-k", "-1"]) == build_config(argv=[])  # off: as here


def test_kl_coef_notes_its_other_meaning():
    notes: list[str] = []
    build_config(argv=["--kl-coef", "0.01"], notes=notes)
    assert len(notes) == 1 and "slime" in notes[0] and "--kl-in-reward --no-use-kl-loss" in notes[0]
    for argv in (
        ["--kl-coef", "0.01", "--kl-in-reward", "--no-use-kl-loss"],
        ["--kl-coef", "0.01", "--use-kl-loss"],
        ["--kl-loss-coef", "0.01", "--kl-coef", "0"],
        ["--kl-coef", "0"],
        [],
    ):
        notes = []
        build_config(argv=argv, notes=notes)
        assert notes == [], argv


def test_help_lists_the_aliases_next_to_our_names_and_the_note():
    text = help_text()
    assert "--kl-coef / --kl-loss-coef" in text
    assert "--ref-checkpoint / --ref-load" in text and "--eval-data / --eval-prompt-data" in text
    assert "--rollout-top-k" in text and "NOTE for slime / veRL users" in text
