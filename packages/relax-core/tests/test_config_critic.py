"""The critic's config (#39): flags under veRL's and OpenRLHF's names, defaults that follow the trainer's,
and critic flags refused where no critic runs."""

from __future__ import annotations

import pytest

from relax_app.cli_config import build_config


def test_critic_flags_and_their_aliases_reach_the_config():
    cfg = build_config(
        None,
        [
            "--advantage-estimator", "gae",
            "--critic-learning-rate", "1e-4",
            "--lam", "0.95",
            "--gamma", "0.99",
            "--cliprange-value", "0.2",
            "--critic-ppo-epochs", "3",
            "--critic-warmup", "2",
            "--critic-model-path", "/some/critic",
        ],
    )  # fmt: skip
    c = cfg.critic
    assert (c.critic_lr, c.lambd, c.gamma, c.value_clip, c.critic_epochs, c.critic_warmup) == (
        1e-4, 0.95, 0.99, 0.2, 3, 2,
    )  # fmt: skip
    assert c.critic_checkpoint == "/some/critic" and cfg.uses_critic and cfg.critic_lr == 1e-4


def test_the_critic_follows_the_trainer_unless_told_otherwise():
    cfg = build_config(None, ["--advantage-estimator", "gae", "--lr", "3e-4", "--global-batch-size", "4"])
    assert cfg.critic_lr == 3e-4 and cfg.critic_global_batch_size == 4


@pytest.mark.parametrize("flag", [["--gamma", "0.9"], ["--critic-lr", "1e-3"], ["--critic-warmup", "1"]])
def test_critic_flags_without_a_critic_are_refused(flag):
    with pytest.raises(Exception, match="no critic runs.*--advantage-estimator gae"):
        build_config(None, flag)


def test_a_critic_on_multimodal_rows_is_refused_with_what_to_do():
    with pytest.raises(Exception, match="reads text only.*grpo"):
        build_config(None, ["--advantage-estimator", "gae", "--multimodal-keys", '{"image": "images"}'])
