"""Reducing a per-token loss to the scalar the optimiser descends, and the entropy bonus.

The mode decides how much each token weighs. ``token-mean`` weighs every token in the batch alike (long
responses weigh more in total); ``seq-mean-token-mean`` first averages within a response, so every
response weighs alike (GRPO's original form, with the length bias Dr.GRPO points out);
``seq-mean-token-sum`` sums within a response; ``seq-mean-token-sum-norm`` divides that sum by a constant
max length (Dr.GRPO), which removes the length bias without a per-response denominator.

For gradient accumulation pass the *global* denominators (``global_tokens``, ``global_seqs``): each
micro-batch then contributes its share and the accumulated gradient is the full-batch one.

TRL's GRPO ``loss_type`` values are these modes (see :data:`TRL_LOSS_TYPES`): grpo and sapo →
seq-mean-token-mean; bnpo → token-mean over the local micro-batch; dapo and cispo → token-mean over the
whole generation batch (``num_items_in_batch``); dr_grpo → seq-mean-token-sum-norm with
max_len = ``max_completion_length``; luspo → seq-mean-token-sum.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

TRL_LOSS_TYPES: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "cispo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "luspo": "seq-mean-token-sum",
}


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Scalar loss from a per-token loss [B, T] (or [B, 1], broadcast) and a 0/1 mask [B, T].

    Denominators default to this batch's (tokens under the mask, rows); a response with no tokens counts
    one token in seq-mean-token-mean so it contributes 0 rather than NaN.
    """
    m = mask.to(loss.dtype)
    per_tok = loss * m
    if mode == "token-mean":
        denom = m.sum() if global_tokens is None else global_tokens
        return per_tok.sum() / (denom.clamp(min=1.0) if torch.is_tensor(denom) else max(float(denom), 1.0))
    seqs = float(loss.shape[0] if global_seqs is None else global_seqs)
    if mode == "seq-mean-token-mean":
        return (per_tok.sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / max(seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return per_tok.sum() / max(seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if max_len is None or max_len <= 0:
            raise ValueError(
                f"seq-mean-token-sum-norm needs max_len > 0, the max response length (got {max_len})"
            )
        return per_tok.sum() / (max(seqs, 1.0) * max_len)
    raise ValueError(f"unknown --loss-agg-mode {mode!r}; available: {list(LOSS_AGG_MODES)}")


def entropy_bonus(
    entropy: torch.Tensor, mask: torch.Tensor, coef: float, total_tokens: float | None = None
) -> torch.Tensor:
    """The term to *add* to the loss for an entropy bonus: -coef · token-mean entropy under the mask.
    Independent of the policy loss's aggregation mode, as in TRL (``entropy_coef``) and veRL.
    ``total_tokens``: the optimizer batch's token count, for a micro-batch's share of the batch's mean
    (the micro-batches' terms then sum to the whole batch's)."""
    m = mask.to(entropy.dtype)
    denom = m.sum().clamp(min=1.0) if total_tokens is None else max(float(total_tokens), 1.0)
    return -coef * (entropy * m).sum() / denom
