"""The Advantages role, and the KL-shaped rewards it computes advantages from (GAE's too: :func:`gae_fields`).

CPU only and torch-free (numpy, like the estimators in ``relax_train.algorithms``): it takes whole groups
from the bus, since a group-normalised advantage needs every response of its prompt, and writes per-token
advantages back. REINFORCE++'s batch whitening is left to the trainer, which sees the batch it trains on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.role import Restart, RoleSpec
from relax_core.sample import ADVANTAGES, REF_LOG_PROBS, RETURNS, REWARD, VALUES
from relax_core.trace import Tracer
from relax_train.algorithms import compute_advantages
from relax_train.roles.base import _BusLoop

if TYPE_CHECKING:
    from relax_bus import Bus


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


def gae_fields(cfg: RelaxConfig, d: dict[str, Any], values: list[np.ndarray]) -> tuple[list, list]:
    """(advantages, returns) of a batch ``d`` under the critic's ``values``: GAE (γ = --gamma, λ = --lambd)
    over each response's model tokens, on token-level rewards (the outcome reward on the last model token,
    −β·kl_t on each with --kl-in-reward). The Critic computes its training targets and the Advantages
    role the advantages with this one function, so both see the same returns."""
    from relax_train.algorithms.gae import gae_batch, token_rewards

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


class AdvantagesWorker(_BusLoop):
    """Group-normalised advantages; CPU only, whole groups at a time."""

    phase = "advantages"

    @classmethod
    def spec(cls, cfg: RelaxConfig, name: str) -> RoleSpec:
        """Whole groups, as soon as they are scored; with the KL in the reward, once Reference's log-probs
        are there too (the KL counts the model's own tokens: ``loss_mask``, written with the sample); with
        GAE (--advantage-estimator gae), once the Critic's values are."""
        a = cfg.algo
        needs = (REWARD, REF_LOG_PROBS) if a.uses_reference and a.kl_in_reward else (REWARD,)
        writes: tuple[str, ...] = (ADVANTAGES,)
        if cfg.uses_critic:  # GAE: over the critic's values; the critic's targets too
            needs, writes = (*needs, VALUES), (ADVANTAGES, RETURNS)
        return RoleSpec(name, needs=needs, writes=writes, sampler="group", restart=(Restart.LEASES,))

    def __init__(self, cfg: RelaxConfig, bus: Bus) -> None:
        self.cfg, self.bus, self.consumer = cfg, bus, "advantages"
        self.tracer = Tracer("advantages", cfg.run.trace)
        self.batch_size = cfg.samples_per_rollout

    def handle(self, batch) -> None:
        d = batch.data
        a = self.cfg.algo
        if self.cfg.uses_critic:  # (whitened by the trainer over the batch it trains on, as REINFORCE++)
            adv, returns = gae_fields(self.cfg, d, d[sample.VALUES])
            self.bus.add_fields(batch.ids, {sample.ADVANTAGES: adv, sample.RETURNS: returns})
            return
        rewards = d[sample.REWARD]
        fields: dict[str, Any] = {}
        if a.uses_reference and a.kl_in_reward:
            rewards = kl_shaped_sequence_rewards(
                d[sample.REWARD],
                d[sample.ROLLOUT_LOG_PROBS],
                d[sample.REF_LOG_PROBS],
                a.kl_coef,
                a.kl_reward_estimator,
                d[sample.LOSS_MASK],
            )
            fields[sample.SHAPED_REWARD] = [float(r) for r in rewards]
        # (REINFORCE++'s whitening spans the trained batch: the trainer does it, see ActorWorker.train)
        fields[sample.ADVANTAGES] = compute_advantages(
            a.advantage_estimator,
            d[sample.GROUP_ID],
            rewards,
            d[sample.RESPONSE_LEN],
            a.normalize_advantages_std,
            batch_step=False,
        )
        self.bus.add_fields(batch.ids, fields)

    def close(self) -> None:
        """Nothing to release (no model, no weight broadcast)."""
