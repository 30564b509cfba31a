"""Generalised advantage estimation (GAE) over one response's tokens, for PPO with a learned critic.

Why per response and over the model's tokens only: a multi-turn response interleaves the model's tokens
(``loss_mask`` 1) with the environment's (0). The environment's tokens are no actions: they carry no value
target, and they must not break the recursion either — the next state of a model token is the next *model*
token, however many observation tokens lie between (veRL's multi-turn GAE carries the next value and the
running advantage across masked positions the same way). Discounting runs over the model's tokens: γ is
applied once per action, not per observation token. A reward placed on an environment token is not an
action's and is left out (put token-level rewards on model tokens: the outcome reward on the last one, a
KL penalty on each).

Source: Schulman et al. 2016, *High-Dimensional Continuous Control Using Generalized Advantage Estimation*
(arXiv:1506.02438), Eq. 16: Â_t = Σ_l (γλ)^l δ_{t+l}, δ_t = r_t + γ V(s_{t+1}) − V(s_t); returns
Â_t + V(s_t) are the critic's targets (Ouyang et al. 2022 / veRL / OpenRLHF use the same).
"""

from __future__ import annotations

import numpy as np

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.sample import TrainBatch
from relax_train.algorithms.kl_reward import token_kl


def gae(
    rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float = 1.0, lam: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) of one response, float32, one per response token; 0 on the environment's
    tokens (``mask`` 0). ``rewards``, ``values``: per response token; the value after the last model token
    is 0 (the episode ends with the response).

    >>> a, r = gae(np.array([0.0, 0.0, 1.0]), np.array([0.5, 0.5, 0.5]), np.array([1, 0, 1]), 1.0, 1.0)
    >>> a.tolist(), r.tolist()
    ([0.5, 0.0, 0.5], [1.0, 0.0, 1.0])
    """
    r = np.asarray(rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    m = np.asarray(mask).astype(bool)
    if not (len(r) == len(v) == len(m)):
        raise ValueError(f"gae: rewards, values and mask differ in length ({len(r)}, {len(v)}, {len(m)})")
    adv = np.zeros_like(v)
    next_value, running = 0.0, 0.0
    for t in range(len(v) - 1, -1, -1):
        if not m[t]:
            continue  # an observation token: the recursion goes on from the next model token
        delta = r[t] + gamma * next_value - v[t]
        running = delta + gamma * lam * running
        adv[t] = running
        next_value = v[t]
    returns = np.where(m, adv + v, 0.0)
    return adv.astype(np.float32), returns.astype(np.float32)


def token_rewards(
    reward: float, mask: np.ndarray, kl: np.ndarray | None = None, beta: float = 0.0
) -> np.ndarray:
    """One response's per-token rewards for GAE: the outcome ``reward`` on its last model token (``mask``
    1), minus ``beta`` · ``kl`` on each model token when the KL is in the reward (InstructGPT Eq. 2; veRL's
    token_level_rewards = scores − β·kl). The environment's tokens get 0.

    >>> token_rewards(1.0, np.array([1, 1, 0]), np.array([0.1, 0.2, 0.3]), 0.5).round(3).tolist()
    [-0.05, 0.9, 0.0]
    """
    m = np.asarray(mask) > 0
    out = np.zeros(len(m), dtype=np.float64)
    if kl is not None and beta:
        out -= beta * np.where(m, np.asarray(kl, dtype=np.float64)[: len(m)], 0.0)
    model = np.flatnonzero(m)
    if len(model):
        out[model[-1]] += float(reward)
    return out


def gae_batch(
    rewards: list[np.ndarray],
    values: list[np.ndarray],
    masks: list[np.ndarray],
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """:func:`gae` of every response of a batch: (advantages, returns), one array per response. Not
    whitened: the trainer whitens the advantages over the batch it trains on (its model tokens), as veRL's
    masked_whiten does after GAE."""
    out = [gae(r, v, m, gamma, lam) for r, v, m in zip(rewards, values, masks)]
    return [a for a, _ in out], [r for _, r in out]


def gae_fields(cfg: RelaxConfig, d: TrainBatch, values: list[np.ndarray]) -> tuple[list, list]:
    """(advantages, returns) of a batch ``d`` under the critic's ``values``: GAE (γ = --gamma, λ = --lambd)
    over each response's model tokens, on token-level rewards (the outcome reward on the last model token,
    −β·kl_t on each with --kl-in-reward). The Critic computes its training targets and the Advantages
    role the advantages with this one function, so both see the same returns."""
    a, masks = cfg.algo, d[sample.LOSS_MASK]
    kl_on = a.uses_reference and a.kl_in_reward
    rewards = [
        token_rewards(
            float(r),
            np.asarray(m)[: len(v)],
            token_kl(d[sample.ROLLOUT_LOG_PROBS][i], d[sample.REF_LOG_PROBS][i], a.kl_reward_estimator, m)
            if kl_on
            else None,
            a.kl_coef if kl_on else 0.0,
        )
        for i, (r, m, v) in enumerate(zip(d[sample.REWARD], masks, values))
    ]
    return gae_batch(
        rewards,
        values,
        [np.asarray(m)[: len(v)] for m, v in zip(masks, values)],
        cfg.critic.gamma,
        cfg.critic.lambd,
    )
