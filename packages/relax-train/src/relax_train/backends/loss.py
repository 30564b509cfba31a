"""The policy loss of a micro-batch and the statistics of an optimizer step, shared by both backends.

Why apart: the torch and megatron backends must optimise the same objective and report the same metrics;
only their forward and their gradient reductions differ. Each holds a :class:`PolicyLoss` (built from the run
config) and calls it on the response log-probs its forward produced, instead of the megatron backend
inheriting the torch backend's methods.

Per micro-batch: the chosen policy loss against the proximal policy (ActorFwd's log-probs, the training
forward's own, or the rollout's), times the behaviour weight (decoupled PPO / TIS) if on, plus β·KL if the KL
is a loss, plus distillation, aggregated with the optimizer batch's token and sequence counts, so
accumulating micro-batches gives exactly the full-batch gradient. Entropy is a token-mean bonus on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from relax_core.config import RelaxConfig
from relax_core.config_sections import AlgoConfig
from relax_core.sample import (
    ADVANTAGES,
    LOG_PROBS,
    LOSS_MASK,
    PROX_FROM_FORWARD,
    REF_LOG_PROBS,
    ROLLOUT_LOG_PROBS,
    TEACHER_LOG_PROBS,
    TrainBatch,
    columns,
)
from relax_train.algorithms.aggregation import aggregate_loss, entropy_bonus
from relax_train.algorithms.correction import mismatch_metrics, truncated_is_weights
from relax_train.algorithms.losses import POLICY_LOSSES, LossParams, kl_penalty, loss_kl_estimator
from relax_train.backends.logprobs import padded_field


def loss_params(a: AlgoConfig) -> LossParams:
    """The policy losses' clipping and shaping parameters from the run's ``--eps-clip`` etc."""
    return LossParams(
        eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high,
        clip_ratio_c=a.eps_clip_c,
        tau_pos=a.sapo_tau_pos,
        tau_neg=a.sapo_tau_neg,
        cispo_ratio_max=a.cispo_ratio_max,
    )


@dataclass
class StepStats:
    """What one train_step's micro-batches share: the loss choices for this batch (from the fields its
    samples carry) and the statistics they add up."""

    loss_fn: Any
    params: LossParams
    old_key: str | None
    """The field the ratio's denominator comes from; None: the training forward's own log-probs (π_prox
    of a batch trained in one optimizer step)."""
    has_prox: bool
    has_behav: bool
    kl_loss: bool
    distill: str | None
    with_entropy: bool
    first_step: bool = True
    """Whether the micro-batches now running belong to the batch's first optimizer step (whose forward runs
    with π_prox's weights: ``train/prox_gap_max`` is measured there)."""
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)  # fractions of tokens: clipped, dual-clipped, ...
    keep: dict[str, list[torch.Tensor]] = field(default_factory=dict)


class PolicyLoss:
    """The loss of the run's ``--policy-loss`` and friends (``cfg.algo``) on one micro-batch at a time."""

    def __init__(self, cfg: RelaxConfig) -> None:
        self.algo = cfg.algo
        self.max_response_len = cfg.rollout.rollout_max_response_len

    def start(self, samples: TrainBatch) -> StepStats:
        """The statistics of a step over ``samples`` (whose fields choose the loss's terms), all zero."""
        a = self.algo
        # π_prox: ActorFwd's log-probs, or (``prox_from_forward``) the training forward's own, or both
        has_prox = LOG_PROBS in samples or PROX_FROM_FORWARD in samples
        distill = a.distill_mode if TEACHER_LOG_PROBS in samples else None
        stats = StepStats(
            loss_fn=POLICY_LOSSES[a.policy_loss],
            params=loss_params(a),
            old_key=LOG_PROBS if LOG_PROBS in samples else None if has_prox else ROLLOUT_LOG_PROBS,
            has_prox=has_prox,
            has_behav=ROLLOUT_LOG_PROBS in samples,
            kl_loss=a.uses_reference and a.use_kl_loss and REF_LOG_PROBS in samples,
            distill=distill,
            with_entropy=a.entropy_coef > 0,
            sums={"pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "tokens": 0.0},
            keep={"ratio": [], "train": [], "rollout": [], "tis": [], "prox_gap": []},
        )
        if distill:
            stats.sums["distill_kl"] = 0.0
        return stats

    def behaviour_weights(
        self, prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor | None:
        """π_prox / π_behaviour per token ([B, T]) or per response ([B, 1]); None when no correction is on."""
        a = self.algo
        if a.tis_mode == "none":
            if not a.decoupled_ppo:
                return None
            return truncated_is_weights(prox, behav, mask, "token", "mask", None, None)  # untruncated
        level, mode = a.tis_mode.split("_")
        return truncated_is_weights(prox, behav, mask, level, mode, None, a.tis_cap)

    def micro_loss(
        self, samples: TrainBatch, idx, logp, valid, ent, total_tokens: float, n_seqs: int, stats: StepStats
    ) -> torch.Tensor:
        """The loss of one micro-batch (a summand of the optimizer batch's loss) from its response-token
        log-probs; its statistics are added to ``stats``."""
        a = self.algo
        width, dev = logp.shape[1], logp.device

        def padded(key: str) -> torch.Tensor:
            return padded_field(columns(samples)[key], idx, width).to(dev)

        if stats.old_key is None:  # π_prox is the weights this forward runs with, for every sample
            old = logp.detach()
        else:
            old = padded(stats.old_key)
            if PROX_FROM_FORWARD in samples:  # ... for these samples (see relax_train.roles.prox)
                live = torch.tensor([bool(samples[PROX_FROM_FORWARD][i]) for i in idx], device=dev)
                old = torch.where(live[:, None], logp.detach(), old)
        behav = padded(ROLLOUT_LOG_PROBS) if stats.has_behav else old
        adv = padded(ADVANTAGES)
        lmask = padded(LOSS_MASK) * valid
        sums, counts, keep = stats.sums, stats.counts, stats.keep
        if stats.has_prox and stats.first_step and lmask.numel():  # π_θ is π_prox here by definition: a
            # gap is a stale π_prox (a micro-batch of empty responses has no token to take a max over)
            keep["prox_gap"].append(((old - logp.detach()).abs() * lmask).max().reshape(1).cpu())
        if stats.distill:  # on-policy distillation: reverse KL to the teacher on the student's own tokens
            teacher = padded(TEACHER_LOG_PROBS)
            sums["distill_kl"] += float(((old - teacher) * lmask).sum())  # k1 estimate
            if stats.distill == "advantage":  # per-token reward log π_T − log π_old (no gradient)
                adv = adv + a.distill_coef * (teacher - old)
        pg, st = stats.loss_fn(logp, old, adv, lmask, stats.params)
        tok_loss = pg
        w = self.behaviour_weights(old, behav, lmask) if stats.has_prox and stats.has_behav else None
        if w is not None:
            tok_loss = tok_loss * w
            keep["tis"].append(w.expand_as(logp)[lmask.bool()].cpu())
        if stats.kl_loss:
            kl = kl_penalty(logp, padded(REF_LOG_PROBS), loss_kl_estimator(a))
            tok_loss = tok_loss + a.kl_coef * kl
            sums["kl"] += float((kl.detach() * lmask).sum())
        if stats.distill == "loss":
            tok_loss = tok_loss + a.distill_coef * kl_penalty(
                logp, teacher, loss_kl_estimator(a, distill=True)
            )
        loss = aggregate_loss(
            tok_loss,
            lmask,
            a.loss_agg_mode,
            global_tokens=total_tokens,
            global_seqs=n_seqs,
            max_len=self.max_response_len,
        )
        if ent is not None:
            loss = loss + entropy_bonus(ent, lmask, a.entropy_coef, total_tokens=total_tokens)
            sums["entropy"] += float((ent.detach() * lmask).sum())
        sel = lmask.bool()
        sums["pg_loss"] += float((pg.detach() * lmask).sum())
        sums["tokens"] += float(lmask.sum())
        for key in ("clipped", "dual_clipped", "gate"):
            if key in st:
                counts[key] = counts.get(key, 0.0) + float((st[key] * lmask).sum())
        if a.policy_loss in ("ppo", "gspo"):
            high = a.eps_clip if a.eps_clip_high is None else a.eps_clip_high
            r = st["ratio"]
            low_c = ((r < 1.0 - a.eps_clip) & (adv < 0)).float()
            high_c = ((r > 1.0 + high) & (adv > 0)).float()
            counts["clipped_low"] = counts.get("clipped_low", 0.0) + float((low_c * lmask).sum())
            counts["clipped_high"] = counts.get("clipped_high", 0.0) + float((high_c * lmask).sum())
        keep["ratio"].append(st["ratio"][sel].detach().cpu())
        if stats.has_behav:  # the rollout-vs-trainer gap: π_prox (the trainer's policy the batch is clipped
            # against; π_θ moves with each optimizer step of the batch) against the rollout's
            keep["train"].append((old if stats.has_prox else logp.detach())[sel].cpu())
            keep["rollout"].append(behav[sel].cpu())
        return loss


_COUNT_NAMES = {
    "clipped": "clipfrac",
    "dual_clipped": "dual_clipfrac",
    "gate": "sapo_gate_mean",
    "clipped_low": "clipfrac_low",
    "clipped_high": "clipfrac_high",
}


def step_metrics(sums, counts, keep, loss_total, grad_norm, n_opt) -> dict[str, float]:
    """A step's metrics from its statistics (``sums``, ``counts``, ``keep`` of :class:`StepStats`; ``sums``
    loses its ``tokens``), summed loss and gradient norm over ``n_opt`` optimizer steps."""
    tokens = sums.pop("tokens") or 1.0
    metrics = {k: v / tokens for k, v in sums.items()}
    metrics.update({_COUNT_NAMES[k]: v / tokens for k, v in counts.items()})
    metrics["loss"] = loss_total / max(n_opt, 1)
    metrics["grad_norm"] = grad_norm / max(n_opt, 1)
    metrics["optimizer_steps"] = float(n_opt)
    ratio = torch.cat(keep["ratio"]) if keep["ratio"] else torch.ones(1)
    if ratio.numel():
        metrics.update(
            ratio_mean=float(ratio.mean()),
            ratio_min=float(ratio.min()),
            ratio_max=float(ratio.max()),
            ratio_std=float(ratio.std()) if ratio.numel() > 1 else 0.0,
        )
    train = torch.cat(keep["train"]) if keep["train"] else torch.empty(0)
    if train.numel():  # (none: every response of the step was empty)
        rollout = torch.cat(keep["rollout"])
        mm = mismatch_metrics(train, rollout, torch.ones_like(train, dtype=torch.bool))
        metrics.update({"rollout_" + k.removeprefix("mismatch/"): v for k, v in mm.items()})
    if keep["prox_gap"]:
        metrics["prox_gap_max"] = float(torch.cat(keep["prox_gap"]).max())
    if keep["tis"]:
        w = torch.cat(keep["tis"])
        if w.numel():
            metrics.update(
                tis_weight_mean=float(w.mean()),
                tis_weight_min=float(w.min()),
                tis_weight_max=float(w.max()),
                tis_zero_frac=float((w == 0).float().mean()),
            )
    return metrics
