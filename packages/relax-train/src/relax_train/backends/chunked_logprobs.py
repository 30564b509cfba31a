"""Token log-probs and entropies from the last hidden states, a chunk of rows at a time (#51).

Why: the plain computation (:meth:`relax_train.backends.logprobs.TokenScorer.token_logp` on the model's
logits) materialises the logits [N, V] in float32, a tempered copy and a log-softmax of the same size, and
autograd keeps them (and the entropy's exp and product) for backward. With Qwen's 151,936-token
vocabulary one [N, V] float32 tensor is 4.9 GB at N = 8,192 tokens, and the plain forward and backward
hold several at once. Here the LM head's matmul is folded in: each chunk of ``chunk_tokens`` rows
computes its logits ``hidden_chunk @ weight.T`` in float32, masks the never-sampled ids, divides by the
temperature and reduces them to the target's log-prob and the entropy, so at most a few [chunk, V]
buffers exist at once.

What is kept for backward: ``hidden``, ``weight``, ``targets``, the masked ids and the entropies [N] —
nothing of size V per row. Backward recomputes each chunk's logits (a second LM-head matmul per chunk,
the price of the memory) and applies the exact gradient of both outputs with respect to the tempered
logits z, p = softmax(z):

    d logp_target / dz_j = [j = target] - p_j
    d entropy / dz_j     = -p_j (z_j - sum_i p_i z_i) = -p_j (log p_j + entropy)

then zero at the masked columns (their logit is a constant), times 1 / temperature, and through the
matmul to ``hidden`` and ``weight`` (p renormalised to sum to one in float32 first: see
:func:`_chunk_grad_logits`). The values equal the plain computation on float32 logits up to
float32 rounding (the same log-softmax kernel on the same rows; only the matmul's blocking may differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from relax_core.models import MASKED_LOGIT

DEFAULT_CHUNK_TOKENS = 1024
"""Rows per chunk: a [1024, 151,936] float32 buffer is 0.6 GB, and the matmul is still large enough to run
at full speed."""


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 where an input is float64 (so gradcheck can run): bf16 or fp16 logits would
    lose the log-probs' low digits, which the ratio of new to old policy depends on."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _chunk_log_softmax(
    hidden: torch.Tensor, weight: torch.Tensor, masked: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Log-softmax [C, V] of one chunk's tempered logits, as the plain path computes them: the logits,
    the masked ids set to ``MASKED_LOGIT`` (never sampled by the rollout engine), divided by the
    temperature. ``weight`` is already in the compute dtype."""
    z = hidden.to(weight.dtype) @ weight.T
    if masked.numel():
        z.index_fill_(1, masked, MASKED_LOGIT)
    z.div_(temperature)
    return torch.log_softmax(z, dim=-1)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy per row of a log-softmax [C, V]; the same sum as ``entropy_from_logits``, with the
    product formed in place of the exp (no third [C, V] buffer)."""
    p = logp.exp()
    return -p.mul_(logp).sum(-1)


def _chunk_grad_logits(
    logp: torch.Tensor,
    targets: torch.Tensor,
    masked: torch.Tensor,
    temperature: float,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
    ent: torch.Tensor | None,
) -> torch.Tensor:
    """Gradient [C, V] of the loss with respect to one chunk's (untempered) logits, given its log-softmax
    ``logp`` (overwritten) and the loss's gradients of the target log-probs and the entropies:
    -p_j (g_logp + g_ent (log p_j + entropy)) + g_logp [j = target], zero at masked columns, / T.

    p is renormalised by its float32 sum s (p' = p / s, log p'_j + entropy' = log p_j + entropy / s):
    then each part of a row sums to zero as the exact gradient does, and the rounding of a 151,936-term
    sum no longer leaks into the gradient along E_p[weight]. One more pass over [C, V]; at that vocabulary
    the gradients come 4x closer to a float64 reference than the plain path's autograd (4e-6 against
    1.8e-5 of their largest magnitude, 128 rows)."""
    p = logp.exp()
    s = p.sum(-1, keepdim=True)
    p.div_(s)
    if g_ent is not None and ent is not None:
        coef = logp.add_(ent[:, None] / s).mul_(g_ent[:, None]).add_(g_logp[:, None])
        grad = p.mul_(coef).neg_()
    else:
        grad = p.mul_(-g_logp[:, None])
    grad.scatter_add_(1, targets[:, None], g_logp[:, None])
    if masked.numel():
        grad.index_fill_(1, masked, 0.0)
    return grad.div_(temperature)


def _chunks(n: int, size: int) -> list[slice]:
    """Row slices of ``size`` (the last one shorter) covering ``n`` rows, the same in forward and backward."""
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


class ChunkedTokenLogp(torch.autograd.Function):
    """Target log-probs (and entropies) of ``hidden @ weight.T`` at a temperature, chunk by chunk; see the
    module docstring. Use :func:`chunked_token_logp`."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        masked: torch.Tensor,
        chunk_tokens: int,
        with_entropy: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden, weight)
        w = weight.to(dtype)  # (no copy when weight is already float32)
        logp = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        ent = torch.empty_like(logp) if with_entropy else None
        for rows in _chunks(hidden.shape[0], chunk_tokens):
            lp = _chunk_log_softmax(hidden[rows], w, masked, temperature)
            logp[rows] = lp.gather(1, targets[rows, None]).squeeze(1)
            if ent is not None:
                ent[rows] = _entropy(lp)
            del lp
        ctx.save_for_backward(hidden, weight, targets, masked, ent)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return (logp, ent) if ent is not None else logp

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, masked, ent = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        dtype = _compute_dtype(hidden, weight)
        w = weight.to(dtype)
        g_logp, g_ent = grads[0].to(dtype), (grads[1].to(dtype) if len(grads) > 1 else None)
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        for rows in _chunks(hidden.shape[0], ctx.chunk_tokens):
            h = hidden[rows].to(dtype)
            lp = _chunk_log_softmax(h, w, masked, ctx.temperature)
            g = _chunk_grad_logits(
                lp,
                targets[rows],
                masked,
                ctx.temperature,
                g_logp[rows],
                g_ent[rows] if g_ent is not None else None,
                ent[rows] if ent is not None else None,
            )
            del lp
            if grad_hidden is not None:
                torch.mm(g, w, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(g.T, h)
            del g
        return (
            grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_token_logp(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    masked_token_ids: Sequence[int] = (),
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` [...] under ``softmax((hidden @ weight.T) / temperature)`` with
    ``masked_token_ids`` never possible, and the entropy of that distribution (or None), without the
    [..., V] logits: what ``TokenScorer(temperature, masked_token_ids).token_logp(hidden @ weight.T,
    targets, with_entropy)`` returns, to float32 rounding.

    ``hidden`` [..., H] is the last hidden state (after the final norm), ``weight`` [V, H] the LM head's
    (or the tied embedding's) weight; bf16, fp16, float32 or float64. The results are float32 (float64
    for float64 inputs); the gradients reach ``hidden`` and ``weight`` in their own dtypes."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != targets.shape or hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets {tuple(targets.shape)} "
            "do not fit: hidden [..., H], weight [V, H], targets [...]"
        )
    masked = torch.as_tensor(list(masked_token_ids), dtype=torch.long, device=hidden.device)
    out = ChunkedTokenLogp.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).long(),
        float(temperature),
        masked,
        int(chunk_tokens),
        with_entropy,
    )
    if with_entropy:
        logp, ent = out
        return logp.reshape(targets.shape), ent.reshape(targets.shape)
    return out.reshape(targets.shape), None
