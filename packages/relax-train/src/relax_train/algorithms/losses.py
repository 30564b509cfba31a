"""Policy losses and KL estimators on padded [batch, response_len] tensors.

Every loss returns the *per-token* loss and a dict of detached statistics; reducing it to a scalar is
:mod:`relax_train.algorithms.aggregation`'s job, so that gradient accumulation over micro-batches can
divide by global token / sequence counts and give exactly the full-batch gradient.

``logp`` is the trainer's log-prob of each response token (with gradient), ``old_logp`` the proximal
policy's (no gradient), ``advantages`` is per token (a sequence advantage broadcast over its tokens).
The losses in :data:`POLICY_LOSSES` share one signature, ``fn(logp, old_logp, advantages, mask, params)``;
the three older functions (:func:`ppo_clip_loss`, :func:`kl_k3`, :func:`entropy_from_logits`) keep the
signatures the torch backend calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Stats = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LossParams:
    """Knobs of the policy losses; each loss reads only its own."""

    eps_clip: float = 0.2
    """PPO / GSPO lower clip: ratio ≥ 1 - eps_clip."""
    eps_clip_high: float | None = None
    """Upper clip (DAPO's clip-higher); None means eps_clip."""
    clip_ratio_c: float | None = None
    """Dual-clip bound (> 1, typically 3) on the loss of negative-advantage tokens; None disables it."""
    tau_pos: float = 1.0
    """SAPO gate temperature for tokens with advantage > 0."""
    tau_neg: float = 1.05
    """SAPO gate temperature for tokens with advantage ≤ 0."""
    cispo_ratio_max: float = 5.0
    """CISPO: upper truncation of the IS weight (TRL's ``epsilon_high`` for cispo, ScaleRL's ε_max)."""
    cispo_ratio_min: float | None = None
    """CISPO: optional lower truncation of the IS weight (MiniMax-M1 leaves it off)."""
    sequence_level: bool = False
    """SAPO only: gate the sequence-level (geometric-mean) ratio instead of each token's."""


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return (logp - old_logp).clamp(-20.0, 20.0)


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio, mean over the response's tokens, shape [B, 1]."""
    m = mask.to(logp.dtype)
    return ((logp - old_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """PPO clipped surrogate with asymmetric clip (clip-higher): ratio ∈ [1 - eps, 1 + eps_high], and
    optional dual-clip: for A < 0 the loss is capped at -A·clip_ratio_c.

    Sources: Schulman et al. 2017 (arXiv:1707.06347) Eq. 7; clip-higher from Yu et al. 2025, *DAPO*
    (arXiv:2503.14476) §3.1; dual-clip from Ye et al. 2020, *Mastering Complex Control in MOBA Games with
    Deep RL* (arXiv:1912.09729) Eq. 5, as in veRL's ``compute_policy_loss``.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = _log_ratio(logp, old_logp).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"ratio": ratio.detach(), "clipped": (clipped > unclipped).float().detach()}
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (got {clip_ratio_c})")
        cap = -advantages * clip_ratio_c
        dual = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
        stats["dual_clipped"] = ((advantages < 0) & (cap < loss)).float().detach()
        loss = dual
    return loss, stats


def _ppo(logp, old_logp, advantages, mask, p: LossParams):
    return ppo_clip_loss(logp, old_logp, advantages, p.eps_clip, p.eps_clip_high, p.clip_ratio_c)


def gspo_loss(logp, old_logp, advantages, mask, p: LossParams) -> tuple[torch.Tensor, Stats]:
    """GSPO: the PPO clipped surrogate on the sequence ratio s_i = exp(mean_t log(π/π_old)), the same for
    every token of a response (TRL's ``importance_sampling_level="sequence"``).

    Source: Zheng et al. 2025, *Group Sequence Policy Optimization* (arXiv:2507.18071) Eq. 5–7. The paper
    uses eps ≈ 3e-4 / 4e-4; aggregate with seq-mean-token-mean to optimise the per-sequence objective.
    """
    seq = sequence_log_ratio(logp, old_logp, mask).clamp(-20.0, 20.0).expand_as(logp)
    return ppo_clip_loss(seq, torch.zeros_like(seq), advantages, p.eps_clip, p.eps_clip_high, p.clip_ratio_c)


def sapo_loss(logp, old_logp, advantages, mask, p: LossParams) -> tuple[torch.Tensor, Stats]:
    """SAPO: replaces the hard clip with a soft gate, loss = -A · (4/τ) · σ(τ (r - 1)), τ = τ⁺ if A > 0
    else τ⁻. The gate's gradient 4σ(1-σ) is 1 at r = 1 and decays smoothly as r leaves it.

    Source: Gao et al. 2025, *Soft Adaptive Policy Optimization* (arXiv:2511.20347) Eq. 8–10; as in TRL's
    ``loss_type="sapo"`` (τ⁺ = 1.0, τ⁻ = 1.05 defaults).
    """
    if p.sequence_level:
        ratio = sequence_log_ratio(logp, old_logp, mask).clamp(-20.0, 20.0).exp().expand_as(logp)
    else:
        ratio = _log_ratio(logp, old_logp).exp()
    tau = torch.where(advantages > 0, p.tau_pos, p.tau_neg).to(logp.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    return -gate * advantages, {"ratio": ratio.detach(), "gate": gate.detach()}


def cispo_loss(logp, old_logp, advantages, mask, p: LossParams) -> tuple[torch.Tensor, Stats]:
    """CISPO: REINFORCE with a clipped, stop-gradient importance weight, loss = -sg(clip(r)) · A · log π.
    Unlike PPO no token's gradient is dropped; only its weight is bounded.

    Source: MiniMax 2025, *MiniMax-M1* (arXiv:2506.13585) §3.1 Eq. 4–5; TRL's ``loss_type="cispo"``
    (weight clamped to at most ``epsilon_high``, recommended 5.0 in ScaleRL, arXiv:2510.13786).
    """
    ratio = _log_ratio(logp, old_logp).exp()
    weight = ratio.clamp(min=p.cispo_ratio_min, max=p.cispo_ratio_max).detach()
    stats = {"ratio": ratio.detach(), "clipped": ((ratio > p.cispo_ratio_max) & (advantages > 0)).float()}
    return -weight * advantages * logp, stats


PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossParams], tuple[torch.Tensor, Stats]
]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": _ppo,
    "gspo": gspo_loss,
    "sapo": sapo_loss,
    "cispo": cispo_loss,
}


# --- KL to the reference policy, per token: KL(π || π_ref) with samples from π -----------------------------
# Source for all three: J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log π - log π_ref: unbiased, high variance, can be negative."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π - log π_ref)²: biased, low variance, ≥ 0; its gradient is that of the true KL in
    expectation (the reason it is used as a loss)."""
    return 0.5 * (logp - ref_logp).square()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, always >= 0.
    Unbiased and low variance ("low_var_kl"); TRL's GRPO KL term. Clamped to 10 as veRL's low_var_kl is: a
    token the reference finds e^10 times likelier would otherwise dominate a batch's loss."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (d.exp() - d - 1.0).clamp(max=10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,
}


DISTILL_LOSS_ESTIMATOR = "k2"
"""``--distill-mode loss``: on the student's own samples k2's gradient is that of KL(π || π_teacher), the
divergence the flag documents (k3's would be KL(π_teacher || π), k1's is zero in expectation)."""


def loss_kl_estimator(algo: Any, distill: bool = False) -> str:
    """The estimator of a KL *loss* term: the distillation term's (:data:`DISTILL_LOSS_ESTIMATOR`) or the
    reference term's (``--kl-estimator``, k3 unset; the config refuses k1 there)."""
    return DISTILL_LOSS_ESTIMATOR if distill else algo.kl_loss_estimator


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate by name. As a loss: add β·kl per token before aggregation (GRPO, TRL's
    ``beta``). As reward shaping: subtract β·kl.detach() from the token rewards (REINFORCE++ / PPO-RLHF)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown --kl-estimator {estimator!r}; available: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp, ref_logp)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
