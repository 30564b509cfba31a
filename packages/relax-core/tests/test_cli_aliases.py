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


# -- the slime flags slime users type most (issue #35: each got a misleading hint, or none) ----------------


def test_use_wandb_goes_with_a_project_and_is_refused_without_one(tmp_path):
    cfg = build_config(argv=["--use-wandb", "--wandb-project", "grpo"])
    assert cfg.run.wandb_project == "grpo"
    assert build_config(argv=["--wandb-project", "grpo", "--use-wandb", "true"]) == cfg
    with pytest.raises(ConfigError, match=r"--use-wandb: W&B logging is on here when --wandb-project NAME"):
        build_config(argv=["--use-wandb"])
    assert build_config(argv=["--no-use-wandb"]) == build_config(argv=[])  # off: nothing asked for
    path = tmp_path / "cfg.yaml"
    path.write_text("use_wandb: true\nwandb_project: grpo\n")
    assert build_config(path) == cfg
    path.write_text("use_wandb: true\n")
    with pytest.raises(ConfigError, match="add --wandb-project "):
        build_config(path)


def test_use_tis_is_token_level_truncation_at_tis_clip():
    cfg = build_config(argv=["--use-tis", "--tis-clip", "3"])
    assert (cfg.algo.tis_mode, cfg.algo.tis_cap) == ("token_truncate", 3.0)  # slime's vanilla TIS
    assert build_config(argv=["--use-tis", "false"]).algo.tis_mode == "none"
    assert build_config(argv=["--tis-clip-low", "0", "--use-tis"]).algo.tis_mode == "token_truncate"
    with pytest.raises(ConfigError, match="--tis-clip-low 0.5: no equivalent in relax; .*--tis-cap"):
        build_config(argv=["--tis-clip-low", "0.5"])
    with pytest.raises(ConfigError, match="--use-tis 'token_truncate' and --tis-mode 'token_mask'"):
        build_config(argv=["--use-tis", "--tis-mode", "token_mask"])


@pytest.mark.parametrize(
    ("theirs", "ours"), [("low_var_kl", "k3"), ("k3", "k3"), ("k2", "k2"), ("mse", "k2")]
)
def test_kl_loss_type_is_the_kl_estimator(theirs, ours):
    cfg = build_config(argv=["--kl-loss-coef", "0.01", "--kl-loss-type", theirs])
    assert (cfg.algo.kl_coef, cfg.algo.kl_estimator) == (0.01, ours)


def test_kl_loss_type_k1_as_a_loss_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="k1's expected gradient is zero"):
        build_config(argv=["--kl-loss-coef", "0.01", "--kl-loss-type", "k1"])


def test_rollout_stop_takes_several_strings_like_slimes():
    cfg = build_config(argv=["--rollout-stop", "</answer>", "###", "--lr", "1e-6"])
    assert cfg.rollout.rollout_stop == ["</answer>", "###"] and cfg.train.lr == 1e-6
    assert build_config(argv=["--rollout-stop", "42"]).rollout.rollout_stop == ["42"]  # (text, not a number)
    assert build_config(argv=['--rollout-stop=["a", "--b"]']).rollout.rollout_stop == ["a", "--b"]
    assert build_config(argv=["--rollout-stop-token-ids", "7", "8"]).rollout.rollout_stop_token_ids == [7, 8]
    with pytest.raises(ConfigError, match="--rollout-stop-token-ids: token ids are integers"):
        build_config(argv=["--rollout-stop-token-ids", "eos"])
    with pytest.raises(ConfigError, match="--rollout-stop: an empty stop string"):
        build_config(argv=["--rollout-stop", ""])


def test_learning_rate_and_model_path_are_lr_and_hf_checkpoint(tmp_path):
    cfg = build_config(
        argv=["--learning-rate", "3e-6", "--model-path", "/models/qwen3", "--prompt-data", "p"]
    )
    assert (cfg.train.lr, cfg.model.hf_checkpoint) == (3e-6, "/models/qwen3")
    with pytest.raises(ConfigError, match="--hf-checkpoint '/a' and --model-path '/b' set the same thing"):
        build_config(argv=["--hf-checkpoint", "/a", "--model-path", "/b"])
    path = tmp_path / "cfg.yaml"
    path.write_text("learning_rate: 2.0e-6\n")
    assert build_config(path).train.lr == 2e-6


@pytest.mark.parametrize(
    ("typed", "hint"),
    [
        ("--use-wandbb", "--use-wandb"),  # was --use-actor-fwd
        ("--use-tiss", "--use-tis"),  # was --use-kl-loss
        ("--kl-loss-typ", "--kl-loss-type"),  # was --kl-loss-coef
        ("--rollout-stp", "--rollout-stop"),  # was --rollout-top-p
        ("--model-pth", "--model-path"),  # was --sglang-model-path
        ("--learning-rat", "--learning-rate"),  # was no hint
        ("--wandb-projct", "--wandb-project"),
    ],
)
def test_a_mistyped_slime_flag_is_hinted_the_slime_name(typed, hint):
    with pytest.raises(ConfigError, match=f"unknown flag {typed} \\(did you mean {hint}\\?\\)"):
        build_config(argv=[typed, "1"])


def test_slime_flags_with_nothing_to_do_here_say_what_instead():
    assert build_config(argv=["--optimizer", "adam", "--lr-decay-style", "constant"]) == build_config(argv=[])
    with pytest.raises(ConfigError, match="--num-epoch 3: no equivalent in relax; give the number of steps"):
        build_config(argv=["--num-epoch", "3"])
    with pytest.raises(
        ConfigError, match="--wandb-key 'k': no equivalent in relax; log in once with `wandb login`"
    ):
        build_config(argv=["--wandb-key", "k"])


def test_help_lists_the_slime_switches():
    text = help_text(width=100)
    assert "--tis-mode / --use-tis" in text and "--use-wandb accepted with --wandb-project" in text
    assert "--kl-loss-type = --kl-estimator; low_var_kl = k3" in text
