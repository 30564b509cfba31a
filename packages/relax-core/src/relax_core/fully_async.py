"""Fully-async mode, the driver: every role a Ray actor running its own loop; this process only watches.

The roles are connected by the bus (data) and DCS (weights) alone: the rollout generates as long as the
staleness bound lets it, the roles computing on samples consume them as they come, the trainer steps
whenever a batch is ready and publishes its weights. The driver starts them (from ``--load`` if given),
then until the trainer's loop ends: passes a stop request on (SIGTERM / SIGINT: the trainer checkpoints
after its step), lets supervision handle failed roles (:class:`~relax_core.async_run.AsyncRun`), and moves
the progress bar; then the final evaluation, the end-of-run checkpoint (supervised too), the audit; it closes the roles.
"""

from __future__ import annotations

import time
from typing import Any

from relax_core import run as shared
from relax_core.async_run import AsyncRun
from relax_core.checkpoints import latest_checkpoint
from relax_core.live import LiveStatus
from relax_core.live_async import AsyncProbe
from relax_core.role import TrainerRecord


def _audit(run: AsyncRun, record: TrainerRecord) -> dict[str, Any]:
    """What the roles did (samples, weight versions, engines, health, placement), for ``summary.json``."""
    rollout, bus, ray = run.rollout, run.bus, run.ray
    assert bus is not None
    rolled = ray.get(rollout.get_record.remote())
    return {
        "trained_ids": record.trained_ids,
        "trained_prompts": record.trained_prompts,
        "trainer_weights": record.weight_log,
        "rollout_weights": rolled.weight_log,
        "consumed": {c: bus.consumed_ids(c) for c in run.plan.consumers},
        "prompt_log": rolled.prompt_log,
        "health": [vars(e) for e in run.events()],
        "engines": ray.get(rollout.engines.remote()),
        "placement": {**run.nodes.placed, "bus": run.nodes.driver_address},
    }


def run_fully_async(
    run: AsyncRun, stop: shared.StopOnSignal, live: LiveStatus | None = None
) -> shared.RunResult:
    cfg = run.cfg
    probe = AsyncProbe(run, live or LiveStatus(cfg))
    ray = run.ray
    t_start = time.perf_counter()
    started_ray = shared.start_ray(cfg)
    try:
        load = cfg.train.load
        start = run.start(
            latest_checkpoint(load, trust_unverified=cfg.train.trust_unverified) if load else None
        )
        t_rl = time.perf_counter()
        bar = shared.progress_bar(cfg, start)
        seen = start
        probe.step = start
        probe.live.training(start)
        while True:  # (again after a global restart that the end-of-run checkpoint needed)
            seen = _supervise(run, stop, bar, seen, probe)
            actor, rollout, bus = run.trainer, run.rollout, run.bus
            assert bus is not None, "start() made it; a global restart makes another before returning"
            loops = {n: run.roles[n] for n in run.plan.loops}
            history = ray.get(run.done)
            probe.live.update(state="finishing", step=ray.get(actor.progress.remote()), force=True)
            stop.__exit__()  # (a signal from here on gets the default behaviour)
            interrupted = ray.get(actor.get_interrupted.remote())
            if interrupted:
                print(f"[relax] stopped by signal; resume with --load {interrupted}")
            rl_wall = time.perf_counter() - t_rl
            bus.close()
            stats = ray.get(run.futures[run.plan.rollout])
            ray.get([run.futures[n] for n in loops])
            if interrupted:  # (the critic's state beside the trainer's checkpoint)
                ray.get([run.roles[n].save_state.remote(interrupted) for n in run.plan.stateful])
            if interrupted is None:

                def eval_last(a: Any = actor) -> object:
                    return ray.get(a.eval_now.remote(cfg.train.num_rollout))

                shared.final_eval(cfg, run.inp, history, eval_last)
                if cfg.train.save and not _saved_at_end(run):
                    continue
            break
        if bar is not None:
            bar.close()
        record = ray.get(actor.get_record.remote())
        run.engine_restarts.finish(run.rollout)
        audit = _audit(run, record)
        trace_path = None
        if cfg.run.trace:
            spans = ray.get([r.get_spans.remote() for r in [rollout, *loops.values(), actor]])
            trace_path = shared.trace_file(cfg, spans)
        # the sender first: receivers still listening acknowledge its shutdown, then they close
        ray.get(actor.close.remote())
        ray.get([rollout.close.remote()] + [a.close.remote() for a in loops.values()])
        return shared.RunResult(
            record.history,
            time.perf_counter() - t_start,
            rl_wall,
            len(audit["trained_ids"]),
            "fully_async",
            cfg.run.max_staleness,
            stats,
            bus.stats(),
            audit,
            trace_path,
            interrupted,
        )
    finally:
        stop.__exit__()
        run.teardown()
        if started_ray:
            ray.shutdown()


def _supervise(run: AsyncRun, stop: shared.StopOnSignal, bar: Any, seen: int, probe: AsyncProbe) -> int:
    """Until the trainer's loop ends: pass a stop request on (the trainer checkpoints after its step, then
    ends its loop), let supervision handle failed roles, move the progress bar and the live status; returns
    where it stands."""
    ray, asked = run.ray, False
    stop.__enter__()
    while True:
        if stop.requested and not asked:
            run.trainer.request_stop.remote(shared.checkpoint_dir(run.cfg))
            asked = True
        ready, _ = ray.wait([run.done], timeout=0.1)
        if ready and run.trainer_finished():
            return seen
        run.poll()  # failed roles: restart in place, escalate, or stop with the reason
        probe.tick()
        if probe.step > seen:
            if bar is not None:
                bar.update(probe.step - seen)
            seen = probe.step


def _saved_at_end(run: AsyncRun) -> bool:
    """The end-of-run checkpoint. The loops are over, so a trainer that dies while writing it cannot be
    restarted in place (its last steps are in no checkpoint): the save left the previous checkpoint whole,
    and the run starts over from it (a global restart; or stops with the reason when none is left).
    False when it did: the caller supervises the run again."""
    try:
        run.ray.get(run.trainer.save.remote())
        return True
    except run.ray.exceptions.RayActorError as e:
        reason = f"died writing the end-of-run checkpoint: {type(e).__name__}"
        run.handle(run.plan.trainer, reason, in_place_possible=False)
        return False
