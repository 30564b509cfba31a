"""Routing replay (R3) of a training forward, shared by both backends.

Why apart: a MoE model's forward routes each token to the experts the rollout engine used (the sample's
``routed_experts`` record); the torch backend replays through :mod:`relax_core.routing`, the megatron backend
through megatron-core's own router replay (:mod:`relax_train.backends.megatron.routing`), both behind the same
interface (``num_layers``, ``top_k``, ``replay(experts)``). Building the records and counting what the replay
changed is the same for both, so it lives here as a function and a counter each backend holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relax_core import sample
from relax_core.sample import TrainBatch


@dataclass
class ReplayCounts:
    """Token-layer pairs over the training forwards since the last :meth:`take_metrics`: those the replay
    covered, those expected to be (every recorded token in every MoE layer), and of the replayed those whose
    own top-k set differs (what R3 fixed). A backend whose ranks each routed a share of the tokens sums the
    fields over them before taking the metrics."""

    replayed: float = 0.0
    expected: float = 0.0
    differ: float = 0.0

    def take_metrics(self) -> dict[str, float]:
        """``r3_replayed_frac`` and ``r3_expert_differ_frac`` (none when nothing was replayed); the counts
        start again from zero."""
        replayed, expected, differ = self.replayed, self.expected, self.differ
        self.replayed = self.expected = self.differ = 0.0
        if not replayed:
            return {}
        return {"r3_replayed_frac": replayed / max(expected, 1.0), "r3_expert_differ_frac": differ / replayed}


@contextlib.contextmanager
def routing_replay(
    routing: Any,
    enabled: bool,
    samples: TrainBatch,
    idx: list[int],
    width: int,
    counts: ReplayCounts | None,
    cols: torch.Tensor | None = None,
) -> Iterator[None]:
    """R3 around a micro-batch's forward: each token goes to the experts the rollout engine used
    (``routed_experts``, [len(tokens) - 1, layers, k] per sample); positions without a record (each
    sequence's last token, right padding) route normally. ``cols``: the positions whose tokens this process
    routes, in the order its routers see them (a megatron rank under context or sequence parallelism;
    default all ``width``). ``counts``: where a training forward's statistics go (None: not counted). A no-op
    unless ``enabled`` (--routing-replay), the samples carry records and the model has ``routing``."""
    if not (enabled and sample.ROUTED_EXPERTS in samples and routing is not None):
        yield
        return
    experts = torch.full((len(idx), width, routing.num_layers, routing.top_k), -1, dtype=torch.long)
    for row, i in enumerate(idx):
        rec = torch.from_numpy(np.asarray(samples[sample.ROUTED_EXPERTS][i]).astype(np.int64))[:width]
        if rec.dim() != 3 or tuple(rec.shape[1:]) != (routing.num_layers, routing.top_k):
            raise ValueError(
                f"routed_experts of sample {i} has shape {list(rec.shape)}; this model needs "
                f"[tokens, {routing.num_layers}, {routing.top_k}] (MoE layers, top-k): rollout and trainer "
                "models differ"
            )
        experts[row, : len(rec)] = rec
    if cols is not None:
        experts = experts[:, cols]
    with routing.replay(experts) as stats:
        yield
    if counts is not None:  # train_step's metrics (r3_*)
        st = stats.as_dict()
        counts.replayed += st["replayed"]
        counts.differ += st["differ"]
        counts.expected += sum(len(samples[sample.TOKENS][i]) - 1 for i in idx) * routing.num_layers
