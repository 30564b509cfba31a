"""The Advantages role, and the KL-shaped rewards it computes advantages from.

CPU only and torch-free (numpy, like the estimators in ``relax_train.algorithms``): it takes whole groups
from the bus, since a group-normalised advantage needs every response of its prompt, and writes per-token
advantages back. REINFORCE++'s batch whitening is left to the trainer, which sees the batch it trains on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.role import Restart, RoleSpec
from relax_core.sample import ADVANTAGES, REF_LOG_PROBS, REWARD
from relax_core.trace import Tracer
from relax_train.algorithms import compute_advantages
from relax_train.roles.base import _BusLoop


def kl_shaped_sequence_rewards(
    rewards, rollout_logp, ref_logp, beta: float, estimator: str, loss_masks=None
) -> np.ndarray:
    """KL in the reward for outcome-reward estimators: r - β·Σ_t kl_t per response, kl_t estimated from the
    behaviour (rollout) log-probs against the reference, over the model's own tokens (``loss_masks`` 1; a
    multi-turn response's environment tokens were not sampled by the policy and have rollout log-prob 0).
    With outcome rewards, the return at every token of per-token shaped rewards (InstructGPT Eq. 2) summed
    to the end; here the whole response's sum, since the estimators work on one scalar per response. Use
    k1 (the config refuses others here): in a reward only its expectation is KL(π || π_ref). numpy, like
    the estimators: this role needs no torch.

    >>> kl_shaped_sequence_rewards([1.0], [np.array([-1.0, -1.0])], [np.array([-1.0, -2.0])], 0.5, "k1").tolist()
    [0.5]
    """
    out = np.asarray(rewards, dtype=np.float64).copy()
    masks = loss_masks if loss_masks is not None else [None] * len(out)
    for i, (lp, ref, mask) in enumerate(zip(rollout_logp, ref_logp, masks)):
        d = np.asarray(lp, dtype=np.float64) - np.asarray(ref, dtype=np.float64)
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
        out[i] -= beta * float(kl.sum())
    return out


class AdvantagesWorker(_BusLoop):
    """Group-normalised advantages; CPU only, whole groups at a time."""

    phase = "advantages"

    @classmethod
    def spec(cls, cfg: RelaxConfig, name: str) -> RoleSpec:
        """Whole groups, as soon as they are scored; with the KL in the reward, once Reference's log-probs
        are there too (the KL counts the model's own tokens: ``loss_mask``, written with the sample)."""
        a = cfg.algo
        needs = (REWARD, REF_LOG_PROBS) if a.uses_reference and a.kl_in_reward else (REWARD,)
        return RoleSpec(name, needs=needs, writes=(ADVANTAGES,), sampler="group", restart=(Restart.LEASES,))

    def __init__(self, cfg: RelaxConfig, bus: Any) -> None:
        self.cfg, self.bus, self.consumer = cfg, bus, "advantages"
        self.tracer = Tracer("advantages", cfg.run.trace)
        self.batch_size = cfg.samples_per_rollout

    def handle(self, batch) -> None:
        d = batch.data
        a = self.cfg.algo
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
