"""The Actor role: the trainer.

It takes a rollout batch from the bus, updates the policy, publishes the new weights (straight to the
rollout in colocate mode, over DCS to the rollout and ActorFwd in fully-async mode), evaluates and logs;
one :meth:`ActorWorker.train` per step. What it computes on the side lives next to it: the exact proximal
policy (:mod:`.prox`), the step's metrics (:mod:`.metrics`) and checkpoints (:mod:`.actor_checkpoint`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.metrics import MetricsService
from relax_core.role import Restart, RoleSpec
from relax_core.roles import TRAINER_CONSUMER
from relax_core.roofline import ModelShape, matmul_peak, step_roofline
from relax_core.sample import ADVANTAGES
from relax_core.trace import Tracer
from relax_core.weight_sync import Send, WeightPublisher
from relax_train.algorithms.advantages import BATCH_NORMALISED, finish_batch_advantages
from relax_train.roles.actor_checkpoint import ActorCheckpoints
from relax_train.roles.base import DeviceTurns, set_threads
from relax_train.roles.metrics import step_metrics
from relax_train.roles.prox import exact_prox
from relax_train.roles.stream import Taken, streams_training, train_as_it_arrives

if TYPE_CHECKING:
    from relax_bus import Bus


class ActorWorker(ActorCheckpoints, DeviceTurns):
    """The trainer: takes a rollout batch, updates the policy, publishes weights, evaluates, logs."""

    @classmethod
    def spec(cls, cfg: RelaxConfig, name: str) -> RoleSpec:
        """Whole groups with their advantages (and what the roles feeding the trainer write: the plan adds
        it); a restart resumes from the latest checkpoint and re-forms the weight broadcast."""
        return RoleSpec(
            name,
            part="trainer",
            needs=(ADVANTAGES,),
            sampler="group",
            model="policy",
            restart=(Restart.CHECKPOINT, Restart.WEIGHTS),
        )

    def __init__(
        self,
        cfg: RelaxConfig,
        bus: Bus,
        model_path: str,
        eval_path: str | None = None,
        evaluator: Callable[[RelaxConfig, str, str], Callable[[Any], float]] | None = None,
        torch_threads: int | None = None,
        send_weights: Send | None = None,
    ) -> None:
        """``evaluator(cfg, model_path, eval_path)``: builds the held-out evaluation run on ``eval_path``
        (the run passes the registered one, :data:`relax_core.roles.EVALUATOR`). ``send_weights(named,
        version)``: where each new version goes in colocate mode (the run passes the rollout's loader);
        fully async, the health manager opens a DCS broadcast (:meth:`connect_dcs`)."""
        set_threads(torch_threads)
        from relax_train.backends import build_backend

        self.cfg, self.bus = cfg, bus
        self.tracer = Tracer("actor", cfg.run.trace)
        # the fence: the optimizer waits there for a weight broadcast still reading the weights
        self.backend = build_backend(
            cfg.train.train_backend,
            before_update=self.wait_weight_sync,
            config=cfg,
            model_path=model_path,
            trainable=True,
        )
        self.evaluate = None
        if eval_path is not None:
            if evaluator is None:
                raise ValueError(
                    f"eval_path={eval_path!r} needs an evaluator: pass evaluator= (a run passes the one "
                    "installed under the relax.evaluators entry points; relax-rollout registers `greedy`)"
                )
            self.evaluate = evaluator(cfg, model_path, eval_path)
        self.weight_log: dict[int, str] = {}
        self.weights = WeightPublisher(
            cfg.run,
            lambda: (self.backend.named_weights(), self.backend.version),
            send_weights,
            self._log_weights if cfg.run.verify_weight_sync else None,
        )
        self.history: list[dict[str, Any]] = []
        self.trained_ids: list[int] = []
        self.trained_prompts: list[list[str]] = []
        """Prompt ids of every trained batch, one list per step (for audits: exact resume, restarts)."""
        self.out = Path(cfg.run.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        # metrics.jsonl, TensorBoard, W&B, ClearML: whichever the config asks for (relax_core.metrics)
        self.metrics = MetricsService.from_config(cfg, self.out)
        self._shape = ModelShape.from_checkpoint(model_path)  # (None: no FLOP figures, nothing else lost)
        self.peak = matmul_peak(cfg.run.num_cpus or os.cpu_count() or 1) if self._shape and _cpu() else None
        """The machine's matmul peak (probed once per machine, cached): MFU is a share of the whole machine.
        None on a GPU machine: the probe measures the CPU (a GPU's peak is not probed: FLOPs only there)."""

    # -- weights (relax_core.weight_sync) --------------------------------------------------------
    def connect_dcs(self, init_method: str, world_size: int, republish: bool = False) -> int:
        """Open the weight broadcast to ``world_size - 1`` receivers. The health manager calls it again
        after a role restarted (``republish``: send the current weights at once, so the newcomer and
        anyone who missed a broadcast catch up). Returns the version the receivers will hold."""
        self.weights.connect_dcs(init_method, world_size, republish)
        return self.backend.version

    def publish_weights(self) -> None:
        """Send the current weights (their version: the steps trained) to every receiver: in colocate
        mode straight to the rollout; over DCS from a background thread when overlapping, which the
        next step's optimizer waits for (:meth:`wait_weight_sync`) before it writes the weights again."""
        self.weights.publish()

    def wait_weight_sync(self) -> float:
        """The fence: wait for the weight broadcast in flight, if any (the backend calls it before its
        optimizer writes the weights that broadcast reads). Returns the seconds waited."""
        return self.weights.fence()

    @property
    def dcs_failures(self) -> int:
        """Broadcasts that failed because a receiver died (the health manager re-forms the group)."""
        return self.weights.failures

    def _log_weights(self, named: list, version: int) -> None:
        from relax_core.dcs import checksum

        self.weight_log[version] = checksum(named)

    # -- one step ------------------------------------------------------------------------------
    def _exact_prox(self, d: dict[str, Any]) -> dict[str, float]:
        """π_prox at this step's weights for samples ActorFwd scored with older ones (:func:`.prox.exact_prox`)."""
        return exact_prox(self.cfg, self.backend, d)

    _beat: float = 0.0

    def _alive(self) -> None:
        """Mark progress (or an idle poll) for :meth:`heartbeat`."""
        self._beat = time.monotonic()

    def heartbeat(self) -> dict[str, Any]:
        """For the health manager: seconds since the trainer last made progress (or polled idle)."""
        return {
            "pid": os.getpid(),
            "age_s": time.monotonic() - self._beat if self._beat else 0.0,
            "version": self.backend.version,
        }

    def _take_batch(self, step: int):
        from relax_bus import BusTimeout, ConsumerReset

        while True:  # poll, so the heartbeat shows a live trainer while it waits for data
            self._beat = time.monotonic()
            try:
                return self.bus.get(
                    TRAINER_CONSUMER,
                    n=self.cfg.samples_per_rollout,
                    fields=None,
                    trainer_version=step,
                    timeout=1.0,
                    # streaming rollout puts later steps' groups while step k's tail generates: take step k
                    partition=f"step{step}" if self.cfg.rollout.streaming_rollout else None,
                )
            except (BusTimeout, ConsumerReset):
                continue

    def train(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        if streams_training(self.cfg, self.backend):  # streaming rollout: parts as they arrive
            batch, metrics, waited = train_as_it_arrives(
                step,
                cfg=self.cfg,
                bus=self.bus,
                backend=self.backend,
                tracer=self.tracer,
                lock=self.weights.lock,
                exact_prox=self._exact_prox,
                alive=self._alive,
            )
            t1, d = t0 + waited, batch.data
        else:
            batch, metrics, t1 = self._train_whole(step)
            d = batch.data
        self.trained_ids.extend(batch.ids)
        self.trained_prompts.append([str(p) for p in d.get("prompt_id", [])])
        t2 = time.perf_counter()
        with self.tracer.span("weight_sync", step=step):
            self.publish_weights()
            if self.backend.version > self.bus.trainer_version:  # (a restarted trainer re-does a step)
                self.bus.set_trainer_version(self.backend.version)
        t3 = time.perf_counter()
        fence_wait_s, self.weights.fence_wait_s = self.weights.fence_wait_s, 0.0
        metrics.update(
            step_metrics(
                d,
                step,
                len(batch),
                wait_for_data_s=t1 - t0,
                train_s=t2 - t1,
                weight_sync_s=t3 - t2,
                weight_sync_wait_s=fence_wait_s,
                taken_at=batch.taken_at,
            )
        )
        metrics["perf/weight_sync_bytes"] = float(self.weights.published_bytes)
        if self._shape is not None:
            metrics.update(step_roofline(self._shape, d, t2 - t1, self.peak))
        interval = self.cfg.run.eval_interval
        # the run's last step evaluates here too: the final accuracy is this step's line, not a second line
        # of the same step (metrics.jsonl had steps 0, 1, 2, 3, 3)
        last = step + 1 == self.cfg.train.num_rollout
        if self.evaluate is not None and ((interval and (step + 1) % interval == 0) or last):
            with self.tracer.span("eval", step=step + 1):
                metrics["eval/accuracy"] = self.evaluate(self.backend.eval_model())
        # the bus's own counters next to the roles' (per-partition depths left out: one series per step)
        metrics.update({k: v for k, v in self.bus.metrics().items() if not k.startswith("bus/depth/")})
        self.log(metrics)
        if (
            self.cfg.train.save
            and self.cfg.train.save_interval
            and (step + 1) % self.cfg.train.save_interval == 0
        ):
            saved = self.save()
        else:
            saved = None
        # ack last: if this process dies before, the batch comes back, unless the checkpoint above
        # already holds it (the health manager acks what a restarted trainer's checkpoint covers)
        for lease_id in batch.lease_ids:
            self.bus.ack(TRAINER_CONSUMER, lease_id)
        if saved is not None:
            self.save_bus(saved)
        return metrics

    def _train_whole(self, step: int) -> tuple[Taken, dict[str, Any], float]:
        """One step on a whole batch taken from the bus: the batch, its metrics, and when it was taken."""
        with self.tracer.span("wait_for_data", step=step):
            got = self._take_batch(step)
        t1 = time.perf_counter()
        batch = Taken(got.ids, got.data, [got.lease_id], [time.time()] * len(got.ids))
        d = batch.data
        if self.cfg.algo.advantage_estimator in BATCH_NORMALISED:  # whitened over the batch trained on
            a = self.cfg.algo
            d[sample.ADVANTAGES] = finish_batch_advantages(
                a.advantage_estimator,
                d[sample.ADVANTAGES],
                a.normalize_advantages_std,
                d[sample.LOSS_MASK],
            )
        # the lock: a re-formed DCS group re-sends the weights between steps, never mid-update
        with self.tracer.span("train", step=step, n=len(batch)), self.weights.lock:
            prox = self._exact_prox(d)
            if step < self.cfg.critic.critic_warmup and self.cfg.uses_critic:
                metrics = self._critic_warmup()
            else:
                metrics = {f"train/{k}": v for k, v in self.backend.train_step(d).items()}
        metrics.update(prox)
        return batch, metrics, t1

    def _critic_warmup(self) -> dict[str, float]:
        """A step of --critic-warmup: the critic trains on the batch (it did when valuing it), the policy
        does not; its version still counts the step, so versions stay rollout steps for staleness."""
        self.backend.version += 1
        return {"train/critic_warmup": 1.0}

    def run(self, start_step: int, num_steps: int) -> list[dict[str, Any]]:
        for step in range(start_step, num_steps):
            self.train(step)
            if self._stop_dir is not None and step + 1 < num_steps:  # asked to stop: checkpoint, end early
                self.interrupted_at = self.save(self._stop_dir)
                self.save_bus(self.interrupted_at)
                break
        self.wait_weight_sync()  # the last weights reach every receiver before the run reports done
        return self.history

    _stop_dir: str | None = None
    interrupted_at: str | None = None

    def request_stop(self, checkpoint_dir: str) -> None:
        """Fully async: finish the current step, write a checkpoint under ``checkpoint_dir``, stop."""
        self._stop_dir = checkpoint_dir

    def get_interrupted(self) -> str | None:
        return self.interrupted_at

    # -- bookkeeping ---------------------------------------------------------------------------
    def eval_now(self, step: int) -> float | None:
        if self.evaluate is None:
            return None
        with self.tracer.span("eval", step=step):
            acc = self.evaluate(self.backend.eval_model())
        self.log({"step": step, "eval/accuracy": acc, "time": time.time()})
        return acc

    def log(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        self.metrics.log(metrics, metrics["step"])

    def progress(self) -> int:
        return self.backend.version

    def get_history(self) -> list[dict[str, Any]]:
        return self.history

    def get_weight_log(self) -> dict[int, str]:
        return dict(self.weight_log)

    def get_trained_ids(self) -> list[int]:
        return list(self.trained_ids)

    def get_trained_prompts(self) -> list[list[str]]:
        return [list(p) for p in self.trained_prompts]

    def get_spans(self) -> list[dict[str, Any]]:
        return self.tracer.get_spans()

    def close(self) -> None:
        self.weights.close()
        if callable(getattr(self.backend, "close", None)):  # a megatron rank group: stop its ranks
            self.backend.close()
        self.metrics.close()


def _cpu() -> bool:
    """Whether this process trains on the CPU (no CUDA device)."""
    import torch

    return not torch.cuda.is_available()
