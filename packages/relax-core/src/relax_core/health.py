"""The health manager's policy: which failure gets an in-place restart, which a global one, when to stop.

Why a separate, Ray-free piece: the decisions (bounds per role, escalation, the reason a run stops with)
are what users configure and what must be right; the mechanics (killing and re-creating actors,
re-forming the weight broadcast) live with the fully-async run (:mod:`relax_core.async_run`). Heartbeats:
every role answers ``heartbeat()`` with the seconds since its loop last made progress; a role that does
not answer, or whose loop is stuck past ``heartbeat_timeout_s``, counts as failed, like one whose process
died or whose loop raised.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Action = Literal["restart", "global_restart", "stop"]
"""What the policy decides for a failed role."""
EngineAction = Literal["restart", "given_up", "restart_failed"]
"""What came of an engine restart asked of the rollout role (its ``restart_engine``, or the call failing)."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def first_line(e: BaseException, limit: int = 200) -> str:
    """``Type: message`` in one line: the run's last line must name the failure alone. A Ray error carries a
    remote traceback whose first line says only where it ran: a task's error is said by its cause (the
    exception raised there) and where; an error with a traceback (an actor that died in its creation) by its
    first line and the traceback's last, the exception. Ray's colour codes are dropped."""
    lines = [ln for ln in _ANSI.sub("", str(e)).splitlines() if ln.strip()]
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and cause is not e:
        where = lines[0].split(" (pid=")[0].strip() if lines else ""
        return f"{first_line(cause, limit)} (in {where})" if where else first_line(cause, limit)
    if not lines:
        return f"{type(e).__name__}: "
    said = f"{type(e).__name__}: {lines[0].strip()[:limit]}"
    if any(ln.startswith("  File ") for ln in lines[1:]):
        said += f": {lines[-1].strip()[:limit]}"
    return said


class RunFailed(RuntimeError):
    """The health manager gave up: restarts exhausted. The message says which role, why and how often."""


class RunStalled(RunFailed):
    """No step trained for ``--stall-timeout-s`` while every role answers its heartbeat: the roles wait on
    each other (a deadlock), which no heartbeat can see. The message says where the run stands."""


@dataclass
class StallWatch:
    """Fails a run whose trainer makes no step for ``timeout_s`` (0: never): heartbeats show each role's
    loop alive, not that the run moves — a rollout and a trainer each polling for what the other will never
    give beat forever (the streaming deadlock #57's simulation found did, at step 0)."""

    timeout_s: float
    step: int | None = None
    since: float = field(default_factory=time.monotonic)
    restarts: int = 0

    def check(
        self, step: int, restarting: bool, where: Callable[[], str] | None = None, restarts: int = 0
    ) -> None:
        """``step``: the trainer's version now; ``restarting``: a role is being restarted (the clock starts
        again after it); ``restarts``: the health events so far — a new one starts the clock again too, so
        a restart that ran while no check could (a global one blocks the driver) is not counted as a stall;
        ``where()``: what the message adds (the bus's depth, what each consumer could take). Raises
        :class:`RunStalled` past the time-out."""
        now = time.monotonic()
        if step != self.step or restarting or restarts != self.restarts:
            self.step, self.since, self.restarts = step, now, restarts
            return
        if self.timeout_s and now - self.since > self.timeout_s:
            raise RunStalled(
                f"no step trained for {now - self.since:.0f} s (--stall-timeout-s {self.timeout_s:g}) while every "
                f"role answers its heartbeat: the roles wait on each other; the trainer is at version {step}"
                + (f"; {where()}" if where is not None else "")
                + ". Raise --stall-timeout-s if a step really takes this long"
            )


class Unfixable(RuntimeError):
    """A fault that a restart cannot fix (the data changed under the run, a setting refused): the run stops
    at once with it, instead of restarting the role in place and globally to the same end (before, a
    changed prompt file took 3 in-place restarts and a global one, 68 s, and a last line that did not say
    it). Subclass it for such a fault; a role raising one is never restarted."""


def unfixable(e: BaseException) -> str | None:
    """The one-line reason when ``e`` is, or reports from another process, an :class:`Unfixable`; else
    None. From a role, it arrives as Ray's error carrying the text of its traceback (an actor whose
    ``__init__`` raised it: ``ActorDiedError``, no longer of its class), whose last line names the class."""
    kinds: list[type] = [Unfixable]
    for kind in kinds:
        kinds.extend(kind.__subclasses__())
    names = {f"{k.__module__}.{k.__qualname__}: ": k.__name__ for k in kinds}
    for line in reversed(str(e).splitlines()):
        for full, short in names.items():
            if line.startswith(full):
                return f"{short}: {line[len(full) :][:500]}"
    return first_line(e, 500) if isinstance(e, Unfixable) else None


@dataclass
class Event:
    """One failure and what the manager did about it (kept for the run's result and notifications)."""

    role: str
    reason: str
    action: Action | EngineAction
    attempt: int
    at: float = field(default_factory=time.time)
    recovery_s: float | None = None
    """Seconds from detection until the role (or the whole run) was running again."""


class HealthPolicy:
    """Bounds: ``max_restarts_per_role`` in-place restarts per role, then a global restart (at most
    ``max_global_restarts``), then stop. A global restart resets the per-role counts."""

    def __init__(self, max_restarts_per_role: int, max_global_restarts: int) -> None:
        self.max_per_role, self.max_global = max_restarts_per_role, max_global_restarts
        self.per_role: dict[str, int] = {}
        self.global_restarts = 0
        self.events: list[Event] = []

    def decide(self, role: str, reason: str, in_place_possible: bool = True) -> Event:
        n = self.per_role.get(role, 0)
        if in_place_possible and n < self.max_per_role:
            self.per_role[role] = n + 1
            ev = Event(role, reason, "restart", n + 1)
        elif self.global_restarts < self.max_global:
            self.global_restarts += 1
            self.per_role = {}
            ev = Event(role, reason, "global_restart", self.global_restarts)
        else:
            ev = Event(role, reason, "stop", self.global_restarts)
        self.events.append(ev)
        return ev

    def escalate(self, ev: Event, why: str) -> Event:
        """An in-place restart was not possible after all (``why``): decide again without that option."""
        self.events.remove(ev)
        self.per_role[ev.role] = self.max_per_role  # no second in-place try for this failure
        return self.decide(
            ev.role, f"{ev.reason}; in-place restart impossible: {why}", in_place_possible=False
        )

    def give_up(self, role: str, reason: str) -> RunFailed:
        """``role`` failed with an :class:`Unfixable` fault (``reason``): a stop, recorded, and the error to
        raise (no restart tried)."""
        self.events.append(Event(role, reason, "stop", self.global_restarts))
        return RunFailed(
            f"role {role!r} failed ({reason}); a restart cannot fix this: stopped, with no more tried"
        )

    def stop_if_unfixable(self, role: str, e: BaseException) -> None:
        """Stop the run (:class:`RunFailed`, no restart) when ``role`` failed with a fault no restart fixes."""
        if fault := unfixable(e):
            raise self.give_up(role, fault) from None

    def stop_reason(self, ev: Event) -> str:
        return (
            f"role {ev.role!r} failed ({ev.reason}); giving up after {self.max_per_role} in-place restart(s) per "
            f"role and {self.global_restarts} global restart(s) (--max-restarts-per-role, --max-global-restarts)"
        )


@dataclass
class Heartbeats:
    """Tracks one outstanding ``heartbeat()`` call per role; reports roles that are silent or stuck."""

    interval_s: float
    timeout_s: float
    _pending: dict[str, tuple[Any, float]] = field(default_factory=dict)
    _last_sent: float = 0.0

    def due(self, now: float) -> bool:
        return now - self._last_sent >= self.interval_s

    def sent(self, role: str, ref: Any, now: float) -> None:
        self._last_sent = now
        self._pending.setdefault(role, (ref, now))

    def pending_refs(self) -> list[Any]:
        """The outstanding heartbeat calls (to wait on)."""
        return [ref for ref, _ in self._pending.values()]

    def forget(self, role: str) -> None:
        self._pending.pop(role, None)

    def check(self, ready: set[Any], results: dict[Any, Any], now: float) -> list[tuple[str, str]]:
        """``ready``: refs that completed; ``results``: their values (dict) or the exception raised.
        Returns (role, reason) for every role that failed its heartbeat."""
        failed = []
        for role, (ref, t) in list(self._pending.items()):
            if ref in ready:
                del self._pending[role]
                out = results.get(ref)
                if isinstance(out, BaseException):
                    failed.append((role, f"heartbeat failed: {first_line(out)}"))
                elif isinstance(out, dict) and out.get("error"):  # (alive, and unable to go on: say why)
                    failed.append((role, str(out["error"])))
                elif isinstance(out, dict) and out.get("age_s", 0.0) > self.timeout_s:
                    failed.append(
                        (
                            role,
                            f"no progress for {out['age_s']:.0f}s (--heartbeat-timeout-s {self.timeout_s:g})",
                        )
                    )
            elif now - t > self.timeout_s:
                del self._pending[role]
                failed.append(
                    (
                        role,
                        f"no heartbeat answer for {now - t:.0f}s (--heartbeat-timeout-s {self.timeout_s:g})",
                    )
                )
        return failed
