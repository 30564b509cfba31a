"""Colocate mode: every role in this process, taking turns, one step at a time. Each step the rollout puts
a batch on the bus, the roles computing on it (ActorFwd, Reference, Teacher, Advantages) drain it in data
order, the trainer steps and publishes its weights to the engine. ``--offload``: the engine and the roles
holding models hand the devices to each other around generation."""

from __future__ import annotations

import os
import time
from typing import Any

from relax_core import run as shared
from relax_core.checkpoints import latest_checkpoint
from relax_core.config import RelaxConfig
from relax_core.roles import RolePlan, role_class
from relax_core.threads import ThreadGovernor


def run_colocate(cfg: RelaxConfig, inputs: shared.RunInputs, stop: shared.StopOnSignal) -> shared.RunResult:
    t_start = time.perf_counter()
    with _Roles(cfg, inputs) as r:
        actor, rollout, helpers = r.actor, r.rollout, r.helpers
        start = r.resume()
        actor.publish_weights()
        actor.eval_now(start)
        t_rl = time.perf_counter()
        bar = shared.progress_bar(cfg, start)
        interrupted = None
        with stop:
            r.threads.start()
            for step in range(start, cfg.train.num_rollout):
                r.threads.check()  # one torch thread while other processes hold the cores
                r.engine_turn()
                rollout.produce(step)
                r.threads.check()
                r.trainer_turn()
                for h in helpers:
                    h.drain()
                shared.bar_update(bar, actor.train(step))
                if stop.requested:  # SIGTERM / SIGINT: finish this step, checkpoint, stop cleanly
                    interrupted = actor.save(shared.checkpoint_dir(cfg))
                    print(f"[relax] stopped by signal after step {step}; resume with --load {interrupted}")
                    break
        rl_wall = time.perf_counter() - t_rl
        if bar is not None:
            bar.close()
        if interrupted is None:
            shared.final_eval(cfg, inputs, actor.history, lambda: actor.eval_now(cfg.train.num_rollout))
            if cfg.train.save:
                actor.save()
        audit = {
            "trained_ids": actor.get_trained_ids(),
            "trained_prompts": actor.get_trained_prompts(),
            "trainer_weights": actor.get_weight_log(),
            "rollout_weights": rollout.get_weight_log(),
            "consumed": {c: r.bus.consumed_ids(c) for c in r.bus_cfg.consumers},
            "prompt_log": rollout.get_prompt_log(),
        }
        result = shared.RunResult(
            actor.history,
            time.perf_counter() - t_start,
            rl_wall,
            len(audit["trained_ids"]),
            "colocate",
            0,
            rollout.get_stats(),
            r.bus.stats(),
            audit,
            interrupted_at=interrupted,
        )
        if cfg.run.trace:
            result.trace_path = shared.trace_file(cfg, [x.get_spans() for x in [rollout, *helpers, actor]])
        return result


class _Roles:
    """The roles built from the :class:`RolePlan` in this process and their turns on the devices; closed in
    reverse (a megatron trainer's rank group last), then the Ray its ranks needed."""

    def __init__(self, cfg: RelaxConfig, inputs: shared.RunInputs) -> None:
        from relax_bus import DataBus

        self.cfg, self.inputs, self.built = cfg, inputs, []
        self.ray_started = shared.start_ray_for_ranks(cfg)
        try:
            self._build(DataBus)
        except BaseException:
            self.__exit__()
            raise

    def _build(self, bus_class: type) -> None:
        cfg, inputs = self.cfg, self.inputs
        plan = RolePlan.from_config(cfg)
        threads = cfg.run.torch_threads or min(2, os.cpu_count() or 1)
        self.threads = ThreadGovernor(threads)
        self.bus_cfg = plan.bus_config()
        self.bus = bus_class(self.bus_cfg)
        teacher = shared.teacher_path(cfg, inputs) if cfg.uses_teacher else None

        def build(name: str, **extra: Any) -> Any:
            args, kwargs = plan.arguments(name, self.bus, inputs, threads, teacher)
            role = role_class(name)(*args, **{**kwargs, **extra})
            self.built.append(role)
            return role

        self.actor = build("actor", send_weights=self._publish)  # (its weights: straight to the engine)
        self.rollout = build("rollout")
        # ActorFwd computes with the trainer's own backend here (its weights are the trainer's)
        self.helpers = [
            build(n, **({"backend": self.actor.backend} if n == "actor_fwd" else {})) for n in plan.loops
        ]
        # --offload: the engine and the roles with models take turns on the devices
        self.offload = shared.offloads(cfg)
        owners = [self.actor, *(h for h in self.helpers if getattr(h, "owns_backend", False))]
        self.turns = owners if self.offload else []

    def _publish(self, named: Any, version: int) -> None:
        if self.offload:  # the engine's weight memory back first (its KV cache after the trainer left)
            self.rollout.resume_memory(["weights"])
        self.rollout.set_weights(dict(named), version)

    def resume(self) -> int:
        """``--load``: the trainer's checkpoint, and the same prompts from there on; the step to start at."""
        self.rollout.reset_journal()  # (the trainer's checkpoints read the data position there)
        if not self.cfg.train.load:
            return 0
        meta = self.actor.load(latest_checkpoint(self.cfg.train.load))
        version = int(meta["version"])
        if "data" in meta:
            self.rollout.load_data_state(meta["data"])
        self.rollout.seed_journal({}, version)
        self.bus.set_trainer_version(version)
        return version

    def engine_turn(self) -> None:  # (the trainer's state waits in host memory)
        if self.offload:
            for r in self.turns:
                r.offload()
            self.rollout.resume_memory()

    def trainer_turn(self) -> None:
        if self.offload:
            self.rollout.release_memory()
            for r in self.turns:
                r.onload()

    def __enter__(self) -> _Roles:
        return self

    def __exit__(self, *exc: Any) -> None:
        for role in reversed(self.built):
            if callable(getattr(role, "close", None)):
                role.close()
        if self.ray_started:
            shared.stop_ray()
