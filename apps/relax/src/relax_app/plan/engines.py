"""Simulated rollout engines: continuous batching on a virtual clock, behind the cost models.

An engine runs its responses together, one token each per decode step, each step costing what
:meth:`~relax_app.plan.costs.Costs.decode_steps` says for the batch and context it holds; it admits queued
requests while its KV cache has room, pays each one's prefill, and takes new weights either in place (partial
rollout: its responses go on under them) or once its responses have ended. Time advances in segments — from
one response's end to the next — so a run of millions of tokens is a few events per response.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_app.plan.costs import Costs


@dataclass
class Request:
    """One response to generate: ``length`` tokens after a prompt of ``prompt`` tokens."""

    step: int
    group: int
    index: int
    prompt: int
    length: int
    done: int = 0
    version: int | None = None
    """The weights' version at its first token (its sample's policy version: its oldest token's)."""


@dataclass
class Engine:
    """One engine of ``gpus`` devices; ``capacity`` requests at most at once (its KV cache's share)."""

    id: int
    gpus: int
    costs: Costs
    capacity: int
    version: int = 0
    t: float = 0.0
    """The virtual time its running batch has been advanced to."""
    running: list[Request] = field(default_factory=list)
    queue: deque[Request] = field(default_factory=deque)
    pending: tuple[int, float] | None = None
    """A weight version waiting for the running responses to end (no partial rollout): (version, bytes)."""
    ticket: int = 0
    """Bumped at every re-plan: an engine's older scheduled event is stale."""
    busy: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each stretch it was generating or loading weights."""
    pauses: list[float] = field(default_factory=list)
    static: bool = False
    """Static batching (relax's torch engine generating a whole batch): a batch's rows are computed until
    its longest response ends, and no request joins it meanwhile."""
    rows: int = 0
    """Rows of the static batch running."""
    _since: float | None = None

    def load(self) -> int:
        return len(self.running) + len(self.queue)

    def _context(self) -> int:
        return sum(r.prompt + r.done for r in self.running)

    def _rows(self) -> int:
        return max(len(self.running), self.rows) if self.static else len(self.running)

    def advance(self, now: float) -> None:
        """Decode up to ``now``: the whole steps that fit between the last advance and ``now``."""
        if not self.running or now <= self.t:
            self.t = max(self.t, now) if not self.running else self.t
            return
        left = min(r.length - r.done for r in self.running)
        times = np.cumsum(self.costs.decode_steps(self.gpus, self._rows(), self._context(), left))
        n = int(np.searchsorted(times, now - self.t + 1e-9, side="right"))  # (float sums: the scheduled end)
        if n:
            for r in self.running:
                r.done += n
            self.t += float(times[n - 1])

    def next_end(self) -> float | None:
        """When its next response ends, at the batch it runs now (None: it runs none)."""
        if not self.running:
            return None
        left = min(r.length - r.done for r in self.running)
        return self.t + float(self.costs.decode_steps(self.gpus, self._rows(), self._context(), left).sum())

    def finish(self, now: float) -> list[Request]:
        """Advance to ``now`` and take the responses that ended."""
        self.advance(now)
        ended = [r for r in self.running if r.done >= r.length]
        self.running = [r for r in self.running if r.done < r.length]
        return ended

    def start_queued(self, now: float) -> None:
        """Start queued requests while there is room (none while an update waits for the batch to end),
        each paying its prefill."""
        self.advance(now)
        self.t = max(self.t, now)
        new: list[Request] = []
        if self.static and self.running:
            return  # (a static batch takes no one until it ends)
        while self.queue and len(self.running) + len(new) < self.capacity and self.pending is None:
            r = self.queue.popleft()
            r.version = self.version
            new.append(r)
        if new:
            self.t += self.costs.forward_s(self.gpus, [r.prompt for r in new])
            self.running += new
            self.rows = len(self.running)
        self.mark(now)

    def take_weights(self, now: float, version: int, nbytes: float, in_place: bool) -> None:
        """A new version arrives: loaded now in place, or once the running responses end."""
        if in_place or not self.running:
            self.advance(now)
            pause = self.costs.load_pause_s(nbytes, self.gpus)
            self.busy.append((max(self.t, now), max(self.t, now) + pause))
            self.t = max(self.t, now) + pause
            self.version, self.pending = version, None
            self.pauses.append(pause)
        else:
            self.pending = (version, nbytes)

    def mark(self, now: float) -> None:
        """Open or close its busy stretch (at ``now``, after its batch changed)."""
        if self.running and self._since is None:
            self._since = now
        elif not self.running and self._since is not None:
            self.busy.append((self._since, max(now, self._since)))
            self._since = None

    def close(self, now: float) -> None:
        if self._since is not None:
            self.busy.append((self._since, now))
            self._since = None


def busy_seconds(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``spans`` inside [start, end] (spans of one lane do not overlap)."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def lengths(rng: np.random.Generator, n: int, spec: Any) -> Any:
    """``n`` response lengths of ``spec`` (a :class:`~relax_app.plan.config.Lengths`), cut at its ``max``
    (at least 1 token)."""
    if spec.kind == "lomax":
        out = np.floor(rng.pareto(spec.alpha, n) * spec.scale)
    elif spec.kind == "fixed":
        out = np.full(n, spec.mean)
    elif spec.kind == "lognormal":
        out = rng.lognormal(np.log(spec.mean) - spec.sigma**2 / 2, spec.sigma, n)
    else:  # pareto with that mean: x_m * alpha / (alpha - 1) = mean
        out = (rng.pareto(spec.alpha, n) + 1.0) * spec.mean * (spec.alpha - 1) / spec.alpha
    return np.clip(np.round(out), 1, spec.max).astype(int)
