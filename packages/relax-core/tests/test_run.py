"""What the run's console shows: the progress bar's figures per step (the critic's fit with PPO)."""

from __future__ import annotations

import io

from tqdm import tqdm

from relax_core.run import bar_update


def test_the_bar_shows_the_reward_and_with_a_critic_its_fit():
    out = io.StringIO()
    bar = tqdm(total=2, file=out, mininterval=0)
    bar_update(bar, {"rollout/reward_mean": 0.25})
    assert "reward=0.250" in out.getvalue() and "value_loss" not in out.getvalue()
    ppo = {"rollout/reward_mean": 0.5, "critic/value_loss": 0.1234, "critic/explained_variance": 0.4567}
    bar_update(bar, ppo)
    bar.close()
    assert "value_loss=0.123" in out.getvalue() and "ev=0.46" in out.getvalue()
