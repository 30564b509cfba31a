"""A timeline of every role's phases, written as a Chrome trace (``<output_dir>/trace.json``).

Metrics say how long each phase took; only a timeline shows what ran *at the same time*, which is what
fully-async mode buys over colocate. Each role records a few spans per step with a :class:`Tracer`
(``with tracer.span("generate", step=k): ...``); starts are wall-clock (``time.time_ns()``) so spans
recorded in different processes line up, durations monotonic. The controller gathers every role's spans
(``get_spans()``) and :func:`write_trace` merges them into the Chrome trace event format, which
chrome://tracing and https://ui.perfetto.dev open: one process row per role, one thread row per lane
(spans of a role that overlap, e.g. generation and scoring in two threads, go to separate lanes). The
driver rewrites the file while the run goes (every few seconds, :class:`relax_core.live.LiveStatus`), so
a long run's timeline can be opened before it ends.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from relax_core.ownership import write_atomically


class Tracer:
    """Records spans of one role; cheap enough to leave on (a few spans per step)."""

    def __init__(self, role: str, enabled: bool = True) -> None:
        self.role, self.enabled = role, enabled
        self.spans: list[dict[str, Any]] = []

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Time the block; yields its ``args`` dict so the block can add figures known only inside."""
        if not self.enabled:
            yield args
            return
        start, t0 = time.time_ns(), time.perf_counter_ns()
        try:
            yield args
        finally:
            self.spans.append(
                {
                    "name": name,
                    "role": self.role,
                    "thread": threading.current_thread().name,
                    "start_ns": start,
                    "dur_ns": time.perf_counter_ns() - t0,
                    "args": args,
                }
            )

    def add(self, name: str, start_ns: int, end_ns: int, lane: str, **args: Any) -> None:
        """A span timed elsewhere (wall-clock ``time.time_ns()`` both ends): work that begins on one thread
        and ends on another, e.g. a streamed group generating across the engine's decode steps.
        ``lane`` names its row (overlapping spans of one lane are spread over rows as usual)."""
        if self.enabled:
            self.spans.append(
                {
                    "name": name,
                    "role": self.role,
                    "thread": lane,
                    "start_ns": start_ns,
                    "dur_ns": max(0, end_ns - start_ns),
                    "args": args,
                }
            )

    def get_spans(self) -> list[dict[str, Any]]:
        return list(self.spans)


def _lanes(spans: list[dict[str, Any]]) -> list[int]:
    """Per span, the lowest lane where it overlaps no other span: events on one row must not cross."""
    ends: list[int] = []
    lane_of = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda i: (spans[i]["start_ns"], -spans[i]["dur_ns"])):
        s = spans[i]
        lane = next((k for k, end in enumerate(ends) if end <= s["start_ns"]), len(ends))
        if lane == len(ends):
            ends.append(0)
        ends[lane] = s["start_ns"] + s["dur_ns"]
        lane_of[i] = lane
    return lane_of


def chrome_trace(spans: Iterable[dict[str, Any]], order: Sequence[str] = ()) -> dict[str, Any]:
    """Spans from any number of roles -> a Chrome trace (JSON object format). Rows top to bottom: the roles
    of ``order`` (a run's :class:`~relax_core.roles.RolePlan` in data order: generation down to training),
    then any other role by name."""
    spans = list(spans)
    origin = min((s["start_ns"] for s in spans), default=0)
    rank = {role: k for k, role in enumerate(order)}
    roles = sorted({s["role"] for s in spans}, key=lambda r: (rank.get(r, len(rank)), r))
    events: list[dict[str, Any]] = []
    for pid, role in enumerate(roles, start=1):
        mine = [s for s in spans if s["role"] == role]
        lanes = _lanes(mine)
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": role}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
        for lane in sorted(set(lanes)):
            label = role if lane == 0 else f"{role} ({lane + 1})"
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": lane, "args": {"name": label}}
            )
        for s, lane in zip(mine, lanes):
            events.append(
                {
                    "name": s["name"],
                    "cat": role,
                    "ph": "X",
                    "ts": (s["start_ns"] - origin) / 1000.0,
                    "dur": max(s["dur_ns"], 0) / 1000.0,
                    "pid": pid,
                    "tid": lane,
                    "args": {**_jsonable(s.get("args", {})), "thread": s.get("thread", "")},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_unix_ns": origin}}


def _jsonable(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v) for k, v in args.items()}


def write_trace(path: str | Path, spans: Iterable[dict[str, Any]]) -> Path:
    """Write the merged timeline; returns its path. Rows in the order the roles first appear in ``spans``
    (the drivers list each role's spans in their plan's data order). Atomically (written beside, then
    renamed): the run rewrites it as it goes (:mod:`relax_core.live`), and a viewer opening it meanwhile
    must get valid JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    spans = list(spans)
    order = list(dict.fromkeys(s["role"] for s in spans))
    write_atomically(path, json.dumps(chrome_trace(spans, order)))
    return path


WORK_SPANS = frozenset(
    {
        "generate",
        "reward",
        "forward",
        "advantages",
        "train",
        "train_part",
        "optimizer_step",
        "weight_sync",
        "eval",
    }
)
"""The spans in which a role computes (waits, saves and device hand-overs are not work)."""


def core_busy_share(trace: dict[str, Any], cores: int) -> dict[str, float]:
    """How much of the machine a run's roles kept busy, from its Chrome trace (:func:`chrome_trace`):
    ``role_s`` the role-seconds of work (per role the union of its work spans: a role's overlapping spans,
    e.g. the groups a streaming rollout generates at once, are one process computing), ``wall_s`` from the
    first span to the last, and ``share`` = role_s / (cores × wall_s), the share of core-seconds busy if each
    working role kept one core busy. (A role's torch threads may use more than one core: a lower bound of
    the machine's use, and the figure that shows where roles wait for each other.)"""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if not events:
        return {"role_s": 0.0, "wall_s": 0.0, "share": 0.0}
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    role_us = 0.0
    for pid in {e["pid"] for e in events}:
        spans = sorted(
            (e["ts"], e["ts"] + e["dur"]) for e in events if e["pid"] == pid and e["name"] in WORK_SPANS
        )
        cur_start, cur_end = None, None
        for s, t in spans:  # the union of the role's work intervals
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    role_us += cur_end - cur_start
                cur_start, cur_end = s, t
            else:
                cur_end = max(cur_end, t)
        if cur_end is not None:
            role_us += cur_end - cur_start
    wall_us = max(end - start, 1e-9)
    return {"role_s": role_us / 1e6, "wall_s": wall_us / 1e6, "share": role_us / (cores * wall_us)}
