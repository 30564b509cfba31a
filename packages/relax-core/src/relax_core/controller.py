"""The Controller: builds the roles and runs the RL loop in colocate or fully-async mode.

Roles are named in a plain registry of dotted paths and imported when built, so relax-core itself
depends on neither torch nor the rollout/train packages. In colocate mode the roles run in this process
and take turns; in fully-async mode each role is a Ray actor running its own loop, and the only things
connecting them are the bus (data) and DCS (weights).
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_core.async_run import AsyncRun
from relax_core.checkpoints import latest_checkpoint
from relax_core.config import RelaxConfig
from relax_core.notify import Notifier
from relax_core.optional import import_ray
from relax_core.trace import write_trace

ROLES: dict[str, str] = {
    "rollout": "relax_rollout.worker:RolloutWorker",
    "actor": "relax_train.workers:ActorWorker",
    "forward": "relax_train.workers:ForwardWorker",
    "advantages": "relax_train.workers:AdvantagesWorker",
}


def role_class(name: str) -> type:
    module, _, attr = ROLES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass
class RunInputs:
    model_path: str
    prompt_path: str
    eval_path: str | None = None
    ref_model_path: str | None = None
    teacher_model_path: str | None = None


@dataclass
class RunResult:
    history: list[dict[str, Any]]
    wall_s: float
    rl_wall_s: float
    samples: int
    mode: str
    max_staleness: int
    rollout_stats: dict[str, Any] = field(default_factory=dict)
    bus_stats: dict[str, Any] = field(default_factory=dict)
    audit: dict[str, Any] = field(default_factory=dict)
    """Per-consumer consumed ids, trained ids, weight checksums per version (for tests)."""
    trace_path: str | None = None
    """The run's Chrome-trace timeline (--trace), else None."""

    @property
    def eval_curve(self) -> list[tuple[int, float]]:
        return [(int(h["step"]), float(h["eval/accuracy"])) for h in self.history if "eval/accuracy" in h]


def bus_config(cfg: RelaxConfig):
    from relax_bus import BusConfig, ConsumerSpec

    a = cfg.algo
    # KL in the reward: advantages wait for the reference log-probs; KL as a loss: the trainer does
    adv_fields = ["reward", "ref_log_probs"] if a.uses_reference and a.kl_in_reward else ["reward"]
    # (the KL in the reward counts the model's tokens only: loss_mask, written with the sample)
    consumers = {"advantages": ConsumerSpec(required_fields=adv_fields, sampler="group")}
    required = ["advantages"]
    if a.use_actor_fwd:
        consumers["actor_fwd"] = ConsumerSpec(required_fields=["tokens"], sampler="in_order")
        required.append("log_probs")
    if a.uses_reference:
        consumers["reference"] = ConsumerSpec(required_fields=["tokens"], sampler="in_order")
        if a.use_kl_loss:
            required.append("ref_log_probs")
    if cfg.uses_teacher:
        consumers["teacher"] = ConsumerSpec(required_fields=["tokens"], sampler="in_order")
        required.append("teacher_log_probs")
    consumers["actor_train"] = ConsumerSpec(required_fields=required, sampler="group", enforce_staleness=True)
    return BusConfig(
        consumers=consumers,
        capacity=max(cfg.run.bus_capacity, cfg.samples_per_rollout),
        max_staleness=cfg.run.max_staleness,
        staleness_policy=cfg.run.staleness_policy,
        group_size=cfg.rollout.n_samples_per_prompt,
    )


def _offloads(cfg: RelaxConfig) -> bool:
    """Colocate: whether rollout and training hand the devices to each other (--offload; default: when
    CUDA is available)."""
    if cfg.run.offload is not None:
        return cfg.run.offload
    import torch

    return torch.cuda.is_available()


def _start_ray(cfg: RelaxConfig) -> bool:
    """Ray for the run: the running cluster that ``RAY_ADDRESS`` names (several nodes: ``ray start`` on
    each, then ``RAY_ADDRESS=<head>:6379 relax train ...`` on the head), else a local cluster started here,
    unless this process is connected already. True when this call connected (the run disconnects at the
    end; a cluster started here stops with it, one started with ``ray start`` keeps running)."""
    ray = import_ray("--fully-async (and a megatron trainer of several ranks)")
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:  # the nodes' CPUs and GPUs were set by `ray start`; Ray refuses num_cpus here
        if cfg.run.num_cpus is not None:
            raise ValueError(
                f"--num-cpus sizes the local Ray cluster a run starts, but RAY_ADDRESS={address} connects to a "
                "running one (its nodes' CPUs are set by `ray start --num-cpus`): drop one of them"
            )
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return True
    ray.init(
        address="local",  # a new cluster even where `ray start` left one (RAY_ADDRESS chooses that one)
        num_cpus=cfg.run.num_cpus or os.cpu_count(),
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
    return True


def _start_ray_for_ranks(cfg: RelaxConfig) -> bool:
    """Colocate with a megatron trainer of several ranks: ranks 1..N-1 are Ray actors, so connect to Ray
    (see :func:`_start_ray`)."""
    t = cfg.train
    if t.train_backend != "megatron" or t.actor_num_nodes * t.actor_num_gpus_per_node <= 1:
        return False
    return _start_ray(cfg)


class Controller:
    def __init__(self, cfg: RelaxConfig, inputs: RunInputs) -> None:
        # absolute paths: Ray workers do not share our working directory
        absolute = {k: os.path.abspath(v) if isinstance(v, str) else v for k, v in vars(inputs).items()}
        run = cfg.run.model_copy(update={"output_dir": os.path.abspath(cfg.run.output_dir)})
        train = cfg.train.model_copy(
            update={
                k: os.path.abspath(v) for k in ("save", "load") if isinstance(v := getattr(cfg.train, k), str)
            }
        )
        self.cfg = cfg.model_copy(update={"run": run, "train": train})
        self.inputs = RunInputs(**absolute)
        self.interrupted_at: str | None = None
        """The checkpoint written when a signal stopped the run early (None: it ran to the end)."""
        self.async_run: AsyncRun | None = None
        """Fully async: the running roles and their supervision (tests inject faults through it)."""
        self._stop = _StopOnSignal()

    def request_stop(self) -> None:
        """Stop the run after the current step, with a checkpoint, as SIGTERM does: for code that drives a
        run from another thread (a notebook, a scheduler's pre-emption hook, a test) and must not signal
        its whole process (``ray.init`` leaves its own SIGTERM handler behind, which exits)."""
        self._stop.requested = True

    def run(self) -> RunResult:
        cfg = self.cfg
        notifier = Notifier(cfg.run.notify_urls, run_name=Path(cfg.run.output_dir).name)
        notifier.start(
            {
                "mode": cfg.run.mode
                + (f" (max staleness {cfg.run.max_staleness})" if cfg.run.max_staleness else ""),
                "steps": cfg.train.num_rollout,
                "samples per step": cfg.samples_per_rollout,
                "model": self.inputs.model_path,
                "output": cfg.run.output_dir,
            }
        )
        try:
            if cfg.uses_teacher:
                self._check_teacher_tokenizer()
            result = self._run_colocate() if cfg.run.mode == "colocate" else self._run_fully_async(notifier)
        except BaseException as exc:
            notifier.failure(exc)
            raise
        notifier.finish(result)
        return result

    def _write_trace(self, role_spans: list[list[dict[str, Any]]]) -> str:
        path = write_trace(
            Path(self.cfg.run.output_dir) / "trace.json", [s for spans in role_spans for s in spans]
        )
        return str(path)

    def _check_teacher_tokenizer(self) -> None:
        """Distillation compares log-probs token by token: the teacher must read the same token ids."""
        from transformers import AutoTokenizer

        student, teacher = self.inputs.model_path, self._teacher_path()
        a, b = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
        if a.get_vocab() != b.get_vocab():
            raise ValueError(
                f"--teacher-checkpoint {teacher} has a different tokenizer from the policy {student} "
                f"({len(b)} vs {len(a)} tokens); on-policy distillation compares log-probs token by token, "
                "so both must share one tokenizer"
            )

    # -- colocate ------------------------------------------------------------------------------
    def _run_colocate(self) -> RunResult:
        ray_started = _start_ray_for_ranks(self.cfg)
        built: list[Any] = []
        try:
            return self._colocate(built)
        finally:  # the engines' processes, a megatron rank group (the trainer's, closed last), Ray
            for role in reversed(built):
                if callable(getattr(role, "close", None)):
                    role.close()
            if ray_started:
                import ray

                ray.shutdown()

    def _colocate(self, built: list[Any]) -> RunResult:
        from relax_bus import DataBus

        cfg, inp = self.cfg, self.inputs
        t_start = time.perf_counter()
        threads = cfg.run.torch_threads or min(2, os.cpu_count() or 1)
        bcfg = bus_config(cfg)
        bus = DataBus(bcfg)
        actor = role_class("actor")(cfg, bus, inp.model_path, inp.eval_path, torch_threads=threads)
        built.append(actor)
        rollout = role_class("rollout")(cfg, bus, inp.model_path, inp.prompt_path, torch_threads=threads)
        built.append(rollout)
        helpers = [role_class("advantages")(cfg, bus)]
        if cfg.algo.use_actor_fwd:
            helpers.insert(
                0, role_class("forward")(cfg, bus, "actor_fwd", inp.model_path, backend=actor.backend)
            )
        if cfg.algo.uses_reference:
            helpers.insert(
                0, role_class("forward")(cfg, bus, "reference", inp.ref_model_path or inp.model_path)
            )
            built.append(helpers[0])
        if cfg.uses_teacher:
            helpers.insert(0, role_class("forward")(cfg, bus, "teacher", self._teacher_path()))
            built.append(helpers[0])
        # --offload: the engine and the roles with models take turns on the devices (see _DeviceTurns)
        offload = _offloads(cfg)
        turns = [actor, *(h for h in helpers if getattr(h, "owns_backend", False))] if offload else []

        def publish(named, version: int) -> None:
            if offload:  # the engine's weight memory back first (its KV cache after the trainer left)
                rollout.resume_memory(["weights"])
            rollout.set_weights(dict(named), version)

        actor.publish = publish
        actor.save_extra = lambda v: {"data": rollout.data_state(v)}
        start = 0
        if cfg.train.load:
            meta = actor.load(latest_checkpoint(cfg.train.load))
            start = int(meta["version"])
            if "data" in meta:  # the same prompts from here on as the run that wrote the checkpoint
                rollout.load_data_state(meta["data"])
            bus.set_trainer_version(start)
        actor.publish_weights()
        actor.eval_now(start)
        t_rl = time.perf_counter()
        bar = _progress(cfg, start)
        stop = self._stop
        with stop:
            for step in range(start, cfg.train.num_rollout):
                if offload:  # the engine's turn: the trainer's state waits in host memory
                    for r in turns:
                        r.offload()
                    rollout.resume_memory()
                rollout.produce(step)
                if offload:  # the trainer's turn
                    rollout.release_memory()
                    for r in turns:
                        r.onload()
                for h in helpers:
                    h.drain()
                m = actor.train(step)
                _bar_update(bar, m)
                if stop.requested:  # SIGTERM / SIGINT: finish this step, checkpoint, stop cleanly
                    self.interrupted_at = actor.save(
                        cfg.train.save or os.path.join(cfg.run.output_dir, "checkpoints")
                    )
                    print(
                        f"[relax] stopped by signal after step {step}; resume with --load {self.interrupted_at}"
                    )
                    break
        rl_wall = time.perf_counter() - t_rl
        if bar is not None:
            bar.close()
        if self.interrupted_at is None:
            self._final_eval(actor.history, lambda: actor.eval_now(cfg.train.num_rollout))
            if cfg.train.save:
                actor.save()
        audit = {
            "trained_ids": actor.get_trained_ids(),
            "trained_prompts": actor.get_trained_prompts(),
            "trainer_weights": actor.get_weight_log(),
            "rollout_weights": rollout.get_weight_log(),
            "consumed": {c: bus.consumed_ids(c) for c in bcfg.consumers},
            "prompt_log": rollout.get_prompt_log(),
        }
        result = RunResult(
            actor.history,
            time.perf_counter() - t_start,
            rl_wall,
            len(audit["trained_ids"]),
            "colocate",
            0,
            rollout.get_stats(),
            bus.stats(),
            audit,
        )
        if cfg.run.trace:
            result.trace_path = self._write_trace([r.get_spans() for r in [rollout, *helpers, actor]])
        return result

    # -- fully async ---------------------------------------------------------------------------
    def _run_fully_async(self, notifier: Notifier) -> RunResult:
        cfg = self.cfg
        t_start = time.perf_counter()
        started_ray = _start_ray(cfg)
        import ray

        threads = cfg.run.torch_threads or 1
        stop = self._stop
        run = self.async_run = AsyncRun(self, notifier, threads)
        try:
            bcfg = bus_config(cfg)
            start = run.start(latest_checkpoint(cfg.train.load) if cfg.train.load else None)
            t_rl = time.perf_counter()
            bar = _progress(cfg, start)
            seen = start
            stop.__enter__()
            asked = False
            while True:
                actor = run.roles["actor"]
                if stop.requested and not asked:  # SIGTERM / SIGINT: the trainer checkpoints after its step
                    actor.request_stop.remote(
                        cfg.train.save or os.path.join(cfg.run.output_dir, "checkpoints")
                    )
                    asked = True
                ready, _ = ray.wait([run.done], timeout=0.1)
                if ready and run._finished(run.done):
                    break
                run.poll()  # failed roles: restart in place, escalate, or stop with the reason
                if bar is not None:
                    try:
                        cur = ray.get(run.roles["actor"].progress.remote(), timeout=10)
                    except Exception:  # noqa: BLE001 - the trainer is being restarted
                        cur = seen
                    bar.update(cur - seen)
                    seen = cur
            actor, rollout, bus = run.roles["actor"], run.roles["rollout"], run.bus
            loops = {n: run.roles[n] for n in run.loop_names()}
            history = ray.get(run.done)
            stop.__exit__()  # (a signal from here on gets the default behaviour)
            self.interrupted_at = ray.get(actor.get_interrupted.remote())
            if self.interrupted_at:
                print(f"[relax] stopped by signal; resume with --load {self.interrupted_at}")
            rl_wall = time.perf_counter() - t_rl
            if bar is not None:
                bar.close()
            bus.close()
            stats = ray.get(run.futures["rollout"])
            ray.get([run.futures[n] for n in loops])
            if self.interrupted_at is None:
                self._final_eval(history, lambda: ray.get(actor.eval_now.remote(cfg.train.num_rollout)))
                if cfg.train.save:
                    ray.get(actor.save.remote())
            history = ray.get(actor.get_history.remote())
            run.finish_engine_restarts()
            audit = {
                "trained_ids": ray.get(actor.get_trained_ids.remote()),
                "trained_prompts": ray.get(actor.get_trained_prompts.remote()),
                "trainer_weights": ray.get(actor.get_weight_log.remote()),
                "rollout_weights": ray.get(rollout.get_weight_log.remote()),
                "consumed": {c: bus.consumed_ids(c) for c in bcfg.consumers},
                "prompt_log": ray.get(rollout.get_prompt_log.remote()),
                "health": [vars(e) for e in run.events()],
                "engines": ray.get(rollout.engines.remote()),
            }
            bus_stats = bus.stats()
            trace_path = None
            if cfg.run.trace:
                trace_path = self._write_trace(
                    ray.get([r.get_spans.remote() for r in [rollout, *loops.values(), actor]])
                )
            # the sender first: receivers still listening acknowledge its shutdown, then they close
            ray.get(actor.close.remote())
            ray.get(
                [rollout.close.remote()] + [a.close.remote() for n, a in loops.items() if n != "advantages"]
            )
            return RunResult(
                history,
                time.perf_counter() - t_start,
                rl_wall,
                len(audit["trained_ids"]),
                "fully_async",
                cfg.run.max_staleness,
                stats,
                bus_stats,
                audit,
                trace_path,
            )
        finally:
            stop.__exit__()
            run.teardown()
            if started_ray:
                ray.shutdown()

    def _teacher_path(self) -> str:
        path = self.inputs.teacher_model_path or self.cfg.model.teacher_checkpoint
        return os.path.abspath(path)

    def _final_eval(self, history: list[dict[str, Any]], do_eval) -> None:
        last = [h for h in history if "eval/accuracy" in h]
        if self.inputs.eval_path and (not last or last[-1]["step"] != self.cfg.train.num_rollout):
            do_eval()


class _StopOnSignal:
    """While active, SIGTERM and SIGINT ask the run to stop after the current step (with a checkpoint)
    instead of killing it; a second signal gets the previous handler (e.g. an immediate KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            prev = self._previous.get(signum)
            if callable(prev):
                prev(signum, frame)
            return
        self.requested = True

    def __enter__(self) -> _StopOnSignal:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous = {}


def _progress(cfg: RelaxConfig, start: int):
    if not cfg.run.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.num_rollout, initial=start, desc=f"RL ({cfg.run.mode})", unit="step")


def _bar_update(bar, metrics: dict[str, Any]) -> None:
    if bar is None:
        return
    post = {"reward": f"{metrics['rollout/reward_mean']:.3f}"}
    if "eval/accuracy" in metrics:
        post["eval"] = f"{metrics['eval/accuracy']:.3f}"
    bar.set_postfix(post)
    bar.update(1)
