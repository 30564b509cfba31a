"""Rollout-vs-trainer mismatch: truncated importance sampling and the metrics that show the gap.

The rollout engine (SGLang/vLLM kernels, maybe older weights) samples from π_rollout while the trainer
computes π_old for the same tokens; the two differ. Weighting each token's loss by π_old / π_rollout,
truncated or masked where it is extreme, corrects the gradient's bias without its variance blowing up.

Sources: Yao et al. 2025, *Your Efficient RL Framework Secretly Brings You Off-Policy RL Training*
(fengyao.notion.site, TIS); Liu et al. 2025, *When Speed Kills Stability* (MIS, sequence level). Mode names
and semantics follow TRL's ``vllm_importance_sampling_mode``: token_truncate, token_mask,
sequence_truncate, sequence_mask; the sequence ratio is the product of token ratios.
"""

from __future__ import annotations

import math

import torch

from relax_train.algorithms.losses import kl_k3


@torch.no_grad()
def truncated_is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    mode: str = "truncate",
    clip_min: float | None = None,
    clip_max: float | None = 2.0,
) -> torch.Tensor:
    """Detached weights π_old / π_rollout: [B, T] at token level, [B, 1] at sequence level.

    ``truncate`` clamps into [clip_min, clip_max]; ``mask`` sets weights outside it to 0 (drops them).
    Positions outside ``mask`` contribute a log-ratio of 0 (weight 1); the loss mask removes them anyway.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"--tis-level must be 'token' or 'sequence' (got {level!r})")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"--tis-mode must be 'truncate' or 'mask' (got {mode!r})")
    diff = torch.nan_to_num((old_logp - rollout_logp) * mask.to(old_logp.dtype), nan=0.0)
    if level == "sequence":
        diff = diff.sum(-1, keepdim=True)
    w = diff.exp()
    if mode == "truncate":
        return w.clamp(min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return w.masked_fill((w < lo) | (w > hi), 0.0)


@torch.no_grad()
def mismatch_metrics(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Train-vs-rollout gap over the masked tokens: k3 KL(train || rollout), |Δ log p|, ratio min/mean/max."""
    m = mask.bool()
    if not m.any():
        return {}
    t, r = train_logp[m].double(), rollout_logp[m].double()
    ratio = (t - r).exp()
    return {
        "mismatch/kl_k3": float(kl_k3(t, r).mean()),
        "mismatch/abs_logp_diff": float((t - r).abs().mean()),
        "mismatch/ratio_min": float(ratio.min()),
        "mismatch/ratio_mean": float(ratio.mean()),
        "mismatch/ratio_max": float(ratio.max()),
    }
