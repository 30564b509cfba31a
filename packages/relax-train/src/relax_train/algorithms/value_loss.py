"""The critic's loss and fit: PPO's clipped value loss and the explained variance of its values.

Why here, torch-free at import: both value backends (torch and megatron) must fit the same objective, and the
trainer reports the fit of the values its batch carries (numpy, :func:`relax_train.roles.metrics.critic_metrics`)
without building a model.

Source: Schulman et al. 2017 (PPO) as implemented by OpenAI baselines' ppo2 and veRL's
``compute_value_loss`` — their formula, not their code: the new value is clipped to ``old ± clip`` and the
larger of the clipped and unclipped squared errors counts, so one batch cannot move a value far from the
one the advantages were computed with.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def clipped_value_loss(
    vpreds: Any,
    old_values: Any,
    returns: Any,
    mask: Any,
    clip: float | None,
    total_tokens: float,
    coef: float = 0.5,
) -> tuple[Any, Any]:
    """(loss, clipped-token count) of one micro-batch, torch tensors [B, T] in, the loss summed over the
    micro-batch's masked tokens and divided by ``total_tokens`` (the optimizer batch's masked tokens), so
    micro-batches add up to the whole batch's token-mean: coef · mean_t max((v − R)², (clip(v) − R)²).
    ``clip`` None: the plain squared error (no clipped tokens).

    >>> import torch
    >>> loss, n = clipped_value_loss(torch.tensor([[2.0, 0.9]]), torch.zeros(1, 2), torch.ones(1, 2),
    ...                              torch.ones(1, 2), 0.5, 2.0)
    >>> round(float(loss), 4), float(n)  # (the 2nd token's move of 0.9 clipped to 0.5: its error counts 0.25)
    (0.3125, 1.0)
    """
    import torch

    err = (vpreds - returns) ** 2
    if clip is None:
        worst, clipped = err, torch.zeros_like(err)
    else:
        vclip = old_values + torch.clamp(vpreds - old_values, -clip, clip)
        err_clip = (vclip - returns) ** 2
        worst, clipped = torch.maximum(err, err_clip), (err_clip > err).float()
    m = mask.to(err.dtype)
    return coef * (worst * m).sum() / total_tokens, (clipped * m).sum().detach()


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float:
    """1 − Var(R − V) / Var(R) over a batch's model tokens (flat arrays, the environment's tokens left
    out): 1 a perfect critic, 0 one no better than a constant, negative a harmful one; NaN when the returns
    do not vary.

    >>> explained_variance(np.array([1.0, 2.0]), np.array([1.0, 3.0]))
    0.75
    """
    var = float(np.var(returns)) if len(returns) else 0.0
    if var == 0.0:
        return float("nan")
    return float(1.0 - np.var(returns - values) / var)
