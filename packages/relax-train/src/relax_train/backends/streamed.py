"""One optimizer step fed as the samples arrive: streamed training for the torch backend.

Why: with streaming rollout the trainer's batch lands group by group. Waiting for the whole batch before
the first forward leaves the trainer idle while the last groups generate; instead each arriving part goes
through forward and backward at once (gradients accumulate) and the optimizer steps when the batch is
complete. The update must be the whole-batch step's: the loss of an optimizer batch divides by its token
count (``token-mean``, and the entropy bonus in every mode), which is known only at the end. So each part's
loss is taken with a token count of 1 and the accumulated gradients are divided by the batch's count
before clipping — the same gradient, up to rounding. Modes that divide by the number of sequences (known
up front: the batch size) need nothing deferred; a mode mixing both (a ``seq-mean-*`` mode with an entropy
bonus) is refused, naming the flags.

A backend that can declares it (``supports_streamed_step``, :class:`~relax_train.backends.TrainBackend`):
``step = backend.streamed_step(n_seqs)``, ``step.add(part)`` per arriving part, ``metrics = step.finish()``;
equal to ``backend.train_step(whole)`` with one optimizer step per batch. The step runs on the backend's
:class:`~relax_train.backends.step.StepRunner` (its forward-backward, clipping and metrics), so it needs no
access to the backend itself.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from relax_core.sample import (
    LOG_PROBS,
    LOSS_MASK,
    REF_LOG_PROBS,
    ROLLOUT_LOG_PROBS,
    TEACHER_LOG_PROBS,
    TOKENS,
    TrainBatch,
)
from relax_train.backends.loss import StepStats
from relax_train.backends.micro import plan_micro_batches, sample_lengths
from relax_train.backends.step import StepRunner

_SHAPING = {LOG_PROBS, ROLLOUT_LOG_PROBS, REF_LOG_PROBS, TEACHER_LOG_PROBS}
"""Fields whose presence chooses the loss's terms (:meth:`PolicyLoss.start`): π_prox, the behaviour
correction, the KL to the reference, distillation."""


def why_not_streamed(cfg: Any, n_seqs: int) -> str | None:
    """Why a batch of ``n_seqs`` samples cannot be trained part by part into exactly its whole-batch update
    under ``cfg`` (a message naming the flags), or None when it can."""
    a, gbs = cfg.algo, cfg.effective_global_batch_size
    if gbs != n_seqs:
        return (
            f"streamed training takes one optimizer step per batch: --global-batch-size ({gbs}) must be "
            f"the batch ({n_seqs} samples)"
        )
    if a.loss_agg_mode != "token-mean" and a.entropy_coef > 0:
        return (
            f"streamed training with --loss-agg-mode {a.loss_agg_mode} and --entropy-coef {a.entropy_coef} "
            "needs the batch's token count before its first part: use --loss-agg-mode token-mean or "
            "--entropy-coef 0"
        )
    return None


class StreamedStep:
    """An optimizer step of ``n_seqs`` samples on a backend's :class:`StepRunner` ``runner``, fed by
    :meth:`add` (any split into parts) and taken by :meth:`finish`. Built by a backend's ``streamed_step``."""

    def __init__(self, runner: StepRunner, n_seqs: int) -> None:
        refused = why_not_streamed(runner.cfg, n_seqs)
        if refused:
            raise ValueError(refused)
        self.by_tokens = runner.cfg.algo.loss_agg_mode == "token-mean"
        self.runner, self.n_seqs = runner, n_seqs
        self.stats: StepStats | None = None
        self.keys: set[str] | None = None
        self.tokens, self.loss_sum, self.seen = 0.0, 0.0, 0
        runner.optimizer.zero_grad(set_to_none=True)
        runner.model.train()

    def add(self, part: TrainBatch) -> None:
        """Forward and backward of ``part`` (samples as ``train_step`` takes them), micro-batch by
        micro-batch; the gradients accumulate."""
        n = len(part[TOKENS])
        if self.seen + n > self.n_seqs:
            raise ValueError(f"a streamed step of {self.n_seqs} samples was given {self.seen + n}")
        shaping = set(part) & _SHAPING  # (what decides the step's loss terms: the same in every part)
        if self.stats is None:
            self.stats, self.keys = self.runner.loss.start(part), shaping
        elif shaping != self.keys:
            raise ValueError(
                f"every part of a streamed step must carry the same loss fields: {sorted(self.keys or ())} in "
                f"the first, {sorted(shaping)} here"
            )
        # token-mean: each part's loss over a token count of 1, divided by the batch's count in finish()
        micro = plan_micro_batches(sample_lengths(part), list(range(n)), self.runner.cfg.train)
        self.loss_sum += self.runner.forward_backward(part, micro, 1.0, self.n_seqs, self.stats)
        self.tokens += float(sum(float(np.sum(m)) for m in part[LOSS_MASK]))
        self.seen += n

    def finish(self) -> dict[str, float]:
        """The optimizer step (clipped as ``train_step`` clips) once every sample was added; its metrics."""
        if self.seen != self.n_seqs or self.stats is None:
            raise ValueError(f"a streamed step of {self.n_seqs} samples ended after {self.seen}")
        r = self.runner
        loss = self.loss_sum
        if self.by_tokens:
            total = self.tokens or 1.0
            for p in r.model.parameters():
                if p.grad is not None:
                    p.grad.div_(total)
            loss /= total
        norm = r.clip_and_step()
        r.stepped()
        return r.finish(self.stats, loss, norm, 1, not math.isfinite(norm))


def streamed_train_step(backend: Any, parts: list[TrainBatch]) -> dict[str, float]:
    """``parts`` of one batch through the backend's streamed step (what the trainer does as they arrive)."""
    step = backend.streamed_step(sum(len(p[TOKENS]) for p in parts))
    for part in parts:
        step.add(part)
    return step.finish()
