"""Colocate mode: every role in this process, taking turns, one step at a time. Each step the rollout puts
a batch on the bus, the roles computing on it (ActorFwd, Reference, Teacher, Advantages) drain it in data
order, the trainer steps and publishes its weights to the engine. ``--offload``: the engine and the roles
holding models hand the devices to each other around generation."""

from __future__ import annotations

import os
import time

from relax_core import run as shared
from relax_core.colocate_roles import ColocateRoles
from relax_core.config import RelaxConfig
from relax_core.live import LiveStatus
from relax_core.roles import RoleRegistry


def run_colocate(
    cfg: RelaxConfig,
    inputs: shared.RunInputs,
    stop: shared.StopOnSignal,
    live: LiveStatus | None = None,
    roles: RoleRegistry | None = None,
) -> shared.RunResult:
    """``roles``: the role registry (default: the installed roles)."""
    t_start = time.perf_counter()
    live = live or LiveStatus(cfg)
    with ColocateRoles(cfg, inputs, roles) as r:
        actor, rollout, helpers = r.trainer, r.rollout, r.helpers
        turn = _Turns(live, r)
        start = r.resume()
        actor.publish_weights()
        actor.eval_now(start)
        t_rl = time.perf_counter()
        bar = shared.progress_bar(cfg, start)
        interrupted = None
        live.training(start)
        with stop:
            r.threads.start()
            for step in range(start, cfg.train.num_rollout):
                r.threads.check()  # one torch thread while other processes hold the cores
                r.engine_turn()
                turn("generate", step)
                rollout.produce(step)
                r.threads.check()
                r.trainer_turn()
                turn("compute", step)
                for h in helpers:
                    h.drain()
                turn("train", step)
                shared.bar_update(bar, actor.train(step))
                turn(None, step + 1)
                if stop.requested:  # SIGTERM / SIGINT: finish this step, checkpoint, stop cleanly
                    interrupted = actor.save(shared.checkpoint_dir(cfg))
                    r.save_states(interrupted)
                    print(f"[relax] stopped by signal after step {step}; resume with --load {interrupted}")
                    break
        rl_wall = time.perf_counter() - t_rl
        if bar is not None:
            bar.close()
        live.update(state="finishing", phase=None, force=True)
        record, rolled = actor.get_record(), rollout.get_record()
        if interrupted is None:
            shared.final_eval(cfg, inputs, record.history, lambda: actor.eval_now(cfg.train.num_rollout))
            if cfg.train.save:
                actor.save()
        audit = {
            "trained_ids": list(record.trained_ids),
            "trained_prompts": [list(p) for p in record.trained_prompts],
            "trainer_weights": dict(record.weight_log),
            "rollout_weights": rolled.weight_log,
            "consumed": {c: r.bus.consumed_ids(c) for c in r.bus_cfg.consumers},
            "prompt_log": rolled.prompt_log,
        }
        result = shared.RunResult(
            record.history,
            time.perf_counter() - t_start,
            rl_wall,
            len(audit["trained_ids"]),
            "colocate",
            0,
            rolled.stats,
            r.bus.stats(),
            audit,
            interrupted_at=interrupted,
        )
        if cfg.run.trace:
            result.trace_path = shared.trace_file(cfg, [x.get_spans() for x in [rollout, *helpers, actor]])
        return result


class _Turns:
    """The live status of a colocate step: whose turn it is (the others wait), the weight versions, the bus;
    the trace flushed every few seconds."""

    STATES = {"generate": "generating", "compute": "computing", "train": "training"}

    def __init__(self, live: LiveStatus, roles: ColocateRoles) -> None:
        self.live, self.r, plan = live, roles, roles.plan
        self.names = {
            plan.rollout: roles.rollout,
            **dict(zip(plan.loops, roles.helpers)),
            plan.trainer: roles.trainer,
        }
        self.busy = {"generate": [plan.rollout], "compute": plan.loops, "train": [plan.trainer]}
        # the trainer's version, and that of the consumers computing with its model (its weights here)
        self.trainers = [plan.trainer, *(n for n in plan.loops if plan.roles[n].model == "policy")]

    def __call__(self, phase: str | None, step: int) -> None:
        live, r = self.live, self.r
        busy = self.busy.get(phase, []) if phase is not None else []
        for name in self.names:
            state = self.STATES[phase] if phase is not None and name in busy else "waiting"
            live.role(name, state=state, pid=os.getpid())
        live.role(r.plan.rollout, version=r.rollout.weight_version())
        for name in self.trainers:
            live.role(name, version=r.trainer.progress())
        live.bus(r.bus.stats())
        live.update(step=step, phase=phase, force=phase is None)
        if phase is None:
            live.flush_trace(lambda: [x.get_spans() for x in self.names.values()])
