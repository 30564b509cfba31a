"""The fully-async run: every role a Ray actor with its own loop, supervised by the health manager.

Why the restarts look like this:

- **Bus consumers** (Advantages, ActorFwd, Reference, Teacher) hold leases on the samples they work on.
  When one dies, ``reset_consumer`` gives its unfinished samples back, except those whose output it had
  already written (the bus's fields are write-once), and a new actor takes over the loop.
- **The rollout role** journals where each batch's prompts start and when the batch lands on the bus; a
  new rollout process continues with the first batch not on the bus, and samples carry ids fixed by
  their step, so a batch sent just before the crash is not put twice.
- **The trainer** acks a batch only after the checkpoint that follows it (when one is due), so a new
  trainer loads the latest checkpoint, the manager acks the batches that checkpoint holds and the rest
  come back. If batches were acked after the last checkpoint, an in-place restart cannot be exact and
  the manager escalates to a global restart from that checkpoint (exact resume).
- **Weights.** The DCS group is re-formed after any member restarts, and the trainer sends its current
  weights at once; a restarted role waits for them before its loop starts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from relax_core.health import Event, HealthPolicy, Heartbeats, RunFailed
from relax_core.optional import import_ray
from relax_core.ownership import crashed_in_reward, read_record
from relax_core.resume import CheckpointDir
from relax_core.roles import RENAMED_CONSUMERS, TRAINER_CONSUMER, RolePlan, role_class
from relax_core.run import teacher_path


class _CannotRestartInPlace(Exception):
    pass


class AsyncRun:
    """The running roles of a fully-async run (each a Ray actor), the bus, and their supervision. The
    driver loop that uses it is :func:`relax_core.fully_async.run_fully_async`."""

    def __init__(self, cfg: Any, inputs: Any, notifier: Any, threads: int) -> None:
        self.ray = import_ray("--fully-async")
        self.cfg, self.inp = cfg, inputs
        self.plan = RolePlan.from_config(cfg)
        self.notifier, self.threads = notifier, threads
        self.roles: dict[str, Any] = {}
        self.futures: dict[str, Any] = {}
        self.done: Any = None
        self.bus: Any = None
        self.policy = HealthPolicy(self.cfg.run.max_restarts_per_role, self.cfg.run.max_global_restarts)
        self.beats = Heartbeats(self.cfg.run.heartbeat_interval_s, self.cfg.run.heartbeat_timeout_s)
        self.start_step = 0
        self._engine_jobs: dict[str, tuple[Any, Event, float]] = {}
        """Engine restarts asked of the rollout role: id -> (pending ref or None once handled, event, t0)."""
        self._recovering: dict[str, tuple[Event, float, Any]] = {}
        """Roles restarted in place and not yet serving: name -> (event, t0, the new actor's first heartbeat)."""

    # -- building ----------------------------------------------------------------------------------
    def _build(self, name: str) -> Any:
        """Role ``name``'s actor, on this process's node even in a cluster of several (RAY_ADDRESS): the
        roles' weight group (DCS) and engine servers listen on loopback."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        teacher = teacher_path(self.cfg, self.inp) if self.cfg.uses_teacher else None
        args, kwargs = self.plan.arguments(name, self.bus, self.inp, self.threads, teacher)
        here = NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(), soft=False)
        cls = self.ray.remote(role_class(name))
        return cls.options(num_cpus=0.1, max_concurrency=8, scheduling_strategy=here).remote(*args, **kwargs)

    @property
    def receivers(self) -> list[str]:
        """DCS receivers, in rank order (rank 0 is the trainer)."""
        return self.plan.receivers

    def loop_names(self) -> list[str]:
        return self.plan.loops

    def connect_dcs(self, republish: bool) -> int:
        from relax_core.dcs import free_port

        init = f"tcp://127.0.0.1:{free_port()}"
        world = 1 + len(self.receivers)
        out = self.ray.get(
            [self.roles["actor"].connect_dcs.remote(init, world, republish)]
            + [self.roles[r].connect_dcs.remote(init, world, i + 1) for i, r in enumerate(self.receivers)]
        )
        return int(out[0] or 0)

    def start(self, load: str | None) -> int:
        """Create the bus and every role, load ``load`` (a checkpoint) if given, start the loops."""
        from relax_bus.ray_backend import RayBus

        ray, cfg = self.ray, self.cfg
        from relax_core.placement import check_gpu_demand, gpu_demand

        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus > 0:  # every role's GPUs apart: refuse now what Ray could never place
            check_gpu_demand(gpu_demand(cfg), gpus)
        ckpt = CheckpointDir(load) if load else None
        resume = ckpt.bus_resume() if ckpt else None
        from_snapshot = resume is not None
        # the samples generated and not yet trained when the checkpoint was written come back as they were
        self.bus = (
            RayBus.restore(ckpt.bus, rename=RENAMED_CONSUMERS)
            if from_snapshot
            else RayBus.create(self.plan.bus_config())
        )
        if from_snapshot:  # outputs written before the snapshot but not acked: done, not computed again
            for name, written in self.plan.outputs.items():
                self.bus.reset_consumer(name, done_if_written=written)
        for name in ["actor", "rollout", *self.loop_names()]:
            self.roles[name] = self._build(name)
        ray.get(self.roles["rollout"].reset_journal.remote())
        self.connect_dcs(republish=False)
        start = rollout_start = 0
        if load:
            meta = ray.get(self.roles["actor"].load.remote(load))
            start = rollout_start = int(meta["version"])
            if from_snapshot:  # rollout goes on after the batches the snapshot holds
                rollout_start = int(resume["next_step"])
                ray.get(self.roles["rollout"].load_data_state.remote(resume["data"]))
                ray.get(self.roles["rollout"].seed_journal.remote(resume["begun"], rollout_start))
            elif "data" in meta:  # no bus snapshot: batches generated but never trained are drawn again
                ray.get(self.roles["rollout"].load_data_state.remote(meta["data"]))
            if self.bus.trainer_version < start:
                self.bus.set_trainer_version(start)
        ray.get(self.roles["actor"].publish_weights.remote())
        ray.get(self.roles["actor"].eval_now.remote(start))
        self.futures = {"rollout": self.roles["rollout"].run.remote(rollout_start)}
        self.resumed_from_bus = from_snapshot
        self.futures.update({n: self.roles[n].run.remote() for n in self.loop_names()})
        self.done = self.roles["actor"].run.remote(start, cfg.train.num_rollout)
        self.start_step = start
        return start

    # -- supervision -------------------------------------------------------------------------------
    def poll(self) -> None:
        """One supervision round: loops that ended early and failed heartbeats are handled (restarted,
        escalated, or the run stops with :class:`RunFailed`); without the health manager a failed loop's
        error is re-raised as before."""
        ray = self.ray
        watched = dict(self.futures)
        watched["actor"] = self.done
        ended, _ = ray.wait(list(watched.values()), num_returns=len(watched), timeout=0)
        failures: list[tuple[str, str]] = []
        for name, ref in watched.items():
            if ref not in ended or (name == "actor" and self._finished(ref)):
                continue
            if not self.cfg.run.health:
                ray.get(ref)  # a role loop ended before the trainer: re-raise its error
                raise RuntimeError(f"the {name} loop stopped before training finished")
            try:
                ray.get(ref)
                failures.append((name, "its loop ended before training finished"))
            except Exception as e:  # noqa: BLE001 - the reason goes to the event and the notification
                failures.append((name, _first_line(e, 300)))
        self._recovered()
        if self.cfg.run.health and not failures:
            failures = self._heartbeats()
        for name, reason in failures[:1]:  # one at a time: a restart re-forms the group for everyone
            self.handle(name, reason)

    def _finished(self, ref: Any) -> bool:
        try:
            self.ray.get(ref)
            return True
        except Exception:  # noqa: BLE001
            return False

    def _heartbeats(self) -> list[tuple[str, str]]:
        ray, now = self.ray, time.monotonic()
        if self.beats.due(now):
            for name, actor in self.roles.items():
                self.beats.sent(name, actor.heartbeat.remote(), now)
        refs = self.beats.pending_refs()
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        results: dict[Any, Any] = {}
        for r in ready:
            try:
                results[r] = ray.get(r)
            except Exception as e:  # noqa: BLE001
                results[r] = e
            if isinstance(results[r], dict) and results[r].get("failed_engines"):
                self._restart_engines(results[r]["failed_engines"])
        self._engine_restarts_done()
        return self.beats.check(set(ready), results, now)

    def _restart_engines(self, failed: list[dict[str, Any]]) -> None:
        """Engines run in their own processes under the rollout role: ask it to restart failed ones
        (asynchronously: the supervision loop goes on meanwhile)."""
        for f in failed:
            if f["engine"] in self._engine_jobs:
                continue
            ev = Event(f"engine {f['engine']}", str(f.get("reason")), "restart", 0)
            self.policy.events.append(ev)
            ref = self.roles["rollout"].restart_engine.remote(f["engine"])
            self._engine_jobs[f["engine"]] = (ref, ev, time.perf_counter())

    def _engine_restarts_done(self) -> None:
        for eid, (ref, ev, t0) in list(self._engine_jobs.items()):
            if ref is None:
                continue  # handled already
            ready, _ = self.ray.wait([ref], timeout=0)
            if not ready:
                continue
            self._engine_jobs[eid] = (None, ev, t0)
            try:
                out = self.ray.get(ref)
                ev.action, ev.attempt = out["action"], int(out["attempt"])
                ev.recovery_s = time.perf_counter() - t0 if out["action"] == "restart" else None
            except Exception as e:  # noqa: BLE001 - recorded; the other engines keep serving
                ev.action, ev.reason = "restart_failed", f"{ev.reason}; restart failed: {e}"
            self.notifier.restart(ev.attempt, f"rollout {ev.role} ({ev.action}): {ev.reason}")

    def handle(self, name: str, reason: str, in_place_possible: bool = True) -> None:
        t0 = time.perf_counter()
        if name == "rollout" and (why := crashed_in_reward(self.cfg.run.output_dir)):
            reason = f"{reason}; {why}"
        ev = self.policy.decide(name, reason, in_place_possible)
        print(
            f"[relax] health: {name} failed ({reason}); {ev.action.replace('_', ' ')} (attempt {ev.attempt})"
        )
        if ev.action == "restart":
            try:
                self.restart(name)
            except _CannotRestartInPlace as e:
                ev = self.policy.escalate(ev, str(e))
                print(f"[relax] health: {e}; {ev.action.replace('_', ' ')}")
            except Exception as e:  # noqa: BLE001 - a second failure while restarting: the bus, the new actor
                why = f"the restart failed: {_first_line(e)}"
                ev = self.policy.escalate(ev, why)
                print(f"[relax] health: {why}; {ev.action.replace('_', ' ')}")
        while ev.action == "global_restart":
            try:
                self.global_restart()
                break
            except Exception as e:  # noqa: BLE001 - failed again while starting over: another try, or stop
                why = f"the global restart failed: {_first_line(e)}"
                ev = self.policy.decide(name, f"{reason}; {why}", in_place_possible=False)
                print(f"[relax] health: {why}; {ev.action.replace('_', ' ')}")
        if ev.action == "stop":
            raise RunFailed(self.policy.stop_reason(ev))
        if (
            ev.action == "restart"
        ):  # serving again once the new actor answers (its model loaded): see _recovered
            self._recovering[name] = (ev, t0, self.roles[name].heartbeat.remote())
        else:  # a global restart returns with every role serving
            ev.recovery_s = time.perf_counter() - t0
        self.notifier.restart(ev.attempt, f"{name} ({ev.action.replace('_', ' ')}): {reason}")

    def _recovered(self, wait_s: float = 0.0) -> None:
        """Close the recovery time of roles restarted in place whose new actor has answered (it had to
        be built, model loaded, first): the time from the failure's detection until the role serves again.
        Issuing the restart takes far less (Reference: 0.05 s issued, 102 s until it served)."""
        for name, (ev, t0, ref) in list(self._recovering.items()):
            ready, _ = self.ray.wait([ref], timeout=wait_s)
            if not ready:
                continue
            del self._recovering[name]
            try:
                self.ray.get(ref)
            except Exception:  # noqa: BLE001 - it died again before serving: that failure is handled on its own
                continue
            ev.recovery_s = time.perf_counter() - t0

    def restarting(self) -> set[str]:
        """Roles restarted in place whose new actor does not serve yet (loading its model)."""
        return set(self._recovering)

    def _kill(self, name: str) -> None:
        actor = self.roles.get(name)
        self.beats.forget(name)
        self._recovering.pop(name, None)
        if actor is not None:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def restart(self, name: str) -> None:
        """Replace one role's actor in place (see the module docstring for what each role needs)."""
        ray = self.ray
        self._kill(name)
        if name == "actor":
            ckpt = self._trainer_checkpoint()
        if name in self.plan.outputs:
            self.bus.reset_consumer(name, done_if_written=self.plan.outputs[name])
        new = self.roles[name] = self._build(name)
        if name == "actor":
            start = 0
            if ckpt is not None:
                start = int(ray.get(new.load.remote(ckpt))["version"])
        if name == "rollout":
            try:
                start = ray.get(new.recover.remote())
            except ray.exceptions.RayTaskError as e:  # its journal cannot say where to go on
                raise _CannotRestartInPlace(f"the rollout cannot go on in place: {e.cause}") from e
            self._engine_jobs = {}  # a new rollout process has its own engines
        if name == "actor" or name in self.receivers:
            version = self.connect_dcs(republish=True)
            if name in self.receivers:
                ray.get(new.wait_weights.remote(version))
        if name == "actor":
            self.done = new.run.remote(start, self.cfg.train.num_rollout)
        elif name == "rollout":
            self.futures["rollout"] = new.run.remote(start)
        else:
            self.futures[name] = new.run.remote()

    def _trainer_checkpoint(self) -> str | None:
        """The checkpoint a new trainer starts from; acks the batches it covers, gives back the rest."""
        from relax_core.checkpoints import latest_checkpoint

        acked = set(self.bus.consumed_ids(TRAINER_CONSUMER))
        ckpt, covered = None, set()
        if self.cfg.train.save:
            try:
                ckpt = latest_checkpoint(
                    self.cfg.train.save, read_record(self.cfg.run.output_dir).get("run_id")
                )
            except FileNotFoundError:
                ckpt = None
        if ckpt is not None:
            state = CheckpointDir(ckpt).run_state()
            if not isinstance(state.get("trained_ids"), list):
                raise _CannotRestartInPlace(f"checkpoint {ckpt} does not list its trained samples")
            covered = set(state["trained_ids"])
        if not acked <= covered:
            raise _CannotRestartInPlace(
                f"{len(acked - covered)} trained samples are not in the last checkpoint "
                f"({ckpt or 'none: set --save'}); save every step (--save-interval 1) for in-place trainer restarts"
            )
        for lease_id, ids in self.bus.leases(TRAINER_CONSUMER).items():
            if set(ids) <= covered:  # trained and saved; the process died before acking
                self.bus.ack(TRAINER_CONSUMER, lease_id)
        self.bus.reset_consumer(TRAINER_CONSUMER)
        return ckpt

    def teardown(self) -> None:
        """Kill every role and the bus: on a Ray cluster the run does not own (tests, notebooks, a shared
        cluster) they would otherwise stay, holding CPUs, memory and shared-memory files."""
        for name in list(self.roles):
            self._kill(name)
        if self.bus is not None:
            try:
                self.bus.kill()
            except Exception:  # noqa: BLE001 - the bus may be what died
                pass
        self.roles, self.futures, self.bus = {}, {}, None

    def global_restart(self) -> None:
        """Every role and the bus from scratch, from the last checkpoint (exact resume)."""
        from relax_core.checkpoints import latest_checkpoint

        self.teardown()
        ckpt = None
        if self.cfg.train.save:
            try:
                ckpt = latest_checkpoint(
                    self.cfg.train.save, read_record(self.cfg.run.output_dir).get("run_id")
                )
            except FileNotFoundError:
                ckpt = None
        if ckpt is None:  # nothing saved yet: the run starts over, so it forgets what it logged
            log = Path(self.cfg.run.output_dir) / "metrics.jsonl"
            if log.is_file():
                os.replace(log, log.with_suffix(".before_restart.jsonl"))
        self.start(ckpt)

    def finish_engine_restarts(self, timeout_s: float = 120.0) -> None:
        """At the end of the run: restart engines that failed since the last heartbeat and wait for the
        restarts under way, so the run ends with its engines whole and the record complete."""
        beat = self.ray.get(self.roles["rollout"].heartbeat.remote())
        if beat.get("failed_engines"):
            self._restart_engines(beat["failed_engines"])
        pending = [ref for ref, _, _ in self._engine_jobs.values() if ref is not None]
        if pending:
            self.ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        self._engine_restarts_done()

    def events(self) -> list[Event]:
        self._recovered(wait_s=60.0)  # (a role restarted near the end: its recovery still counts)
        return sorted(self.policy.events, key=lambda ev: ev.at)


def _first_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` (a Ray error's message carries a whole remote traceback)."""
    text = str(e).splitlines()
    return f"{type(e).__name__}: {text[0][:limit] if text else ''}"
