"""A KL penalty in the reward, from the behaviour (rollout) log-probs against the reference's: per token
(:func:`token_kl`, GAE's token-level rewards) or summed per response for the outcome-reward estimators
(:func:`kl_shaped_sequence_rewards`). numpy, like the estimators: the roles computing them need no torch.
"""

from __future__ import annotations

import numpy as np


def token_kl(rollout_logp, ref_logp, estimator: str, mask=None) -> np.ndarray:
    """Per-token KL of one response for a KL in the reward, from the behaviour (rollout) log-probs against
    the reference's, 0 off the model's own tokens (``mask`` 0: a multi-turn response's environment tokens
    were not sampled by the policy and have rollout log-prob 0).

    >>> token_kl(np.array([-1.0, -1.0]), np.array([-1.0, -2.0]), "k1").tolist()
    [0.0, 1.0]
    """
    d = np.asarray(rollout_logp, dtype=np.float64) - np.asarray(ref_logp, dtype=np.float64)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    elif estimator == "k3":
        e = np.clip(-d, -20.0, 20.0)
        kl = np.minimum(np.exp(e) - e - 1.0, 10.0)
    else:
        raise ValueError(f"unknown --kl-estimator {estimator!r}; available: ['k1', 'k2', 'k3']")
    if mask is not None:
        kl = kl * (np.asarray(mask, dtype=np.float64)[: len(kl)] > 0)
    return kl


def kl_shaped_sequence_rewards(
    rewards, rollout_logp, ref_logp, beta: float, estimator: str, loss_masks=None
) -> np.ndarray:
    """KL in the reward for outcome-reward estimators: r - β·Σ_t kl_t per response (:func:`token_kl`, over
    the model's own tokens). With outcome rewards, the return at every token of per-token shaped rewards
    (InstructGPT Eq. 2) summed to the end; here the whole response's sum, since the estimators work on one
    scalar per response. Use k1 (the config refuses others here): in a reward only its expectation is
    KL(π || π_ref). numpy, like the estimators: this role needs no torch.

    >>> kl_shaped_sequence_rewards([1.0], [np.array([-1.0, -1.0])], [np.array([-1.0, -2.0])], 0.5, "k1").tolist()
    [0.5]
    """
    out = np.asarray(rewards, dtype=np.float64).copy()
    masks = loss_masks if loss_masks is not None else [None] * len(out)
    for i, (lp, ref, mask) in enumerate(zip(rollout_logp, ref_logp, masks)):
        out[i] -= beta * float(token_kl(lp, ref, estimator, mask).sum())
    return out
