"""The Advantages role: advantages from the KL-shaped rewards (:mod:`relax_train.algorithms.kl_reward`) or GAE
(:func:`relax_train.algorithms.gae.gae_fields`).

CPU only and torch-free (numpy, like the estimators in ``relax_train.algorithms``): it takes whole groups
from the bus, since a group-normalised advantage needs every response of its prompt, and writes per-token
advantages back. REINFORCE++'s batch whitening is left to the trainer, which sees the batch it trains on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.role import Restart, RoleSpec
from relax_core.sample import ADVANTAGES, REF_LOG_PROBS, RETURNS, REWARD, VALUES, train_batch
from relax_core.trace import Tracer
from relax_train.algorithms import compute_advantages
from relax_train.algorithms.gae import gae_fields
from relax_train.algorithms.kl_reward import kl_shaped_sequence_rewards
from relax_train.roles.base import BusLoop

if TYPE_CHECKING:
    from relax_bus import Bus


class AdvantagesWorker(BusLoop):
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
        d = train_batch(batch.data)
        a = self.cfg.algo
        if self.cfg.uses_critic:  # (whitened by the trainer over the batch it trains on, as REINFORCE++)
            adv, returns = gae_fields(self.cfg, d, d[sample.VALUES])
            self.bus.add_fields(batch.ids, {sample.ADVANTAGES: adv, sample.RETURNS: returns})
            return
        rewards: Any = d[sample.REWARD]  # (per sample; KL-shaped below, an array)
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
