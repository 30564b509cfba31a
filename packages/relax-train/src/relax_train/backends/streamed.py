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

Used as ``step = StreamedStep(backend, n_seqs)``, ``step.add(part)`` per arriving part,
``metrics = step.finish()``; equal to ``backend.train_step(whole)`` with one optimizer step per batch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from relax_train.backends.micro import plan_micro_batches, sample_lengths

_SHAPING = {"log_probs", "rollout_log_probs", "ref_log_probs", "teacher_log_probs"}
"""Fields whose presence chooses the loss's terms (``_StepAcc.start``): π_prox, the behaviour correction, the
KL to the reference, distillation."""


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
    """An optimizer step of ``n_seqs`` samples over :class:`~relax_train.backends.torch_backend.TorchBackend`
    ``backend``, fed by :meth:`add` (any split into parts) and taken by :meth:`finish`."""

    def __init__(self, backend: Any, n_seqs: int) -> None:
        if not backend.trainable:
            raise RuntimeError("this backend was built frozen (actor_fwd/reference); it cannot train")
        refused = why_not_streamed(backend.cfg, n_seqs)
        if refused:
            raise ValueError(refused)
        self.by_tokens = backend.cfg.algo.loss_agg_mode == "token-mean"
        self.b, self.n_seqs = backend, n_seqs
        self.acc: Any = None
        self.keys: set[str] | None = None
        self.tokens, self.loss_sum, self.seen = 0.0, 0.0, 0
        backend.optimizer.zero_grad(set_to_none=True)
        backend.model.train()

    def add(self, part: dict[str, list]) -> None:
        """Forward and backward of ``part`` (samples as ``train_step`` takes them), micro-batch by
        micro-batch; the gradients accumulate."""
        from relax_train.backends.torch_backend import _StepAcc

        n = len(part["tokens"])
        if self.seen + n > self.n_seqs:
            raise ValueError(f"a streamed step of {self.n_seqs} samples was given {self.seen + n}")
        shaping = set(part) & _SHAPING  # (what decides the step's loss terms: the same in every part)
        if self.acc is None:
            self.acc, self.keys = _StepAcc.start(self.b, part), shaping
        elif shaping != self.keys:
            raise ValueError(
                f"every part of a streamed step must carry the same loss fields: {sorted(self.keys)} in the "
                f"first, {sorted(shaping)} here"
            )
        scale = 1.0 if self.by_tokens else None  # token-mean: divided by the batch's count in finish()
        for idx in plan_micro_batches(sample_lengths(part), list(range(n)), self.b.cfg.train):
            logp, valid, _, ent = self.b._response_logp(part, idx, with_entropy=self.acc.with_entropy)
            loss = self.b._micro_loss(part, idx, logp, valid, ent, scale or 1.0, self.n_seqs, self.acc)
            loss.backward()
            self.loss_sum += float(loss.detach())
        self.tokens += float(sum(float(np.sum(m)) for m in part["loss_mask"]))
        self.seen += n

    def finish(self) -> dict[str, float]:
        """The optimizer step (clipped as ``train_step`` clips) once every sample was added; its metrics."""
        if self.seen != self.n_seqs:
            raise ValueError(f"a streamed step of {self.n_seqs} samples ended after {self.seen}")
        b = self.b
        loss = self.loss_sum
        if self.by_tokens:
            total = self.tokens or 1.0
            for p in b.model.parameters():
                if p.grad is not None:
                    p.grad.div_(total)
            loss /= total
        norm = b._clip_and_step()
        b.version += 1
        metrics = b._step_metrics(self.acc.sums, self.acc.counts, self.acc.keep, loss, norm, 1)
        metrics["nonfinite_updates_skipped"] = float(not math.isfinite(norm))
        metrics["lr"] = float(b.optimizer.param_groups[0]["lr"])
        return {**metrics, **b._r3_metrics()}


def streamed_train_step(backend: Any, parts: list[dict[str, list]]) -> dict[str, float]:
    """``parts`` of one batch through a :class:`StreamedStep` (what the trainer does as they arrive)."""
    step = StreamedStep(backend, sum(len(p["tokens"]) for p in parts))
    for part in parts:
        step.add(part)
    return step.finish()
