"""A backend's optimizer steps: ``train_step``'s loop over a rollout batch, shared by both backends.

Why apart: the torch and megatron backends split a batch into optimizer steps and micro-batches, skip a
non-finite update and report a step's metrics the same way; they differ in how micro-batches go forward and
backward (an HF model's forward, or megatron's schedule), in how the gradients are reduced and clipped, and
in where a step's statistics are gathered. Each backend holds a :class:`StepRunner` given exactly those
pieces as callables, instead of one backend overriding the other's methods. A streamed step
(:class:`~relax_train.backends.streamed.StreamedStep`) runs on the same runner.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relax_core.config import RelaxConfig
from relax_core.config_sections import TrainConfig
from relax_core.sample import LOSS_MASK, TOKENS, TrainBatch
from relax_train.backends.loss import PolicyLoss, StepStats, step_metrics
from relax_train.backends.micro import plan_micro_batches, sample_lengths

FROZEN = "this backend was built frozen (actor_fwd/reference); it cannot train"


def build_adamw(params: Iterable[torch.nn.Parameter], train: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` with the run's learning rate, betas and weight decay."""
    return torch.optim.AdamW(
        params, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), weight_decay=train.weight_decay
    )


def apply_adamw_settings(optimizer: torch.optim.Optimizer, train: TrainConfig) -> None:
    """The run's learning rate, betas and weight decay into every parameter group of ``optimizer``, over
    what a checkpoint's optimizer state brought: ``--lr`` (and the others) given with ``--load`` apply
    (``relax_core.ownership.TRAIN_SETTINGS``; before, the saved groups won while config.json said
    otherwise). The moments and step counts stay the checkpoint's."""
    for group in optimizer.param_groups:
        group.update(lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), weight_decay=train.weight_decay)


def set_trainable(model: torch.nn.Module, trainable: bool) -> None:
    """Train mode, or a frozen model in eval mode (no gradients)."""
    if trainable:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)


def update_if_finite(
    optimizer: torch.optim.Optimizer, grad_norm: float, before_update: Callable[[], Any] | None
) -> bool:
    """Step the optimizer, unless the gradient norm is NaN or infinite: that step would write NaN into
    every weight (and, through AdamW's moments, into every later step). It is skipped instead, its
    gradients dropped, and counted (``train/nonfinite_updates_skipped``). ``before_update`` (the trainer's
    fence for a weight broadcast still reading the weights) runs just before the optimizer writes them.
    True when it stepped."""
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return False
    if before_update is not None:
        before_update()
    optimizer.step()
    return True


ForwardBackward = Callable[[TrainBatch, list[list[int]], float, int, StepStats], float]
"""``(samples, micro-batches, the optimizer batch's token count, its sequence count, stats) -> summed loss``:
forward and backward of every micro-batch of one optimizer step (gradients accumulate)."""


@dataclass
class StepRunner:
    """The optimizer steps of one trainable backend: its model and optimizer, the loss, and the backend's
    own ways to run micro-batches (``forward_backward``), clip and step (``clip_and_step``: the pre-clip
    gradient norm), gather a step's statistics (``metrics``: :func:`step_metrics`'s arguments) and take
    routing replay's metrics (``replay_metrics``). ``stepped`` is called once a batch's update is taken (the
    backend bumps its version)."""

    cfg: RelaxConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: PolicyLoss
    forward_backward: ForwardBackward
    clip_and_step: Callable[[], float]
    replay_metrics: Callable[[], dict[str, float]]
    stepped: Callable[[], None]
    metrics: Callable[..., dict[str, float]] = step_metrics

    def train_step(self, samples: TrainBatch) -> dict[str, float]:
        """One rollout batch: one or more optimizer steps of --global-batch-size samples each; the metrics."""
        n = len(samples[TOKENS])
        gbs = min(self.cfg.effective_global_batch_size, n)
        lengths = sample_lengths(samples)
        stats = self.loss.start(samples)
        loss_total, grad_norm, n_opt, skipped = 0.0, 0.0, 0, 0
        self.model.train()
        for gstart in range(0, n, gbs):
            gidx = list(range(gstart, min(n, gstart + gbs)))
            total_tokens = float(sum(float(np.sum(samples[LOSS_MASK][i])) for i in gidx)) or 1.0
            self.optimizer.zero_grad(set_to_none=True)
            stats.first_step = gstart == 0
            micro = plan_micro_batches(lengths, gidx, self.cfg.train)
            loss_total += self.forward_backward(samples, micro, total_tokens, len(gidx), stats)
            norm = self.clip_and_step()
            grad_norm += norm
            skipped += not math.isfinite(norm)
            n_opt += 1
        self.stepped()
        return self.finish(stats, loss_total, grad_norm, n_opt, skipped)

    def finish(
        self, stats: StepStats, loss_total: float, grad_norm: float, n_opt: int, skipped: int
    ) -> dict[str, float]:
        """The metrics of a batch's ``n_opt`` optimizer steps (``skipped`` of them not taken: non-finite)."""
        metrics = self.metrics(stats.sums, stats.counts, stats.keep, loss_total, grad_norm, n_opt)
        metrics["nonfinite_updates_skipped"] = float(skipped)
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])  # (its last optimizer step's)
        return {**metrics, **self.replay_metrics()}
