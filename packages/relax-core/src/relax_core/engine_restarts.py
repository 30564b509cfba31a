"""Engine restarts a fully-async run asks of its rollout role: engines run in their own processes under
the rollout role, which restarts one when asked; the health manager asks without waiting (its supervision
goes on meanwhile), and records each restart as an event once the rollout role answers.
A part of :class:`~relax_core.async_run.AsyncRun`.
"""

from __future__ import annotations

import time
from typing import Any

from relax_core.health import Event


class EngineRestarts:
    """Restarts under way (engine id -> the pending answer, its event, when it was asked) and the ones done."""

    def __init__(self, ray: Any, events: list[Event], notifier: Any) -> None:
        """``events``: the run's health events (each restart is appended); ``notifier``: told of each."""
        self.ray, self.events, self.notifier = ray, events, notifier
        self.jobs: dict[str, tuple[Any, Event, float]] = {}
        """engine id -> (pending ref, or None once handled; its event; when asked)."""

    def forget(self) -> None:
        """A new rollout process has engines of its own: the restarts asked of the old one are moot."""
        self.jobs = {}

    def ask(self, rollout: Any, failed: list[dict[str, Any]]) -> None:
        """Ask the ``rollout`` role's actor to restart each of ``failed`` (its heartbeat's ``failed_engines``)
        not already asked for."""
        for f in failed:
            if f["engine"] in self.jobs:
                continue
            ev = Event(f"engine {f['engine']}", str(f.get("reason")), "restart", 0)
            self.events.append(ev)
            self.jobs[f["engine"]] = (rollout.restart_engine.remote(f["engine"]), ev, time.perf_counter())

    def collect(self) -> None:
        """Record the restarts that answered since the last call (without waiting)."""
        for eid, (ref, ev, t0) in list(self.jobs.items()):
            if ref is None:
                continue  # handled already
            ready, _ = self.ray.wait([ref], timeout=0)
            if not ready:
                continue
            self.jobs[eid] = (None, ev, t0)
            try:
                out = self.ray.get(ref)
                ev.action, ev.attempt = out["action"], int(out["attempt"])
                ev.recovery_s = time.perf_counter() - t0 if out["action"] == "restart" else None
            except Exception as e:  # noqa: BLE001 - recorded; the other engines keep serving
                ev.action, ev.reason = "restart_failed", f"{ev.reason}; restart failed: {e}"
            self.notifier.restart(ev.attempt, f"rollout {ev.role} ({ev.action}): {ev.reason}")

    def finish(self, rollout: Any, timeout_s: float = 120.0) -> None:
        """At the end of the run: restart engines that failed since the last heartbeat and wait for the
        restarts under way, so the run ends with its engines whole and the record complete."""
        beat = self.ray.get(rollout.heartbeat.remote())
        if beat.get("failed_engines"):
            self.ask(rollout, beat["failed_engines"])
        pending = [ref for ref, _, _ in self.jobs.values() if ref is not None]
        if pending:
            self.ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        self.collect()
