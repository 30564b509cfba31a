"""Policy losses on padded [batch, response_len] tensors.

Every function returns the *per-token* loss; aggregation (token-mean over the global batch) is done by
the backend so that gradient accumulation over micro-batches gives exactly the full-batch gradient.
"""

from __future__ import annotations

import torch


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip (clip-higher): ratio ∈ [1 - eps, 1 + eps_high]."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"ratio": ratio.detach(), "clipped": (clipped > unclipped).float().detach()}
    return loss, stats


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, always >= 0."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return d.exp() - d - 1.0


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
