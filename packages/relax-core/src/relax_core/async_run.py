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

Which of these a role needs is declared on its spec (:attr:`relax_core.role.RoleSpec.restart`), and the
loop it runs follows from its part: :meth:`AsyncRun.restart` reads both and never a role's name.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core.checkpoints import CheckpointNotFound
from relax_core.engine_restarts import EngineRestarts
from relax_core.health import Event, HealthPolicy, Heartbeats, RunFailed, first_line
from relax_core.optional import import_ray
from relax_core.ownership import crashed_in_reward, read_record
from relax_core.placement import NodePlacement
from relax_core.resume import CheckpointDir
from relax_core.role import Restart
from relax_core.roles import RolePlan, RoleRegistry
from relax_core.run import teacher_path

if TYPE_CHECKING:
    from relax_bus.ray_backend import RayBus


class _CannotRestartInPlace(Exception):
    pass


class AsyncRun:
    """The running roles of a fully-async run (each a Ray actor), the bus, and their supervision. The
    driver loop that uses it is :func:`relax_core.fully_async.run_fully_async`."""

    def __init__(
        self, cfg: Any, inputs: Any, notifier: Any, threads: int, roles: RoleRegistry | None = None
    ) -> None:
        """``roles``: the role registry (default: the installed roles, :class:`RoleRegistry`)."""
        self.ray = import_ray("--fully-async")
        self.cfg, self.inp = cfg, inputs
        self.plan = RolePlan.from_config(cfg, roles)
        self.notifier, self.threads = notifier, threads
        # Ray actor handles and object refs are typed Any: Ray's handles are dynamic (``.method.remote()``)
        self.roles: dict[str, Any] = {}
        self.futures: dict[str, Any] = {}
        self.done: Any = None
        self.bus: RayBus | None = None
        """Made by :meth:`start` (None before it and after :meth:`teardown`)."""
        self.policy = HealthPolicy(self.cfg.run.max_restarts_per_role, self.cfg.run.max_global_restarts)
        self.beats = Heartbeats(self.cfg.run.heartbeat_interval_s, self.cfg.run.heartbeat_timeout_s)
        self.start_step = 0
        self.engine_restarts = EngineRestarts(self.ray, self.policy.events, notifier)
        """Engine restarts asked of the rollout role."""
        self._nodes: NodePlacement | None = None
        self._recovering: dict[str, tuple[Event, float, Any]] = {}
        """Roles restarted in place and not yet serving: name -> (event, t0, the new actor's first heartbeat)."""

    # -- building ----------------------------------------------------------------------------------
    @property
    def nodes(self) -> NodePlacement:
        """Where the actors go: the nodes --role-nodes names, else the driver's (made on first use, once
        Ray is up)."""
        if self._nodes is None:
            self._nodes = NodePlacement(self.ray, self.cfg.run.role_nodes, list(self.plan.roles))
        return self._nodes

    def _build(self, name: str) -> Any:
        """Role ``name``'s actor, on the node :attr:`nodes` gives it (the driver's unless --role-nodes names
        another)."""
        assert self.bus is not None, "start() makes the bus before the roles"
        teacher = teacher_path(self.cfg, self.inp) if self.cfg.uses_teacher else None
        args, kwargs = self.plan.arguments(name, self.bus, self.inp, self.threads, teacher)
        where = self.nodes.strategy(name)
        cls = self.ray.remote(self.plan.role_class(name))
        return cls.options(num_cpus=0.1, max_concurrency=8, scheduling_strategy=where).remote(*args, **kwargs)

    @property
    def trainer(self) -> Any:
        """The trainer's actor (the current one: a restart replaces it)."""
        return self.roles[self.plan.trainer]

    @property
    def rollout(self) -> Any:
        """The rollout's actor (the current one)."""
        return self.roles[self.plan.rollout]

    def trainer_finished(self) -> bool:
        """Whether the trainer's loop returned (it did not fail): the run's training is over."""
        try:
            self.ray.get(self.done)
            return True
        except Exception:  # noqa: BLE001
            return False

    def connect_dcs(self, republish: bool) -> int:
        """(Re-)form the weight group: its rendezvous on the trainer's node, at the node's address (the
        receivers may be on other nodes)."""
        from relax_core.net import node_endpoint

        host, port = self.ray.get(self.trainer.__ray_call__.remote(lambda _self: node_endpoint()))
        init = f"tcp://{host}:{port}"
        receivers = self.plan.receivers
        out = self.ray.get(
            [self.trainer.connect_dcs.remote(init, 1 + len(receivers), republish)]
            + [
                self.roles[r].connect_dcs.remote(init, 1 + len(receivers), i + 1)
                for i, r in enumerate(receivers)
            ]
        )
        return int(out[0] or 0)

    def start(self, load: str | None) -> int:
        """Create the bus and every role, load ``load`` (a checkpoint) if given, start the loops."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from relax_bus import BusError
        from relax_bus.ray_backend import RayBus

        ray, cfg = self.ray, self.cfg
        from relax_core.placement import check_gpu_demand, gpu_demand

        gpus = ray.cluster_resources().get("GPU", 0)
        if gpus > 0:  # every role's GPUs apart: refuse now what Ray could never place
            check_gpu_demand(gpu_demand(cfg, self.plan), gpus)
        ckpt = CheckpointDir(load) if load else None
        resume = ckpt.bus_resume() if ckpt else None
        from_snapshot = resume is not None
        # the samples generated and not yet trained when the checkpoint was written come back as they were
        self.nodes.check()
        here = NodeAffinitySchedulingStrategy(self.nodes.driver_node, soft=False)  # (see NodePlacement)
        try:
            self.bus = (
                RayBus.restore(ckpt.bus, scheduling_strategy=here)
                if ckpt is not None and from_snapshot
                else RayBus.create(self.plan.bus_config(), scheduling_strategy=here)
            )
        except BusError as e:  # (whole by its manifest, damaged inside: a traceback before)
            raise CheckpointNotFound(f"--load {load}: {first_line(e, 500)}") from None
        if from_snapshot:  # outputs written before the snapshot but not acked: done, not computed again
            for name, written in self.plan.outputs.items():
                self.bus.reset_consumer(name, done_if_written=written)
        for name in [self.plan.trainer, self.plan.rollout, *self.plan.loops]:
            self.roles[name] = self._build(name)
        ray.get(self.rollout.reset_journal.remote())
        self.connect_dcs(republish=False)
        start = rollout_start = 0
        if load:
            meta = ray.get(self.trainer.load.remote(load))
            start = rollout_start = int(meta["version"])
            ray.get([self.roles[n].load_state.remote(load) for n in self.plan.stateful])
            if resume is not None:  # rollout goes on after the batches the snapshot holds
                rollout_start = int(resume["next_step"])
                ray.get(self.rollout.load_data_state.remote(resume["data"]))
                ray.get(self.rollout.seed_journal.remote(resume["begun"], rollout_start))
            elif "data" in meta:  # no bus snapshot: batches generated but never trained are drawn again
                ray.get(self.rollout.load_data_state.remote(meta["data"]))
            if self.bus.trainer_version < start:
                self.bus.set_trainer_version(start)
        ray.get(self.trainer.publish_weights.remote())
        ray.get(self.trainer.eval_now.remote(start))
        self.futures = {}
        self._start_loop(self.plan.rollout, rollout_start)
        self.resumed_from_bus = from_snapshot
        for name in self.plan.loops:
            self._start_loop(name, 0)
        self._start_loop(self.plan.trainer, start)
        self.start_step = start
        return start

    def _start_loop(self, name: str, start: int) -> None:
        """Start role ``name``'s loop, as its part runs one: the trainer's (its future is :attr:`done`)
        trains from step ``start`` to the run's end, the rollout's generates from step ``start``, a
        consumer's takes what comes."""
        part, actor = self.plan.roles[name].part, self.roles[name]
        if part == "trainer":
            self.done = actor.run.remote(start, self.cfg.train.num_rollout)
        elif part == "rollout":
            self.futures[name] = actor.run.remote(start)
        else:
            self.futures[name] = actor.run.remote()

    # -- supervision -------------------------------------------------------------------------------
    def poll(self) -> None:
        """One supervision round: loops that ended early and failed heartbeats are handled (restarted,
        escalated, or the run stops with :class:`RunFailed`); without the health manager a failed loop's
        error is re-raised as before."""
        ray = self.ray
        watched = dict(self.futures)
        watched[self.plan.trainer] = self.done
        ended, _ = ray.wait(list(watched.values()), num_returns=len(watched), timeout=0)
        failures: list[tuple[str, str]] = []
        for name, ref in watched.items():
            if ref not in ended or (ref is self.done and self.trainer_finished()):
                continue
            if not self.cfg.run.health:
                ray.get(ref)  # a role loop ended before the trainer: re-raise its error
                raise RuntimeError(f"the {name} loop stopped before training finished")
            try:
                ray.get(ref)
                failures.append((name, "its loop ended before training finished"))
            except Exception as e:  # noqa: BLE001 - the reason goes to the event and the notification
                self.policy.stop_if_unfixable(name, e)
                failures.append((name, first_line(e, 300)))
        self._recovered()
        if self.cfg.run.health and not failures:
            failures = self._heartbeats()
        for name, reason in failures[:1]:  # one at a time: a restart re-forms the group for everyone
            self.handle(name, reason)

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
                self.engine_restarts.ask(self.rollout, results[r]["failed_engines"])
        self.engine_restarts.collect()
        return self.beats.check(set(ready), results, now)

    def handle(self, name: str, reason: str, in_place_possible: bool = True) -> None:
        t0 = time.perf_counter()
        # (the rollout scores rewards: a process that died inside a reward left word of it)
        if self.plan.roles[name].part == "rollout" and (why := crashed_in_reward(self.cfg.run.output_dir)):
            reason = f"{reason}; {why}"
        ev = self.policy.decide(name, reason, in_place_possible)
        self.nodes.failed(name)  # (its node may be gone or cut off: its next actor goes elsewhere)
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
                self.policy.stop_if_unfixable(
                    name, e
                )  # (the new actor refused to start: the data changed, say)
                why = f"the restart failed: {first_line(e)}"
                ev = self.policy.escalate(ev, why)
                print(f"[relax] health: {why}; {ev.action.replace('_', ' ')}")
        while ev.action == "global_restart":
            try:
                self.global_restart()
                break
            except Exception as e:  # noqa: BLE001 - failed again while starting over: another try, or stop
                self.policy.stop_if_unfixable(name, e)
                why = f"the global restart failed: {first_line(e)}"
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
        """Replace one role's actor in place, redoing what its spec's restart steps say (the module
        docstring says why each role needs them), then start its loop again."""
        ray, spec = self.ray, self.plan.roles[name]
        steps = set(spec.restart)
        self._kill(name)
        ckpt = _trainer_checkpoint(self.bus, name, self.cfg) if Restart.CHECKPOINT in steps else None
        if Restart.LEASES in steps:
            assert self.bus is not None, "restarts happen while the run (and its bus) is up"
            self.bus.reset_consumer(name, done_if_written=list(spec.writes))
        new = self.roles[name] = self._build(name)
        start = 0
        if ckpt is not None:
            start = int(ray.get(new.load.remote(ckpt))["version"])
        if Restart.STATE in steps:  # (its newest saved state: what it trained since is trained again)
            ray.get(new.load_state.remote(None))
        if Restart.JOURNAL in steps:
            try:
                start = ray.get(new.recover.remote())
            except ray.exceptions.RayTaskError as e:  # its journal cannot say where to go on
                raise _CannotRestartInPlace(f"the {name} cannot go on in place: {e.cause}") from e
        if spec.part == "rollout":
            self.engine_restarts.forget()  # (a new rollout process has its own engines)
        if Restart.WEIGHTS in steps:
            version = self.connect_dcs(republish=True)
            if spec.receives_weights:
                ray.get(new.wait_weights.remote(version))
        self._start_loop(name, start)

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
        self.teardown()
        self.nodes.probe()  # (a node that died or was cut off since gets none of the new actors)
        ckpt = _latest_checkpoint(self.cfg)
        if ckpt is None:  # nothing saved yet: the run starts over, so it forgets what it logged
            log = Path(self.cfg.run.output_dir) / "metrics.jsonl"
            if log.is_file():
                os.replace(log, log.with_suffix(".before_restart.jsonl"))
        self.start(ckpt)

    def events(self) -> list[Event]:
        self._recovered(wait_s=60.0)  # (a role restarted near the end: its recovery still counts)
        return sorted(self.policy.events, key=lambda ev: ev.at)


def _latest_checkpoint(cfg: Any) -> str | None:
    """The run's newest checkpoint under --save (None: none saved, or no --save)."""
    from relax_core.checkpoints import latest_checkpoint

    if not cfg.train.save:
        return None
    try:
        return latest_checkpoint(cfg.train.save, read_record(cfg.run.output_dir).get("run_id"))
    except FileNotFoundError:
        return None


def _trainer_checkpoint(bus: RayBus | None, consumer: str, cfg: Any) -> str | None:
    """The checkpoint a new trainer (bus consumer ``consumer``) starts from; acks the batches it covers,
    gives back the rest."""
    assert bus is not None, "restarts happen while the run (and its bus) is up"
    acked = set(bus.consumed_ids(consumer))
    ckpt, covered = _latest_checkpoint(cfg), set()
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
    for lease_id, ids in bus.leases(consumer).items():
        if set(ids) <= covered:  # trained and saved; the process died before acking
            bus.ack(consumer, lease_id)
    bus.reset_consumer(consumer)
    return ckpt
