"""build_config: YAML (nested or flat) < command line, and every error names the flag to fix."""

import pytest

from relax_app.cli_config import (
    ConfigError,
    build_config,
    config_files,
    flag_index,
    help_text,
    parse_overrides,
)
from relax_core.config import RelaxConfig


def test_no_arguments_gives_defaults():
    assert build_config(argv=[]) == RelaxConfig()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--max-staleness", "-1"], "--max-staleness"),
        (["--rollout-batch-size", "0"], "--rollout-batch-size"),
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt"),
        (["--rollout-temperature", "0"], "--rollout-temperature"),
        (["--rollout-top-p", "1.5"], "--rollout-top-p"),
        (["--lr", "-1e-3"], "--lr"),
        (["--adam-beta1", "1.0"], "--adam-beta1"),
        (["--eps-clip", "0"], "--eps-clip"),
        (["--kl-coef", "-0.1"], "--kl-coef"),
        (["--micro-batch-size", "0"], "--micro-batch-size"),
        (["--mode", "sync"], "--mode"),
        (["--staleness-policy", "skip"], "--staleness-policy"),
        (["--rollout-backend", "vllm"], "--rollout-backend"),
        (["--dtype", "int8"], "--dtype"),
        (["--num-rollout", "many"], "--num-rollout"),
        (["--bus-capacity", "0"], "--bus-capacity"),
    ],
)
def test_invalid_value_names_its_flag(argv, flag):
    with pytest.raises(ConfigError) as exc:
        build_config(argv=argv)
    assert flag in str(exc.value)
    assert repr(argv[1]) in str(exc.value) or argv[1] in str(exc.value)


def test_staleness_with_colocate_rejected():
    with pytest.raises(ConfigError, match="--max-staleness"):
        build_config(argv=["--colocate", "--max-staleness", "1"])
    cfg = build_config(argv=["--fully-async", "--max-staleness", "1"])
    assert cfg.run.mode == "fully_async" and cfg.run.max_staleness == 1


def test_global_batch_must_divide():
    with pytest.raises(ConfigError, match="--global-batch-size"):
        build_config(
            argv=["--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--global-batch-size", "4"]
        )
    cfg = build_config(
        argv=["--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--global-batch-size", "3"]
    )
    assert cfg.train.global_batch_size == 3


def test_prompt_data_without_checkpoint_rejected():
    with pytest.raises(ConfigError, match="--hf-checkpoint"):
        build_config(argv=["--prompt-data", "train.jsonl"])


def test_mode_shorthands():
    assert build_config(argv=["--fully-async"]).run.mode == "fully_async"
    assert build_config(argv=["--fully-async", "--colocate"]).run.mode == "colocate"
    assert build_config(argv=["--mode", "fully_async"]).run.mode == "fully_async"


def test_boolean_flags():
    assert build_config(argv=["--no-tensorboard"]).run.tensorboard is False
    assert build_config(argv=["--tensorboard"]).run.tensorboard is True
    assert build_config(argv=["--tensorboard", "false"]).run.tensorboard is False
    assert build_config(argv=["--tensorboard=false"]).run.tensorboard is False
    cfg = build_config(argv=["--no-rollout-shuffle", "--apply-chat-template", "--lr", "1e-5"])
    assert cfg.data.rollout_shuffle is False
    assert cfg.data.apply_chat_template is True
    assert cfg.train.lr == pytest.approx(1e-5)


def test_flag_equals_value():
    cfg = build_config(
        argv=["--lr=0.001", "--rollout-batch-size=4", "--output-dir=/tmp/x", "--eps-clip-high=0.28"]
    )
    assert cfg.train.lr == pytest.approx(0.001)
    assert cfg.rollout.rollout_batch_size == 4
    assert cfg.run.output_dir == "/tmp/x"
    assert cfg.algo.eps_clip_high == pytest.approx(0.28)


def test_none_value_and_numeric_looking_strings():
    assert build_config(argv=["--eval-interval", "none"]).run.eval_interval is None
    # a string-typed flag keeps its text even when it looks like a number
    cfg = build_config(argv=["--output-dir", "2024", "--input-key", "1"])
    assert cfg.run.output_dir == "2024"
    assert cfg.data.input_key == "1"
    # "none" is None only where None is allowed; for a plain text flag it is the text (a reward's name)
    assert build_config(argv=["--rm-type", "none"]).rollout.rm_type == "none"
    assert build_config(argv=["--ref-checkpoint", "none"]).model.ref_checkpoint is None


def test_missing_value_names_flag():
    with pytest.raises(ConfigError, match="--lr"):
        parse_overrides(["--lr"])


def test_unknown_flag_rejected_with_name():
    with pytest.raises(ConfigError, match="--bogus-rate"):
        build_config(argv=["--bogus-rate", "1"])
    with pytest.raises(ConfigError, match="positional"):
        build_config(argv=["positional"])


def test_yaml_nested(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "train:\n  lr: 0.001\n  seed: 7\nrollout:\n  n_samples_per_prompt: 4\nrun:\n  tensorboard: false\n"
    )
    cfg = build_config(path)
    assert cfg.train.lr == pytest.approx(0.001)
    assert cfg.train.seed == 7
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.run.tensorboard is False


def test_yaml_flat_with_dashes_and_mode_shorthand(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("lr: 0.002\nmicro-batch-size: 4\nfully_async: true\nmax_staleness: 2\n")
    cfg = build_config(path)
    assert cfg.train.lr == pytest.approx(0.002)
    assert cfg.train.micro_batch_size == 4
    assert cfg.run.mode == "fully_async"
    assert cfg.run.max_staleness == 2


def test_cli_overrides_yaml(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  lr: 0.001\n  seed: 7\n")
    cfg = build_config(path, argv=["--lr", "0.5"])
    assert cfg.train.lr == pytest.approx(0.5)
    assert cfg.train.seed == 7


def test_defaults_lowest_priority(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("seed: 3\n")
    cfg = build_config(path, argv=["--num-rollout", "5"], defaults={"seed": 1, "num_rollout": 2, "lr": 0.25})
    assert (cfg.train.seed, cfg.train.num_rollout, cfg.train.lr) == (3, 5, 0.25)


def test_unknown_yaml_key_rejected_with_name(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  bogus_rate: 0.1\n")
    with pytest.raises(ConfigError, match="bogus_rate") as exc:
        build_config(path)
    assert str(path) in str(exc.value)
    path.write_text("bogus_key: 1\n")
    with pytest.raises(ConfigError, match="bogus_key"):
        build_config(path)


def test_yaml_invalid_value_names_flag(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("run:\n  max_staleness: -3\n")
    with pytest.raises(ConfigError, match="--max-staleness"):
        build_config(path)


def test_yaml_missing_or_not_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        build_config(tmp_path / "absent.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        build_config(path)


def test_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert build_config(path) == RelaxConfig()


def test_flag_names_are_unique_leaves():
    index = flag_index()
    n_fields = sum(len(info.annotation.model_fields) for info in RelaxConfig.model_fields.values())
    assert len(index) == n_fields
    assert index["max_staleness"] == ("run", "max_staleness")
    assert index["lr"] == ("train", "lr")


def test_help_text_lists_every_flag():
    text = help_text()
    for leaf in flag_index():
        assert "--" + leaf.replace("_", "-") in text, leaf
    assert "--colocate" in text and "--fully-async" in text
    # docstrings are shown
    assert "Staleness of a sample" in text


def test_offload_is_a_bare_flag_with_an_automatic_default_and_needs_colocate():
    assert build_config(argv=[]).run.offload is None  # on when CUDA is available
    assert build_config(argv=["--offload"]).run.offload is True
    assert build_config(argv=["--no-offload"]).run.offload is False
    with pytest.raises(ConfigError, match="--offload time-shares the devices .* drop --offload"):
        build_config(argv=["--fully-async", "--offload"])


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["--rollout-batchsize", "4"], "--rollout-batch-size"),
        (["--no-progres"], "--no-progress"),
        (["--kl-los-coef", "0.1"], "--kl-loss-coef"),  # slime's names are known too
        (["--fully-asnyc"], "--fully-async"),
    ],
)
def test_unknown_flag_suggests_the_closest(argv, suggestion):
    with pytest.raises(ConfigError, match=f"unknown flag {argv[0]} \\(did you mean {suggestion}\\?\\)"):
        build_config(argv=argv)


def test_unknown_yaml_key_suggests_the_closest(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  micro_batch_sise: 4\n")
    with pytest.raises(ConfigError, match="micro_batch_sise.*did you mean --micro-batch-size"):
        build_config(path)


def test_help_shows_no_pydantic_internals():
    text = help_text()
    assert "PydanticUndefined" not in text
    assert "--sglang-env" in text and "(default {})" in text  # a default_factory's value


# -- config files anywhere, overrides as key=value, every problem at once (#50) ---------------------------
def test_a_yaml_config_is_read_wherever_it_stands(tmp_path):
    """The Slurm script and the RayJob put it after --ray-address: it was refused (unexpected argument)."""
    (tmp_path / "a.yaml").write_text("lr: 0.001\nseed: 7\n")
    (tmp_path / "b.yaml").write_text("seed: 9\n")
    a, b = str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")
    cfg = build_config(argv=["--ray-address", "10.0.0.1:6379", a, "--num-rollout", "3"])
    assert cfg.run.ray_address == "10.0.0.1:6379" and cfg.train.lr == 0.001 and cfg.train.num_rollout == 3
    assert build_config(argv=[a, b]).train.seed == 9  # later files over earlier ones
    assert build_config(argv=["--config", a, "--seed", "1"]).train.seed == 1  # flags over files
    assert build_config(argv=[f"--config={b}", a]).train.seed == 7
    assert config_files(["--lr", "1", a, "--config", b, "--colocate"]) == [a, b]
    cfg = build_config(argv=["--rollout-stop", "</answer>", "###", a])  # (not a third stop string)
    assert cfg.rollout.rollout_stop == ["</answer>", "###"] and cfg.train.lr == 0.001


def test_key_value_overrides_ours_and_verls():
    cfg = build_config(
        argv=[
            "train.lr=1e-5",
            "seed=3",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "trainer.total_training_steps=7",
            "output_dir=2024",
        ]
    )
    assert cfg.train.lr == 1e-5 and cfg.train.seed == 3 and cfg.rollout.n_samples_per_prompt == 4
    assert cfg.algo.kl_estimator == "k3" and cfg.train.num_rollout == 7 and cfg.run.output_dir == "2024"
    # veRL's KL in the reward: ours with use_kl_in_reward, refused without it (veRL ignores it then)
    verl_reward_kl = [
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.kl_coef=0.001",
        "--no-use-kl-loss",
    ]
    cfg = build_config(argv=verl_reward_kl)
    assert cfg.algo.kl_in_reward and cfg.algo.kl_coef == 0.001
    with pytest.raises(ConfigError, match=r"veRL uses it only with algorithm.use_kl_in_reward=True"):
        build_config(argv=["algorithm.kl_ctrl.kl_coef=0.001"])


def test_every_problem_of_a_command_line_is_listed_at_once(tmp_path):
    (tmp_path / "c.yaml").write_text("lr: 1\nbogus_key: 2\n")
    with pytest.raises(ConfigError) as e:
        build_config(
            argv=[
                "--seq-lenght",
                "4096",
                str(tmp_path / "c.yaml"),
                "--rollout-top-k",
                "20",
                "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                "stray",
                "--lr",
            ]
        )
    lines = str(e.value).splitlines()
    assert lines[0] == "6 problems with the command line:"
    assert any(line.startswith("  unknown flag --seq-lenght (did you mean --seq-length?)") for line in lines)
    assert any("--rollout-top-k 20: no equivalent in relax" in line for line in lines)
    assert any(
        "ppo_mini_batch_size=8: no equivalent in relax; veRL counts it in prompts" in line for line in lines
    )
    assert any("unexpected argument 'stray'" in line for line in lines)
    assert any(line == "  --lr needs a value" for line in lines)
    assert any("c.yaml: unknown key 'bogus_key'" in line for line in lines)


# -- the command line on pydantic-settings (#50): what the hand-written parser got wrong ------------------
def test_the_parser_is_built_by_pydantic_settings_from_every_name():
    """Every leaf of the config and every name of slime's / veRL's tables is an option of the one parser
    pydantic-settings builds (on/off names as --x / --no-x), so no name is parsed by hand."""
    from pydantic_settings.sources.providers.cli import _CliInternalArgParser

    from relax_app import cli_aliases
    from relax_app.cli_flags import _parser, kinds

    parser = _parser()
    assert isinstance(parser, _CliInternalArgParser)
    options = set(parser._option_string_actions)
    for name in [*flag_index(), *cli_aliases.table_names()]:
        assert "--" + name.replace("_", "-") in options, name
    assert {"--use-kl-loss", "--no-use-kl-loss", "--config"} <= options
    assert kinds()["rollout_stop"] == "many" and kinds()["lr"] == "one" and kinds()["bf16"] == "switch"


def test_a_several_value_flag_stops_at_an_override_and_keeps_its_values_exact():
    """A key=value after --rollout-stop's strings was read as a third stop string; the strings themselves
    (a comma, quotes, "a, b") stay what was typed, where pydantic-settings' own list decoding splits them."""
    cfg = build_config(argv=["--rollout-stop", ",", '"q"', "a, b", "x=1", "lr=1e-3", "--seed", "4"])
    assert cfg.rollout.rollout_stop == [",", '"q"', "a, b", "x=1"]  # (x is no key of ours: a stop string)
    assert cfg.train.lr == 1e-3 and cfg.train.seed == 4
    with pytest.raises(ConfigError, match="unexpected argument 'b'"):  # (after --lr's value: not a stop)
        build_config(argv=["--rollout-stop", "a", "--lr", "1", "b"])


def test_values_and_names_as_other_clis_write_them():
    cfg = build_config(argv=["--learning_rate", "2e-5", "--use_kl_loss", "false", "--micro-batch-size=3"])
    assert cfg.train.lr == 2e-5 and cfg.algo.use_kl_loss is False and cfg.train.micro_batch_size == 3
    assert build_config(argv=["--output-dir", "--odd"]).run.output_dir == "--odd"  # (text takes any text)
    with pytest.raises(ConfigError, match="--lr: .*greater than 0 \\(got '-1e-3'\\)"):
        build_config(argv=["--lr", "-1e-3"])  # (argparse alone reads "-1e-3" as a flag)
    with pytest.raises(ConfigError, match="-h: give it alone"):
        build_config(argv=["--lr", "1e-5", "-h"])
