"""The Actor role: the trainer.

It takes a rollout batch from the bus, updates the policy, publishes the new weights (straight to the
rollout in colocate mode, over DCS to the rollout and ActorFwd in fully-async mode), evaluates and logs;
one :meth:`ActorWorker.train` per step. What it computes on the side lives next to it: the exact proximal
policy (:mod:`.prox`), the step's metrics (:mod:`.metrics`) and checkpoints (:mod:`.actor_checkpoint`).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.metrics import MetricsService
from relax_core.role import Restart, RoleSpec, TrainerRecord
from relax_core.roles import TRAINER_CONSUMER
from relax_core.roofline import ModelShape, matmul_peak, step_roofline
from relax_core.sample import ADVANTAGES
from relax_core.sample_log import SampleLog
from relax_core.trace import Tracer
from relax_core.weight_audit import WeightAudit
from relax_core.weight_sync import Send, WeightPublisher
from relax_train.roles.actor_checkpoint import TrainerCheckpoints
from relax_train.roles.actor_step import StepTrainer
from relax_train.roles.base import DeviceTurns, set_threads
from relax_train.roles.metrics import step_metrics

if TYPE_CHECKING:
    from relax_bus import Bus


class ActorWorker(DeviceTurns):
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
        self.record = TrainerRecord()
        """What it trained and logged so far (the run's report and audits: :meth:`get_record`)."""
        self.weights = WeightPublisher(
            cfg.run,
            lambda: (self.backend.named_weights(), self.backend.version),
            send_weights,
            functools.partial(_log_checksum, self.record.weight_log, WeightAudit(cfg.run.output_dir, "actor"))
            if cfg.run.verify_weight_sync
            else None,
            alive=lambda: self.steps.alive(),  # (waiting for a broadcast at the fence is not a hang)
        )
        self.steps = StepTrainer(cfg, bus, self.backend, self.tracer, self.weights.lock)
        """The step on a batch: take, finish, train (:mod:`.actor_step`)."""
        self.checkpoints = TrainerCheckpoints(
            cfg, bus, self.backend, self.tracer, self.record, self.wait_weight_sync
        )
        """Save and load of its state, and the fully-async bus snapshot (:mod:`.actor_checkpoint`)."""
        self.out = Path(cfg.run.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        # metrics.jsonl, TensorBoard, W&B, ClearML: whichever the config asks for (relax_core.metrics)
        self.metrics = MetricsService.from_config(cfg, self.out)
        self.sample_log = SampleLog(self.out, cfg.run.log_samples)
        """Each step's samples for `relax ui` (``samples/step_<k>.jsonl``, from a background thread)."""
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

    def heartbeat(self) -> dict[str, Any]:
        """For the health manager: seconds since the trainer last made progress (or polled idle)."""
        return {
            "pid": os.getpid(),
            "age_s": time.monotonic() - self.steps.beat if self.steps.beat else 0.0,
            "version": self.backend.version,
        }

    def train(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        batch, metrics, t1 = self.steps.train(step, t0)
        d = batch.data
        self.record.trained_ids.extend(batch.ids)
        self.record.trained_prompts.append([str(p) for p in d.get(sample.PROMPT_ID, [])])
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
        if (sync := self.weights.last_sync) is not None:  # (DCS: with --weight-sync-delta, the deltas)
            metrics["perf/weight_sync_sent_bytes"] = float(sync.num_bytes)
            metrics["perf/weight_sync_broadcast_s"] = sync.seconds
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
        self.sample_log.write(step + 1, d)
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
            self.checkpoints.save_bus(saved)
        return metrics

    def run(self, start_step: int, num_steps: int) -> list[dict[str, Any]]:
        for step in range(start_step, num_steps):
            self.train(step)
            if self._stop_dir is not None and step + 1 < num_steps:  # asked to stop: checkpoint, end early
                self.interrupted_at = self.save(self._stop_dir)
                self.checkpoints.save_bus(self.interrupted_at)
                break
        self.wait_weight_sync()  # the last weights reach every receiver before the run reports done
        return self.record.history

    def save(self, path: str | None = None) -> str:
        """A checkpoint of this version under ``path`` (default ``--save``); its path."""
        return self.checkpoints.save(path)

    def load(self, path: str) -> dict[str, Any]:
        """Resume from a checkpoint; its ``version`` with its run state."""
        return self.checkpoints.load(path)

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
        self.record.history.append(metrics)
        self.metrics.log(metrics, metrics["step"])

    def progress(self) -> int:
        return self.backend.version

    def get_record(self) -> TrainerRecord:
        return self.record

    def get_spans(self) -> list[dict[str, Any]]:
        return self.tracer.get_spans()

    def close(self) -> None:
        self.weights.close()
        if callable(getattr(self.backend, "close", None)):  # a megatron rank group: stop its ranks
            self.backend.close()
        self.metrics.close()
        self.sample_log.close()


def _log_checksum(log: dict[int, str], audit: WeightAudit, named: list, version: int) -> None:
    """--verify-weight-sync: the checksum of each version as sent, for the run's audit (and on disk)."""
    from relax_core.dcs import checksum

    log[version] = checksum(named)
    audit.log(version, log[version])


def _cpu() -> bool:
    """Whether this process trains on the CPU (no CUDA device)."""
    import torch

    return not torch.cuda.is_available()
