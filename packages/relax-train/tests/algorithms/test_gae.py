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
