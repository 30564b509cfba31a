"""Colocate mode: every role in this process, taking turns, one step at a time. Each step the rollout puts
a batch on the bus, the roles computing on it (ActorFwd, Reference, Teacher, Advantages) drain it in data
order, the trainer steps and publishes its weights to the engine. ``--offload``: the engine and the roles
holding models hand the devices to each other around generation."""

from __future__ import annotations

import time

from relax_core import run as shared
from relax_core.colocate_roles import ColocateRoles
from relax_core.config import RelaxConfig


def run_colocate(cfg: RelaxConfig, inputs: shared.RunInputs, stop: shared.StopOnSignal) -> shared.RunResult:
    t_start = time.perf_counter()
    with ColocateRoles(cfg, inputs) as r:
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
