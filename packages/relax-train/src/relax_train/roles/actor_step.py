"""The trainer's step on a batch: take it from the bus (polling, so the heartbeat shows a live trainer while
it waits), finish its advantages, compute the exact proximal policy where ActorFwd scored with older
weights, and train — the whole batch, or part by part as a streaming rollout lands it. A part of
:class:`~relax_train.roles.actor.ActorWorker`, which publishes, evaluates, logs and checkpoints around it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.roles import TRAINER_CONSUMER
from relax_core.sample import TrainBatch, train_batch
from relax_core.trace import Tracer
from relax_train.algorithms.advantages import BATCH_NORMALISED, finish_batch_advantages
from relax_train.roles.prox import exact_prox
from relax_train.roles.stream import Taken, streams_training, train_as_it_arrives

if TYPE_CHECKING:
    from relax_bus import Batch, Bus


def take_request(cfg: RelaxConfig, step: int) -> dict[str, Any]:
    """What the trainer asks the bus for at step ``step`` (``bus.get``'s keywords): the step's whole batch,
    at trainer version ``step`` (the staleness bound's reference), and under streaming rollout only step
    ``step``'s partition (later steps' groups land while its tail generates)."""
    return {
        "n": cfg.samples_per_rollout,
        "trainer_version": step,
        "partition": f"step{step}" if cfg.rollout.streaming_rollout else None,
    }


class StepTrainer:
    """One training step's data flow, over the trainer's bus and backend."""

    def __init__(
        self, cfg: RelaxConfig, bus: Bus, backend: Any, tracer: Tracer, lock: threading.RLock
    ) -> None:
        """``lock``: held while the weights change (a re-formed DCS group re-sends them between steps, never
        mid-update)."""
        self.cfg, self.bus, self.backend, self.tracer, self.lock = cfg, bus, backend, tracer, lock
        self.beat = 0.0
        """When the trainer last made progress or polled idle (``time.monotonic()``; 0: not yet)."""

    def alive(self) -> None:
        """Mark progress (or an idle poll) for the heartbeat."""
        self.beat = time.monotonic()

    def train(self, step: int, t0: float) -> tuple[Taken, dict[str, Any], float]:
        """Step ``step`` (asked at ``t0``): the batch trained, its metrics, and when its data was there."""
        if streams_training(self.cfg, self.backend):  # streaming rollout: parts as they arrive
            batch, metrics, waited = train_as_it_arrives(
                step,
                cfg=self.cfg,
                bus=self.bus,
                backend=self.backend,
                tracer=self.tracer,
                lock=self.lock,
                exact_prox=self.exact_prox,
                alive=self.alive,
            )
            return batch, metrics, t0 + waited
        return self._whole(step)

    def exact_prox(self, d: TrainBatch) -> dict[str, float]:
        """π_prox at this step's weights for samples ActorFwd scored with older ones (:func:`.prox.exact_prox`)."""
        return exact_prox(self.cfg, self.backend, d)

    def _take(self, step: int) -> Batch:
        from relax_bus import BusTimeout, ConsumerReset

        while True:  # poll, so the heartbeat shows a live trainer while it waits for data
            self.alive()
            try:
                return self.bus.get(
                    TRAINER_CONSUMER, fields=None, timeout=1.0, **take_request(self.cfg, step)
                )
            except (BusTimeout, ConsumerReset):
                continue

    def _whole(self, step: int) -> tuple[Taken, dict[str, Any], float]:
        """One step on a whole batch taken from the bus: the batch, its metrics, and when it was taken."""
        with self.tracer.span("wait_for_data", step=step):
            got = self._take(step)
        t1 = time.perf_counter()
        batch = Taken(got.ids, train_batch(got.data), [got.lease_id], [time.time()] * len(got.ids))
        d = batch.data
        if self.cfg.algo.advantage_estimator in BATCH_NORMALISED:  # whitened over the batch trained on
            a = self.cfg.algo
            d[sample.ADVANTAGES] = finish_batch_advantages(
                a.advantage_estimator,
                d[sample.ADVANTAGES],
                a.normalize_advantages_std,
                d[sample.LOSS_MASK],
            )
        with self.tracer.span("train", step=step, n=len(batch)), self.lock:
            prox = self.exact_prox(d)
            if step < self.cfg.critic.critic_warmup and self.cfg.uses_critic:
                # --critic-warmup: the critic trains on the batch (it did when valuing it), the policy does
                # not; its version still counts the step, so versions stay rollout steps for staleness
                self.backend.version += 1
                metrics = {"train/critic_warmup": 1.0}
            else:
                metrics = {f"train/{k}": v for k, v in self.backend.train_step(d).items()}
        metrics.update(prox)
        return batch, metrics, t1
