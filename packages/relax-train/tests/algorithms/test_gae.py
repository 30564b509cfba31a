"""GAE (#39, point 2) against the references' formulas, written out here (their formulas, not their code):
veRL's ``compute_gae_advantage_return`` with its response mask (masked positions carry the next value and
the running advantage), and OpenRLHF's ``get_advantages_and_returns`` (values and rewards masked, the loop
over every position) on single-turn responses, where the two agree. Random batches, to 1e-6."""

from __future__ import annotations

import numpy as np
import pytest

from relax_train.algorithms.gae import gae


def verl_masked_gae(rewards, values, mask, gamma, lam):
    """veRL's recursion over a padded batch [B, T], masked positions carried through."""
    b, t_len = values.shape
    adv = np.zeros_like(values)
    nextvalues = np.zeros(b)
    lastgaelam = np.zeros(b)
    for t in reversed(range(t_len)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        adv[:, t] = lastgaelam
    return adv, adv + values


def openrlhf_gae(rewards, values, action_mask, gamma, lam):
    """OpenRLHF's: values and rewards masked, then the plain reversed loop over every position."""
    values, rewards = values * action_mask, rewards * action_mask
    t_len = values.shape[1]
    lastgaelam = 0.0
    out = []
    for t in reversed(range(t_len)):
        nextvalues = values[:, t + 1] if t < t_len - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        out.append(lastgaelam)
    adv = np.stack(out[::-1], axis=1)
    return adv, adv + values


def _batch(rng, multi_turn: bool, b: int = 16, t_len: int = 24):
    lens = rng.integers(1, t_len + 1, size=b)
    mask = np.zeros((b, t_len))
    for i, n in enumerate(lens):
        mask[i, :n] = 1
        if multi_turn:  # observation spans inside the response (never its first or last token)
            for _ in range(rng.integers(1, 4)):
                s = rng.integers(1, max(2, n - 1))
                mask[i, s : min(n - 1, s + rng.integers(1, 5))] = 0
    rewards = rng.normal(size=(b, t_len)) * mask  # token-level rewards (a KL term) on model tokens
    for i, n in enumerate(lens):
        rewards[i, n - 1] += rng.normal()  # the outcome reward on the last token
    values = rng.normal(size=(b, t_len)) * mask
    return lens, mask, rewards, values


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_gae_matches_the_references_on_random_batches(gamma, lam, multi_turn):
    rng = np.random.default_rng(int(gamma * 100 + lam * 10 + multi_turn))
    lens, mask, rewards, values = _batch(rng, multi_turn)
    want_adv, want_ret = verl_masked_gae(rewards, values, mask, gamma, lam)
    if not multi_turn:  # OpenRLHF's masks only pad: the same as veRL's there
        o_adv, o_ret = openrlhf_gae(rewards, values, mask, gamma, lam)
        np.testing.assert_allclose(o_adv * mask, want_adv * mask, atol=1e-9)
    for i, n in enumerate(lens):
        adv, ret = gae(rewards[i, :n], values[i, :n], mask[i, :n], gamma, lam)
        m = mask[i, :n].astype(bool)
        np.testing.assert_allclose(adv[m], want_adv[i, :n][m], atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(ret[m], want_ret[i, :n][m], atol=1e-6, rtol=1e-6)
        assert not adv[~m].any() and not ret[~m].any()  # observations: no target


def test_observation_tokens_do_not_discount_or_break_the_recursion():
    """Two model tokens with ten observation tokens between them: the first token's advantage is the same
    as with none between (γ applied once per action)."""
    tight = gae(np.array([0.0, 1.0]), np.array([0.2, 0.4]), np.array([1, 1]), 0.9, 0.8)[0]
    spread = gae(
        np.r_[0.0, np.zeros(10), 1.0], np.r_[0.2, np.zeros(10), 0.4], np.r_[1, np.zeros(10), 1], 0.9, 0.8
    )[0]
    assert spread[0] == pytest.approx(tight[0]) and spread[-1] == pytest.approx(tight[-1])


def test_mismatched_lengths_say_so():
    with pytest.raises(ValueError, match="differ in length"):
        gae(np.zeros(3), np.zeros(2), np.ones(3))


def verl_masked_whiten(values, mask):
    """veRL's masked_whiten (shift_mean): mean and unbiased variance over the masked positions."""
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = (((values - mean) ** 2) * mask).sum() / n * n / (n - 1)
    return (values - mean) / np.sqrt(var + 1e-8)


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_gae_advantages_are_whitened_over_the_batch_model_tokens_as_verl(multi_turn):
    """The trainer's batch step for gae (``finish_batch_advantages``) is veRL's masked whitening over the
    response mask: environment tokens of multi-turn responses take no part (and get 0)."""
    from relax_train.algorithms.advantages import finish_batch_advantages

    rng = np.random.default_rng(7 + multi_turn)
    lens, mask, rewards, values = _batch(rng, multi_turn)
    adv, _ = verl_masked_gae(rewards, values, mask, 0.99, 0.95)
    want = verl_masked_whiten(adv, mask)
    rows = [adv[i, :n].astype(np.float32) for i, n in enumerate(lens)]
    got = finish_batch_advantages("gae", rows, True, [mask[i, :n] for i, n in enumerate(lens)])
    for i, n in enumerate(lens):
        m = mask[i, :n].astype(bool)
        np.testing.assert_allclose(got[i][m], want[i, :n][m], atol=1e-5, rtol=1e-5)
        assert not got[i][~m].any()


def test_gae_fields_put_the_reward_on_the_last_model_token_and_the_kl_on_each():
    """The Advantages role's and the Critic's targets (``gae_fields``): with --kl-in-reward, token rewards
    are −β·kl_t on the model's tokens and the outcome reward on the last of them (veRL's
    token_level_rewards), then GAE; the Critic's returns are advantages + values."""
    from relax_core.config import RelaxConfig
    from relax_core.sample import LOSS_MASK, REF_LOG_PROBS, REWARD, ROLLOUT_LOG_PROBS
    from relax_train.algorithms.gae import gae_fields

    cfg = RelaxConfig(
        algo={"advantage_estimator": "gae", "kl_coef": 0.1, "kl_in_reward": True, "use_kl_loss": False},
        critic={"gamma": 0.9, "lambd": 0.8},
    )
    mask = np.array([1, 1, 0, 1], np.float32)  # a multi-turn response: one observation token
    lp, ref = np.array([-1.0, -2.0, 0.0, -1.0]), np.array([-1.5, -1.0, -3.0, -1.0])
    values = [np.array([0.1, 0.2, 0.0, 0.3], np.float32)]
    d = {REWARD: [1.0], LOSS_MASK: [mask], ROLLOUT_LOG_PROBS: [lp], REF_LOG_PROBS: [ref]}
    adv, ret = gae_fields(cfg, d, values)
    r = np.array([-0.1 * 0.5, -0.1 * -1.0, 0.0, 1.0])  # k1 = lp − ref on model tokens; reward on the last
    want_adv, want_ret = gae(r, values[0], mask, 0.9, 0.8)
    np.testing.assert_allclose(adv[0], want_adv, atol=1e-6)
    np.testing.assert_allclose(ret[0], want_ret, atol=1e-6)
    assert ret[0][2] == 0.0 and ret[0][3] == pytest.approx(1.0)  # the last token's return is its reward
