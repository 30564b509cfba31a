"""The ActorFwd, Reference, Advantages and Actor roles.

Each role reads what it needs from the bus, writes what it computes back, and acknowledges; nothing
else connects the roles. The classes run in-process (colocate) or as Ray actors (fully async), where
:meth:`run` loops until the bus closes.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from relax_core.checkpoints import save_atomically
from relax_core.config import RelaxConfig
from relax_core.metrics import MetricsService
from relax_core.trace import Tracer
from relax_train.algorithms import compute_advantages
from relax_train.algorithms.advantages import BATCH_NORMALISED, finish_batch_advantages

logger = logging.getLogger(__name__)


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


class _DeviceTurns:
    """Colocate with ``--offload``: a role's device memory goes to host memory while the rollout engine
    generates, and comes back for its turn (the backend's ``offload`` / ``onload``)."""

    backend: Any
    tracer: Tracer

    def offload(self) -> int:
        with self.tracer.span("offload") as args:
            args["bytes"] = n = self.backend.offload()
        return n

    def onload(self) -> int:
        with self.tracer.span("onload") as args:
            args["bytes"] = n = self.backend.onload()
        return n


class _BusLoop:
    """Shared loop: take what is ready (partial batches), process, ack; stop when the bus closes."""

    consumer: str
    bus: Any
    batch_size: int = 64
    phase: str
    """The span name of :meth:`handle` in the run's trace."""
    tracer: Tracer

    _beat: float = 0.0
    _receiver: Any = None

    def heartbeat(self) -> dict[str, Any]:
        """For the health manager: seconds since the loop last made progress (or polled idle)."""
        return {"pid": os.getpid(), "age_s": time.monotonic() - self._beat if self._beat else 0.0}

    def process(self, timeout: float | None = 0.0) -> int:
        self._beat = time.monotonic()
        batch = self.bus.get(self.consumer, n=self.batch_size, partial=True, timeout=timeout)
        with self.tracer.span(self.phase, n=len(batch), partitions=",".join(sorted(set(batch.partitions)))):
            self.handle(batch)
        self.bus.ack(self.consumer, batch.lease_id)
        return len(batch)

    def drain(self) -> int:
        """Process everything ready now (colocate)."""
        from relax_bus import BusTimeout

        total = 0
        while True:
            try:
                total += self.process(timeout=0.0)
            except BusTimeout:
                return total

    def run(self) -> int:
        from relax_bus import BusClosed, BusTimeout, ConsumerReset

        total = 0
        self._beat = time.monotonic()
        while True:
            try:
                total += self.process(timeout=1.0)
            except (BusTimeout, ConsumerReset):  # (reset while alive: what it held comes back; get again)
                self._beat = time.monotonic()
                continue
            except BusClosed:
                return total

    def handle(self, batch) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_spans(self) -> list[dict[str, Any]]:
        return self.tracer.get_spans()


FORWARD_FIELDS = {"actor_fwd": "log_probs", "reference": "ref_log_probs", "teacher": "teacher_log_probs"}
"""Frozen forward roles and the bus field each writes: ActorFwd (latest trainer weights, the proximal
policy), Reference (the starting policy, for KL) and Teacher (another, possibly larger model, for on-policy
distillation; same tokenizer)."""


class ForwardWorker(_BusLoop, _DeviceTurns):
    """ActorFwd (proximal-policy log-probs with the latest trainer weights) or Reference (frozen)."""

    phase = "forward"

    def __init__(
        self,
        cfg: RelaxConfig,
        bus: Any,
        role: str,
        model_path: str,
        backend: Any = None,
        torch_threads: int | None = None,
    ) -> None:
        _set_threads(torch_threads)
        if role not in FORWARD_FIELDS:
            raise ValueError(f"ForwardWorker role must be one of {sorted(FORWARD_FIELDS)}, got {role!r}")
        self.cfg, self.bus, self.consumer = cfg, bus, role
        self.tracer = Tracer(role, cfg.run.trace)
        self.field = FORWARD_FIELDS[role]
        self.batch_size = cfg.train.micro_batch_size
        self.owns_backend = backend is None
        """False for ActorFwd in colocate mode, which computes with the trainer's own backend."""
        if backend is None:
            from relax_train.backends import build_backend

            backend = build_backend(
                cfg.train.train_backend, config=cfg, model_path=model_path, trainable=False
            )
        self.backend = backend
        if role == "teacher":  # another model: the student's recorded MoE routing (R3) does not apply to it
            self.backend.routing = None
        self._receiver = None
        self._weights_lock = threading.Lock()
        """Held by a forward pass and by a weight load: a forward never reads half-loaded weights."""

    def handle(self, batch) -> None:
        with self._weights_lock:  # (the receiver thread loads new weights only between two forwards)
            lp = self.backend.compute_log_probs(batch.data)
            version = self.backend.version
        self.bus.add_fields(batch.ids, {self.field: lp, f"{self.field}_version": [version] * len(lp)})

    def _load_weights(self, version: int, tensors: dict[str, Any]) -> None:
        with self._weights_lock:
            self.backend.load_weights(tensors, version)

    def connect_dcs(self, init_method: str, world_size: int, rank: int) -> None:
        """Join the trainer's weight broadcast; called again when the health manager re-forms the group."""
        from relax_core.dcs import WeightReceiver

        if self._receiver is not None:  # the old group lost a member: leave it
            self._receiver.close(timeout_s=5.0)
        self._receiver = WeightReceiver.for_run(self.cfg.run, init_method, world_size, rank)
        self._receiver.connect()
        self._receiver.start_background(self._load_weights)

    def wait_weights(self, version: int, timeout_s: float = 300.0) -> int:
        """Block until weights of ``version`` (or newer) are loaded: a restarted role must not compute
        with its start-up weights."""
        deadline = time.monotonic() + timeout_s
        while self.backend.version < version:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.consumer}: weights of version {version} did not arrive in {timeout_s}s"
                )
            time.sleep(0.02)
        return self.backend.version

    def close(self) -> None:
        """Leave the weight broadcast; close a backend that owns processes (a megatron rank group)
        unless it is the trainer's (ActorFwd in colocate shares it)."""
        if self._receiver is not None:
            self._receiver.close()
        if self.owns_backend and callable(getattr(self.backend, "close", None)):
            self.backend.close()


def kl_shaped_sequence_rewards(
    rewards, rollout_logp, ref_logp, beta: float, estimator: str, loss_masks=None
) -> np.ndarray:
    """KL in the reward for outcome-reward estimators: r - β·Σ_t kl_t per response, kl_t estimated from the
    behaviour (rollout) log-probs against the reference, over the model's own tokens (``loss_masks`` 1; a
    multi-turn response's environment tokens were not sampled by the policy and have rollout log-prob 0).
    With outcome rewards, the return at every token of per-token shaped rewards (InstructGPT Eq. 2) summed
    to the end; here the whole response's sum, since the estimators work on one scalar per response. Use
    k1 (the config refuses others here): in a reward only its expectation is KL(π || π_ref). numpy, like
    the estimators: this role needs no torch.

    >>> kl_shaped_sequence_rewards([1.0], [np.array([-1.0, -2.0])], [np.array([-1.0, -1.0])], 0.5, "k1").tolist()
    [0.5]
    """
    out = np.asarray(rewards, dtype=np.float64).copy()
    masks = loss_masks if loss_masks is not None else [None] * len(out)
    for i, (lp, ref, mask) in enumerate(zip(rollout_logp, ref_logp, masks)):
        d = np.asarray(lp, dtype=np.float64) - np.asarray(ref, dtype=np.float64)
        if estimator == "k1":
            kl = d
        elif estimator == "k2":
            kl = 0.5 * d * d
        elif estimator == "k3":
            e = np.clip(-d, -20.0, 20.0)
            kl = np.minimum(np.exp(e) - e - 1.0, 10.0)
        else:
            raise ValueError(f"unknown --kl-estimator {estimator!r}; available: ['k1', 'k2', 'k3']")
        if mask is not None:
            kl = kl * (np.asarray(mask, dtype=np.float64)[: len(kl)] > 0)
        out[i] -= beta * float(kl.sum())
    return out


def _per_sample(values: Any, n: int) -> bool:
    """Whether a batch field holds one value per sample (lists and arrays of the batch's length)."""
    return hasattr(values, "__len__") and not isinstance(values, (str, bytes, dict)) and len(values) == n


def rollout_metrics(d: dict[str, list]) -> dict[str, float]:
    """``rollout/*`` of one trained batch, from its samples' fields (both modes: the trainer logs them).

    Per rollout step values (``rollout_tokens_per_s``, dynamic sampling's counters) are repeated on that
    step's samples: averaged over the batch's samples. Multi-turn samples (``turns``) add the mean
    turns per episode and how many episodes ended for each reason (``rollout/stop/env_done``, ...)."""
    out = {
        "rollout/reward_mean": float(np.mean(d["reward"])),
        "rollout/response_len_mean": float(np.mean(d["response_len"])),
        "rollout/truncated_frac": float(np.mean([f == "length" for f in d["finish_reason"]])),
        "rollout/reward_failures": float(sum(bool(x) for x in d["reward_failure"])),
    }
    by_group: dict[str, list[float]] = {}
    for g, r in zip(d["group_id"], d["reward"]):
        by_group.setdefault(str(g), []).append(float(r))
    out["rollout/groups"] = float(len(by_group))
    # groups whose rewards are all equal: zero advantage, no gradient (what dynamic sampling removes)
    out["rollout/uninformative_groups"] = float(sum(max(v) == min(v) for v in by_group.values()))
    for key, name in (("ds_dropped_groups", None), ("ds_extra_rounds", None), ("ds_unfilled_groups", None),
                      ("rollout_tokens_per_s", "tokens_per_s")):  # fmt: skip
        values = [v for v in d.get(key, ()) if v is not None]
        if values:  # one value per rollout step, repeated on its samples
            out[f"rollout/{name or key}"] = float(np.mean(values))
    turns = [(t, f) for t, f in zip(d.get("turns", ()), d["finish_reason"]) if t is not None]
    if turns:
        out["rollout/turns_mean"] = float(np.mean([t for t, _ in turns]))
        for _, reason in turns:
            out[f"rollout/stop/{reason}"] = out.get(f"rollout/stop/{reason}", 0.0) + 1.0
    return out


def logp_absdiff(log_probs, rollout_log_probs, loss_masks=None) -> float | None:
    """Mean |ActorFwd's log-prob − the rollout's| over the batch's model tokens (loss mask 1: an environment
    token's rollout log-prob is 0, not the model's), each token weighing the same; None for a batch without
    one (all responses empty) rather than NaN. (The gap between π_prox and the rollout, policy lag
    included, is the backend's ``rollout_abs_logp_diff``.)"""
    masks = loss_masks if loss_masks is not None else [None] * len(log_probs)
    diffs = []
    for a, b, m in zip(log_probs, rollout_log_probs, masks):
        d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
        diffs.append(d if m is None else d[np.asarray(m)[: len(d)] > 0])
    flat = np.concatenate(diffs) if diffs else np.zeros(0)
    return float(flat.mean()) if flat.size else None


class AdvantagesWorker(_BusLoop):
    """Group-normalised advantages; CPU only, whole groups at a time."""

    phase = "advantages"

    def __init__(self, cfg: RelaxConfig, bus: Any) -> None:
        self.cfg, self.bus, self.consumer = cfg, bus, "advantages"
        self.tracer = Tracer("advantages", cfg.run.trace)
        self.batch_size = cfg.samples_per_rollout

    def handle(self, batch) -> None:
        d = batch.data
        a = self.cfg.algo
        rewards = d["reward"]
        fields: dict[str, Any] = {}
        if a.uses_reference and a.kl_in_reward:
            rewards = kl_shaped_sequence_rewards(
                d["reward"], d["rollout_log_probs"], d["ref_log_probs"], a.kl_coef, a.kl_reward_estimator,
                d["loss_mask"],
            )  # fmt: skip
            fields["shaped_reward"] = [float(r) for r in rewards]
        # (REINFORCE++'s whitening spans the trained batch: the trainer does it, see ActorWorker.train)
        fields["advantages"] = compute_advantages(
            a.advantage_estimator, d["group_id"], rewards, d["response_len"], a.normalize_advantages_std,
            batch_step=False,
        )  # fmt: skip
        self.bus.add_fields(batch.ids, fields)


class ActorWorker(_DeviceTurns):
    """The trainer: takes a rollout batch, updates the policy, publishes weights, evaluates, logs."""

    def __init__(
        self,
        cfg: RelaxConfig,
        bus: Any,
        model_path: str,
        eval_path: str | None = None,
        evaluator: str = "relax_rollout.evaluate:GreedyEvaluator",
        torch_threads: int | None = None,
    ) -> None:
        _set_threads(torch_threads)
        from relax_train.backends import build_backend

        self.cfg, self.bus = cfg, bus
        self.tracer = Tracer("actor", cfg.run.trace)
        self.backend = build_backend(
            cfg.train.train_backend, config=cfg, model_path=model_path, trainable=True
        )
        self.evaluate = None
        if eval_path is not None:
            module, _, attr = evaluator.partition(":")
            self.evaluate = getattr(importlib.import_module(module), attr)(cfg, model_path, eval_path)
        self.publish: Callable[[list, int], None] | None = None
        self._sender = None
        self.history: list[dict[str, Any]] = []
        self.weight_log: dict[int, str] = {}
        self.trained_ids: list[int] = []
        self._dcs_lock = threading.RLock()
        self._sync_pool: Any = None  # one background thread: the weight broadcast overlapping the next step
        self._inflight: Any = None  # that broadcast's future, until the fence has waited for it
        self._fence_wait_s = 0.0
        self.overlap = False
        """Publish from a background thread (DCS with ``overlap_weight_sync``); never in colocate mode,
        where the rollout generates with the new weights right after the step."""
        self.backend.before_update = self.wait_weight_sync
        self.trained_prompts: list[list[str]] = []
        """Prompt ids of every trained batch, one list per step (for audits: exact resume, restarts)."""
        self.out = Path(cfg.run.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        # metrics.jsonl, TensorBoard, W&B, ClearML: whichever the config asks for (relax_core.metrics)
        self.metrics = MetricsService.from_config(cfg, self.out)
        self.required = ["advantages"]
        if cfg.algo.use_actor_fwd:
            self.required.append("log_probs")
        if cfg.algo.uses_reference and cfg.algo.use_kl_loss:
            self.required.append("ref_log_probs")

    # -- weights -------------------------------------------------------------------------------
    def connect_dcs(self, init_method: str, world_size: int, republish: bool = False) -> int:
        """Open the weight broadcast to ``world_size - 1`` receivers. The health manager calls it again
        after a role restarted (``republish``: send the current weights at once, so the newcomer and
        anyone who missed a broadcast catch up). Returns the version the receivers will hold."""
        from relax_core.dcs import WeightSender

        with self._dcs_lock:  # no training-step broadcast in between: it would race the re-send
            if self._sender is not None:  # a member died: drop the old group without the handshake
                self._sender.abandon()
                self.wait_weight_sync()  # (a broadcast in flight on the old group fails; counted)
            self._sender = WeightSender.for_run(self.cfg.run, init_method, world_size)
            self._sender.connect()
            self.publish = lambda named, v: self._sender.broadcast(named, v)
            self.overlap = self.cfg.run.overlap_weight_sync
            if republish:
                self.publish_weights()
            return self.backend.version

    dcs_failures = 0
    """Broadcasts that failed because a receiver died (the health manager re-forms the group)."""

    def publish_weights(self) -> None:
        """Send the current weights (their version: the steps trained) to every receiver: in colocate
        mode straight to the rollout; over DCS from a background thread when overlapping, which the
        next step's optimizer waits for (:meth:`wait_weight_sync`) before it writes the weights again."""
        named = self.backend.named_weights()
        if self.cfg.run.verify_weight_sync:
            from relax_core.dcs import checksum

            self.weight_log[self.backend.version] = checksum(named)
        if self.publish is None:
            return
        with self._dcs_lock:
            self.wait_weight_sync()  # one broadcast at a time, in version order
            last = self._sender.last_version if self._sender is not None else None
            if last is not None and self.backend.version <= last:
                return  # this group has these weights already (sent when it was formed)
            if self.overlap:
                from concurrent.futures import ThreadPoolExecutor

                if self._sync_pool is None:
                    self._sync_pool = ThreadPoolExecutor(1, thread_name_prefix="relax-dcs-sender")
                # the weights are read by that thread until the fence (before the next optimizer step)
                self._inflight = self._sync_pool.submit(self.publish, named, self.backend.version)
                return
            try:
                self.publish(named, self.backend.version)
            except RuntimeError as e:
                self._broadcast_failed(e)

    def _broadcast_failed(self, exc: RuntimeError) -> None:
        if not self.cfg.run.health:
            raise exc
        # a receiver died mid-broadcast: train on; the health manager restarts it, re-forms the group and
        # has these weights sent again
        self.dcs_failures += 1

    def wait_weight_sync(self) -> float:
        """The fence: wait for the weight broadcast in flight, if any (the backend calls it before its
        optimizer writes the weights that broadcast reads). Returns the seconds waited."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            fut.result()
        except RuntimeError as e:
            self._broadcast_failed(e)
        waited = time.perf_counter() - t0
        self._fence_wait_s += waited
        return waited

    # -- one step ------------------------------------------------------------------------------
    def _exact_prox(self, d: dict[str, Any]) -> dict[str, float]:
        """Make ``log_probs`` (π_prox, what decoupled PPO and TIS correct towards and the ratio is clipped
        against) the trainer's policy at this step, as AReaL and slime have it.

        ActorFwd computes a sample's log-probs when it lands on the bus, with the weights it holds then;
        in fully-async mode the trainer has often moved on by the time it trains on it (the sample's
        ``log_probs_version`` is behind), and π_prox could even equal the behaviour policy, so decoupled
        PPO corrected nothing. For a sample whose version differs from the trainer's:
        - in the batch's first optimizer step (every sample, with the default --global-batch-size), π_prox
          is the training forward's own log-probs, detached (``prox_from_forward``): that forward runs
          with exactly the weights before the update, so this costs nothing;
        - in a later optimizer step, the weights have moved by then: its log-probs are recomputed here,
          with the weights before this step's update.
        The others keep ActorFwd's work. In colocate mode ActorFwd computes with the trainer's own model:
        nothing is stale."""
        if "log_probs_version" not in d or "log_probs" not in d:
            return {}
        if not self.cfg.algo.exact_proximal_policy:
            lag = max((self.backend.version - int(v) for v in d["log_probs_version"]), default=0)
            return {"train/prox_lag_max": float(lag), "train/actor_fwd_lag_max": float(lag)}
        now = self.backend.version
        versions = [int(v) for v in d["log_probs_version"]]
        stale = [i for i, v in enumerate(versions) if v != now]
        out = {
            "train/actor_fwd_lag_max": float(max((now - v for v in versions), default=0)),
            "train/prox_recomputed_frac": 0.0,
            "train/prox_from_forward_frac": 0.0,
        }
        if stale:
            n = len(versions)
            first = min(self.cfg.effective_global_batch_size, n)  # the first optimizer step's samples
            later = [i for i in stale if i >= first]
            d["log_probs"], d["log_probs_version"] = list(d["log_probs"]), list(d["log_probs_version"])
            if later:
                sub = {k: [vals[i] for i in later] for k, vals in d.items() if _per_sample(vals, n)}
                for i, lp in zip(later, self.backend.compute_log_probs(sub)):
                    d["log_probs"][i] = lp
            stale_set = set(stale)
            d["prox_from_forward"] = [i < first and i in stale_set for i in range(n)]
            for i in stale:
                d["log_probs_version"][i] = now
            out["train/prox_recomputed_frac"] = len(later) / n
            out["train/prox_from_forward_frac"] = (len(stale) - len(later)) / n
        # (0 by construction; logged so a run shows it)
        out["train/prox_lag_max"] = float(max((now - int(v) for v in d["log_probs_version"]), default=0))
        return out

    _beat: float = 0.0

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
                    "actor_train",
                    n=self.cfg.samples_per_rollout,
                    fields=None,
                    trainer_version=step,
                    timeout=1.0,
                )
            except (BusTimeout, ConsumerReset):
                continue

    def train(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        with self.tracer.span("wait_for_data", step=step):
            batch = self._take_batch(step)
        t1 = time.perf_counter()
        d = batch.data
        if self.cfg.algo.advantage_estimator in BATCH_NORMALISED:  # whitened over the batch trained on
            a = self.cfg.algo
            d["advantages"] = finish_batch_advantages(a.advantage_estimator, d["advantages"], a.normalize_advantages_std)
        # the lock: a re-formed DCS group re-sends the weights between steps, never mid-update
        with self.tracer.span("train", step=step, n=len(batch)), self._dcs_lock:
            prox = self._exact_prox(d)
            metrics = {f"train/{k}": v for k, v in self.backend.train_step(d).items()}
        metrics.update(prox)
        self.trained_ids.extend(batch.ids)
        self.trained_prompts.append([str(p) for p in d.get("prompt_id", [])])
        t2 = time.perf_counter()
        with self.tracer.span("weight_sync", step=step):
            self.publish_weights()
            if self.backend.version > self.bus.trainer_version:  # (a restarted trainer re-does a step)
                self.bus.set_trainer_version(self.backend.version)
        t3 = time.perf_counter()
        fence_wait_s, self._fence_wait_s = self._fence_wait_s, 0.0
        staleness = [step - int(v) for v in d["policy_version"]]
        metrics.update(rollout_metrics(d))
        metrics.update(
            {
                "step": step + 1,
                "train/staleness_mean": float(np.mean(staleness)),
                "train/staleness_max": float(np.max(staleness)),
                "perf/wait_for_data_s": t1 - t0,
                "perf/train_s": t2 - t1,
                "perf/weight_sync_s": t3 - t2,
                # the time this step's optimizer waited for the previous step's overlapped broadcast
                "perf/weight_sync_wait_s": fence_wait_s,
                "perf/samples": float(len(batch)),
                "time": time.time(),
            }
        )
        if "log_probs" in d:
            diff = logp_absdiff(d["log_probs"], d["rollout_log_probs"], d.get("loss_mask"))
            if diff is not None:
                metrics["train/rollout_vs_fwd_logp_absdiff"] = diff
        if (
            self.evaluate is not None
            and self.cfg.run.eval_interval
            and (step + 1) % self.cfg.run.eval_interval == 0
        ):
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
        self.bus.ack("actor_train", batch.lease_id)
        if saved is not None:
            self.save_bus(saved)
        return metrics

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

    def attach_rollout(self, rollout: Any) -> None:
        """Fully async: checkpoints ask the rollout actor for its data position at the trainer's version."""
        self._rollout = rollout
        self.save_extra = lambda v: {"data": self.data_state(v)}

    def data_state(self, step: int) -> dict:
        return self.data_states([step])[step]

    def data_states(self, steps: list[int]) -> dict[int, dict]:
        """Where the rollout's prompts stood when each rollout step began: from the rollout journal (read
        once) when there is one — the rollout role may be down and restarting —, else from the rollout
        actor."""
        import ray

        journal = self.out / "rollout_journal.jsonl"
        out: dict[int, dict] = {}
        if journal.is_file():
            for line in journal.read_text().splitlines():
                e = json.loads(line) if line.strip() else {}
                if e.get("begin") in steps:
                    out[int(e["begin"])] = e["state"]  # the latest entry of a step wins
        deadline = time.monotonic() + 300.0
        for step in (s for s in steps if s not in out):
            while step not in out:
                try:
                    out[step] = ray.get(self._rollout.data_state.remote(step), timeout=60)
                except Exception:  # the rollout role is down: the health manager restarts and re-attaches it
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        return out

    def save_bus(self, checkpoint: str) -> None:
        """Fully async: put the bus (samples generated and not trained yet) into the checkpoint, with the
        rollout step that comes after them and where its prompts start, so a resumed run trains those
        samples instead of generating them again. Called after the step's batch is acked, so the snapshot
        never holds a trained sample; a checkpoint without it resumes by drawing those prompts again."""
        if getattr(self, "_rollout", None) is None:
            return
        from relax_bus import snapshot

        path = Path(checkpoint) / "bus"
        with self.tracer.span("save_bus", version=self.backend.version):
            self.bus.snapshot(path)
            steps = [int(x["fields"]["rollout_step"]) for x in snapshot.read(path)["samples"]]
            nxt = max([self.backend.version, *(s + 1 for s in steps)])
            # where each rollout step from the trainer's version on began: the resumed run's journal
            begun = {
                str(k): v for k, v in self.data_states(list(range(self.backend.version, nxt + 1))).items()
            }
            resume = {"next_step": nxt, "data": begun[str(nxt)], "begun": begun}
            (Path(checkpoint) / "bus_resume.json").write_text(json.dumps(resume))

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

    save_extra = None
    """Set by the Controller: version -> extra checkpoint state from other roles (the rollout's data position)."""

    def save(self, path: str | None = None) -> str:
        target = Path(path or self.cfg.train.save) / f"step_{self.backend.version:06d}"
        # what was trained so far, so a restarted trainer (and the audit) carries on from here
        extra: dict[str, Any] = {
            "trained_ids": list(self.trained_ids),
            "trained_prompts": self.trained_prompts,
        }
        if self.save_extra is not None:
            extra.update(self.save_extra(self.backend.version))
        with self.tracer.span("save", version=self.backend.version):  # whole, or not there (a kill mid-save)
            save_atomically(target, lambda tmp: self.backend.save_checkpoint(tmp, extra=extra))
        return str(target)

    def load(self, path: str) -> dict[str, Any]:
        """Resume from a checkpoint; returns its metadata (``version``: the step to continue from).

        The trained ids and prompts come back from the checkpoint and the history from this run's
        metrics.jsonl (rows up to the checkpoint's step): a restarted trainer reports the whole run."""
        self.wait_weight_sync()  # (no broadcast may be reading the weights the checkpoint overwrites)
        meta = self.backend.load_checkpoint(path)
        v = int(meta["version"])
        if isinstance(meta.get("trained_ids"), list):
            self.trained_ids = [int(i) for i in meta["trained_ids"]]
            self.trained_prompts = [list(p) for p in meta.get("trained_prompts", [])]
        log = self.out / "metrics.jsonl"
        if log.is_file() and not self.history:
            rows = _json_lines(log)
            kept: dict[tuple, dict] = {}
            for r in rows:  # the latest row per (step, kind): a re-done step replaces the lost one
                if int(r.get("step", -1)) <= v:
                    kept[(int(r["step"]), "rollout/reward_mean" in r)] = r
            self.history = [kept[k] for k in sorted(kept)]
        return meta

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
        self.wait_weight_sync()
        if self._sync_pool is not None:
            self._sync_pool.shutdown()
        if self._sender is not None:
            self._sender.close()
        if callable(getattr(self.backend, "close", None)):  # a megatron rank group: stop its ranks
            self.backend.close()
        self.metrics.close()


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; a line that does not parse (the last one, torn by a kill mid-write)
    is left out with a warning naming it, instead of stopping the resume."""
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            logger.warning("%s line %d is not JSON (torn by a kill mid-write?): left out", path, n)
    return rows
