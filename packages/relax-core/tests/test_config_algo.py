"""The algorithm flags (policy loss, aggregation, KL, dual-clip, SAPO, TIS, decoupled PPO, dynamic sampling):
defaults keep GRPO PPO-clip token-mean, and every invalid value names its flag."""

import pytest

from relax_app.cli_config import ConfigError, build_config
from relax_core.config import RelaxConfig
from relax_core.config_sections import AlgoConfig


def test_defaults_are_grpo_ppo_clip_token_mean():
    a = RelaxConfig().algo
    assert (a.advantage_estimator, a.policy_loss, a.loss_agg_mode) == ("grpo", "ppo", "token-mean")
    assert (a.kl_estimator, a.use_kl_loss, a.kl_in_reward, a.eps_clip_c) == (None, True, False, None)
    assert (a.kl_loss_estimator, a.kl_reward_estimator) == ("k3", "k1")
    assert (a.tis_mode, a.decoupled_ppo) == ("none", False)
    assert not RelaxConfig().rollout.dynamic_sampling
    assert not a.uses_reference


def test_every_algo_field_is_documented():
    for name, f in AlgoConfig.model_fields.items():
        assert f.description, name


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--policy-loss", "trpo"], "--policy-loss"),
        (["--loss-agg-mode", "sum"], "--loss-agg-mode"),
        (["--kl-estimator", "k4"], "--kl-estimator"),
        (["--eps-clip-c", "1.0"], "--eps-clip-c"),
        (["--eps-clip-high", "0"], "--eps-clip-high"),
        (["--sapo-tau-pos", "0"], "--sapo-tau-pos"),
        (["--sapo-tau-neg", "-1"], "--sapo-tau-neg"),
        (["--cispo-ratio-max", "0"], "--cispo-ratio-max"),
        (["--tis-mode", "token"], "--tis-mode"),
        (["--tis-cap", "0"], "--tis-cap"),
        (["--dynamic-sampling-max-rounds", "0"], "--dynamic-sampling-max-rounds"),
    ],
)
def test_invalid_algo_value_names_its_flag(argv, flag):
    with pytest.raises(ConfigError) as exc:
        build_config(argv=argv)
    assert flag in str(exc.value) and argv[1] in str(exc.value)


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["--kl-coef", "0.1", "--kl-in-reward"], ["--kl-in-reward", "--use-kl-loss"]),
        (["--tis-mode", "token_mask", "--no-use-actor-fwd"], ["--tis-mode token_mask", "--use-actor-fwd"]),
        (["--decoupled-ppo", "--no-use-actor-fwd"], ["--decoupled-ppo", "--use-actor-fwd"]),
        (
            ["--dynamic-sampling", "--n-samples-per-prompt", "1"],
            ["--dynamic-sampling", "--n-samples-per-prompt"],
        ),
    ],
)
def test_inconsistent_combinations_name_the_flags(argv, flags):
    with pytest.raises(ConfigError) as exc:
        build_config(argv=argv)
    for f in flags:
        assert f in str(exc.value)


def test_valid_algo_flags_parse():
    cfg = build_config(
        argv=[
            "--policy-loss",
            "gspo",
            "--loss-agg-mode",
            "seq-mean-token-mean",
            "--eps-clip",
            "3e-4",
            "--eps-clip-high",
            "4e-4",
            "--eps-clip-c",
            "3",
            "--kl-coef",
            "0.05",
            "--kl-estimator",
            "k1",
            "--kl-in-reward",
            "--no-use-kl-loss",
            "--tis-mode",
            "sequence_truncate",
            "--tis-cap",
            "3",
            "--decoupled-ppo",
            "--sapo-tau-pos",
            "2",
            "--sapo-tau-neg",
            "2.5",
            "--dynamic-sampling",
            "--dynamic-sampling-max-rounds",
            "3",
        ]
    )
    a = cfg.algo
    assert (a.policy_loss, a.loss_agg_mode, a.eps_clip, a.eps_clip_high, a.eps_clip_c) == (
        "gspo",
        "seq-mean-token-mean",
        3e-4,
        4e-4,
        3.0,
    )
    assert (a.kl_estimator, a.kl_in_reward, a.use_kl_loss, a.uses_reference) == ("k1", True, False, True)
    assert (a.tis_mode, a.tis_cap, a.decoupled_ppo, a.sapo_tau_pos, a.sapo_tau_neg) == (
        "sequence_truncate",
        3.0,
        True,
        2.0,
        2.5,
    )
    assert cfg.rollout.dynamic_sampling and cfg.rollout.dynamic_sampling_max_rounds == 3


def test_policy_loss_choices_match_the_relax_train_registry():
    losses = pytest.importorskip("relax_train.algorithms.losses")
    from typing import get_args

    assert set(get_args(AlgoConfig.model_fields["policy_loss"].annotation)) == set(losses.POLICY_LOSSES)
    kl = set(get_args(get_args(AlgoConfig.model_fields["kl_estimator"].annotation)[0]))  # (Literal | None)
    assert kl and kl <= set(losses.KL_ESTIMATORS)
    agg = pytest.importorskip("relax_train.algorithms.aggregation")
    assert set(get_args(AlgoConfig.model_fields["loss_agg_mode"].annotation)) == set(agg.LOSS_AGG_MODES)


def test_gspo_takes_its_paper_settings_unless_given():
    a = build_config(None, ["--policy-loss", "gspo"]).algo
    assert (a.eps_clip, a.eps_clip_high, a.loss_agg_mode) == (3e-4, 4e-4, "seq-mean-token-mean")
    a = build_config(
        None, ["--policy-loss", "gspo", "--eps-clip", "1e-3", "--loss-agg-mode", "token-mean"]
    ).algo
    assert (a.eps_clip, a.eps_clip_high, a.loss_agg_mode) == (1e-3, None, "token-mean")  # (high = eps-clip)
    a = build_config(None, ["--policy-loss", "ppo"]).algo
    assert (a.eps_clip, a.eps_clip_high, a.loss_agg_mode) == (0.2, None, "token-mean")
    a = build_config(None, ["--policy-loss", "sapo"]).algo  # SAPO's objective: a mean per response
    assert (a.loss_agg_mode, a.sapo_tau_pos, a.sapo_tau_neg) == ("seq-mean-token-mean", 1.0, 1.05)
