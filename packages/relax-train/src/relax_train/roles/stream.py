"""The trainer's step under streaming rollout: it trains on step k's groups as they arrive.

Why: with ``--streaming-rollout`` the groups of a step land one at a time (after ActorFwd, Reference and
Advantages, which take them as they come too). Taking the batch only once it is whole leaves the trainer
idle while the step's last groups generate; here each arriving part goes through forward and backward at
once and the optimizer steps when the batch is complete (the backend's ``streamed_step``,
:mod:`relax_train.backends.streamed`: the whole-batch update to rounding). Where that cannot be exact — a
backend without streamed steps (``supports_streamed_step``: megatron), advantages whitened over the whole
batch, several optimizer steps per batch, a loss normalisation mixing token and sequence counts — the
trainer takes the whole batch as before (:func:`streams_training` says which).

The trainer hands :func:`train_as_it_arrives` what it uses (its bus, backend, tracer, the weights' lock, its
π_prox and heartbeat callables), not itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.roles import TRAINER_CONSUMER
from relax_core.sample import TrainBatch, columns, train_batch
from relax_core.trace import Tracer
from relax_train.algorithms.advantages import BATCH_NORMALISED
from relax_train.backends.base import TrainBackend

if TYPE_CHECKING:
    from relax_bus import Bus


@dataclass
class Taken:
    """What a step trained on: its samples' bus ids, their fields (one list per field), its leases."""

    ids: list[int]
    data: TrainBatch
    lease_ids: list[int]
    taken_at: list[float] | None = None
    """Per sample, when the trainer got it from the bus (wall clock, s)."""

    def __len__(self) -> int:
        return len(self.ids)


def streams_training(cfg: RelaxConfig, backend: TrainBackend) -> bool:
    """Whether the trainer trains on a step's parts as they arrive (see the module docstring)."""
    from relax_train.backends.streamed import why_not_streamed

    return (
        cfg.rollout.streaming_rollout
        and backend.supports_streamed_step
        and cfg.algo.advantage_estimator not in BATCH_NORMALISED
        and why_not_streamed(cfg, cfg.samples_per_rollout) is None
    )


def train_as_it_arrives(
    step: int,
    *,
    cfg: RelaxConfig,
    bus: Bus,
    backend: TrainBackend,
    tracer: Tracer,
    lock: AbstractContextManager[Any],
    exact_prox: Callable[[TrainBatch], dict[str, float]],
    alive: Callable[[], None],
) -> tuple[Taken, dict[str, Any], float]:
    """Step ``step``'s batch, part by part from ``bus`` (partition ``step<k>``), into one optimizer step of
    ``backend``; (what was trained, the ``train/*`` metrics, seconds spent waiting for parts).

    ``exact_prox(part)``: π_prox of a part's samples at this step's weights (:func:`.prox.exact_prox`), its
    metrics; ``alive()``: the trainer's heartbeat, called while it waits; ``lock``: held around the optimizer
    step (a re-formed weight-broadcast group re-sends the weights between steps, never mid-update)."""
    from relax_bus import BusTimeout, ConsumerReset

    per = cfg.samples_per_rollout
    update = backend.streamed_step(per)
    ids: list[int] = []
    leases: list[int] = []
    parts: list[TrainBatch] = []
    taken_at: list[float] = []
    prox: list[tuple[int, dict[str, float]]] = []
    waited = 0.0
    while len(ids) < per:
        t = time.perf_counter()
        alive()  # (a live trainer while it waits)
        try:
            batch = bus.get(
                TRAINER_CONSUMER,
                n=per - len(ids),
                partial=True,
                trainer_version=step,
                timeout=1.0,
                partition=f"step{step}",
            )
        except (BusTimeout, ConsumerReset):
            waited += time.perf_counter() - t
            continue
        waited += time.perf_counter() - t
        taken_at.extend([time.time()] * len(batch))
        ids.extend(batch.ids)
        leases.append(batch.lease_id)
        part = train_batch(batch.data)
        with tracer.span("train_part", step=step, n=len(batch)):
            prox.append((len(batch), exact_prox(part)))
            update.add(part)
        parts.append(part)
    # the lock: a re-formed DCS group re-sends the weights between steps, never mid-update
    with tracer.span("optimizer_step", step=step), lock:
        metrics = {f"train/{k}": v for k, v in update.finish().items()}
    metrics.update(_merged(prox))
    metrics["train/parts"] = float(len(parts))  # the bus deliveries the batch arrived in
    return Taken(ids, _joined(parts), leases, taken_at), metrics, waited


def _joined(parts: list[TrainBatch]) -> TrainBatch:
    """The parts' fields as one batch's; a field only some parts carry (``prox_from_forward``, set where
    π_prox was stale) is False elsewhere for that flag, None for any other."""
    keys = list(dict.fromkeys(k for p in parts for k in p))
    out: dict[str, list[Any]] = {}
    for k in keys:
        fill = False if k == sample.PROX_FROM_FORWARD else None
        out[k] = [x for p in parts for x in columns(p).get(k, [fill] * len(p[sample.TOKENS]))]
    return train_batch(out)


def _merged(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The parts' π_prox metrics as the whole batch's: maxima of ``*_max``, sample-weighted means else."""
    n = sum(k for k, _ in parts) or 1
    out: dict[str, float] = {}
    for key in {k for _, m in parts for k in m}:
        values = [(k, m[key]) for k, m in parts if key in m]
        if key.endswith("_max"):
            out[key] = max(v for _, v in values)
        else:
            out[key] = sum(k * v for k, v in values) / n
    return out
