"""The fully-async driver's look at its roles for the live status (:mod:`relax_core.live`).

Why apart from the driver loop (:mod:`relax_core.fully_async`): what it asks and how it never blocks is
its own concern; the loop only calls :meth:`AsyncProbe.tick`. Every role is a Ray actor here: the probe
asks each one's ``heartbeat()`` (its pid, the age of its loop's progress; the trainer's version) and the
weight version it holds (the rollout's engine, ActorFwd's subscriber), the bus its ``stats()``, and for the
trace each role's spans, and reads the answers that came back within 0.2 s, the rest at a later tick.
"""

from __future__ import annotations

import time
from typing import Any

from relax_core.health import StallWatch
from relax_core.live import HealthEvent, LiveStatus


class AsyncProbe:
    """The driver's look at the roles for the live status (:mod:`relax_core.live`): every ``interval_s``
    it asks each role for its heartbeat and the weight version it holds, and the bus for its stats, and
    every few seconds the roles for their trace spans. It waits at most 0.2 s for the answers; one not
    there yet is read at a later tick, so a role that hangs never holds up the supervision loop."""

    def __init__(self, run: Any, live: LiveStatus, interval_s: float = 1.0) -> None:
        """``run``: the :class:`~relax_core.async_run.AsyncRun` (its roles, bus and health policy)."""
        self.run, self.live, self.interval_s = run, live, interval_s
        self.step = 0
        """The trainer's version, as last heard."""
        self._asked: dict[str, tuple[float, Any, Any, Any]] = {}
        """Role -> (when asked, the actor asked, its heartbeat call, its weight-version call or None)."""
        self._last = 0.0
        self.stall = StallWatch(run.cfg.run.stall_timeout_s)
        """No step for ``--stall-timeout-s`` while every role answers: the run stops saying where it stands."""
        self._span_calls: tuple[float, list[Any]] | None = None
        """The roles' ``get_spans`` calls under way for the next trace flush: (when asked, the calls)."""

    def where(self) -> str:
        """Where a stalled run stands (:class:`~relax_core.health.StallWatch`'s message): the samples on the
        bus, and how many each consumer could take."""
        try:
            stats = self.run.bus.stats() if self.run.bus is not None else {}
        except Exception as e:  # noqa: BLE001 - the message goes on without it
            return f"the bus did not answer ({type(e).__name__})"
        return f"the bus holds {stats.get('depth')} samples, of them ready per consumer {stats.get('available', {})}"

    def _version_call(self, name: str, actor: Any) -> Any:
        if self.run.plan.roles[name].receives_weights:  # (the rollout, ActorFwd)
            return actor.weight_version.remote()
        return None  # the trainer's heartbeat says its version; the other roles hold no policy weights

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        ray, run, live = self.run.ray, self.run, self.live
        for name, actor in list(run.roles.items()):
            asked = self._asked.get(name)
            if asked is None or asked[1] is not actor:  # (a restart replaced the actor asked)
                self._asked[name] = (now, actor, actor.heartbeat.remote(), self._version_call(name, actor))
        for name in set(self._asked) - set(run.roles):
            del self._asked[name]
        refs = [r for *_, beat, version in self._asked.values() for r in (beat, version) if r is not None]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0.2)[0])  # (answers take milliseconds)
        restarting = run.restarting()
        for name, (t, _, beat, version) in list(self._asked.items()):
            if beat in ready and (version is None or version in ready):
                del self._asked[name]
                self._read(name, beat, version)
            elif name in restarting:
                live.role(name, state="restarting")
            elif now - t > 10.0:
                live.role(name, state="not answering", idle_s=round(now - t, 1))
        try:
            if run.bus is not None:  # (none between a teardown and the next start)
                live.bus(run.bus.stats())
        except Exception:  # noqa: BLE001 - the bus restarting with the run
            pass
        self.stall.check(self.step, bool(restarting), self.where, len(run.policy.events))
        events = sorted(run.policy.events, key=lambda e: e.at)[-100:]
        live.update(
            step=self.step,
            restarts=len(run.policy.events),
            events=[HealthEvent(**vars(e)) for e in events],
        )
        self._trace(now)

    def _trace(self, now: float) -> None:
        ray, live = self.run.ray, self.live
        if self._span_calls is None:
            if live.trace_due():
                self._span_calls = (now, [r.get_spans.remote() for r in self.run.roles.values()])
            return
        t, calls = self._span_calls
        if len(ray.wait(calls, num_returns=len(calls), timeout=0)[0]) == len(calls):
            self._span_calls = None
            live.flush_trace(lambda: ray.get(calls), force=True)  # (a role that died: skipped this time)
        elif now - t > 60.0:
            self._span_calls = None

    def _read(self, name: str, beat: Any, version: Any) -> None:
        ray, run = self.run.ray, self.run
        try:
            b = ray.get(beat)
            v = ray.get(version) if version is not None else b.get("version")
        except Exception:  # noqa: BLE001 - the actor died; supervision handles it
            self.live.role(name, state="not answering")
            return
        idle = float(b.get("age_s", 0.0))
        state = "running"
        if name in run.restarting():
            state = "restarting"
        elif idle > run.cfg.run.heartbeat_timeout_s / 2:
            state = "stalled"
        restarts = sum(ev.role == name for ev in run.policy.events)
        self.live.role(
            name, state=state, pid=b.get("pid"), idle_s=round(idle, 1), version=v, restarts=restarts
        )
        if run.plan.roles[name].part == "trainer" and v is not None:
            self.step = int(v)
