"""The run as it goes, on disk: ``<output_dir>/status.json`` (what ``relax status`` / ``relax watch`` show)
and ``trace.json`` flushed while the run goes.

Why files: the run's process is busy, and in fully-async mode its roles are Ray actors that only the
driver reaches; a file in the output directory is what any shell, a notebook or another machine sharing
the disk can read, with nothing to connect to. Both files are replaced atomically (written beside, then
renamed): a reader sees the previous version or the new one, never half of one, so each is valid JSON at
every moment.

Who writes what: the driver (this process) writes ``status.json`` — in colocate mode at every turn of a
step, in fully-async mode about once a second from its supervision loop, with what it asked the roles
(their heartbeats and weight versions) and the bus (depth, the oldest sample's version). The figures a
step logs (reward, held-out accuracy, samples trained) come from ``metrics.jsonl``, which the trainer
appends to as it goes: :class:`MetricsTail` reads only what was added since its last look. Writing the
status never decides the run's fate: a failed write is logged once and the run goes on.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from relax_core.ownership import write_atomically as write_json_atomically
from relax_core.trace import write_trace

logger = logging.getLogger(__name__)

STATUS_FILE = "status.json"
RunState = Literal["starting", "running", "finishing", "done", "stopped", "failed"]
FINAL_STATES = ("done", "stopped", "failed")
"""States after which the run's process no longer writes the file."""


class RoleStatus(BaseModel):
    """One role as the driver last saw it."""

    state: str = "starting"
    """``running``; ``restarting`` (the health manager replaced it and it is loading); ``stalled`` (its loop
    made no progress for a while); ``not answering``; in colocate mode the turn it is taking (``generating``,
    ``computing``, ``training``) or ``waiting``."""
    version: int | None = None
    """The policy version (trainer steps) of the weights it holds; None for roles without the policy's
    weights (Reference, Teacher, Advantages)."""
    pid: int | None = None
    """Its process (fully async: a Ray actor's)."""
    idle_s: float | None = None
    """Seconds since its loop last made progress (its heartbeat's age)."""
    restarts: int = 0
    """In-place restarts so far."""


class BusStatus(BaseModel):
    """The data bus between the rollout and the trainer."""

    depth: int = 0
    """Samples on the bus now: generated, not trained yet."""
    available: dict[str, int] = Field(default_factory=dict)
    """Per consumer, samples ready for it and not yet taken."""
    oldest_version: int | None = None
    """The policy version of the oldest sample on the bus (None: empty)."""
    staleness: int | None = None
    """The trainer's version minus ``oldest_version``: how many updates behind the oldest waiting sample is."""
    dropped_stale: int = 0
    """Samples dropped for exceeding --max-staleness, all consumers."""
    samples_put: int = 0
    """Samples the rollout has put on the bus since the run started."""


class WeightSyncStatus(BaseModel):
    """The last training step's weight sync, as the trainer logged it (``perf/weight_*`` in metrics.jsonl)."""

    step: int
    """The step whose weights these were (its version)."""
    bytes: float
    """The version's whole size."""
    sent_bytes: float | None = None
    """What DCS put on the wire (with ``--weight-sync-delta``: the deltas); None without DCS."""
    seconds: float
    """The sync's seconds: DCS's broadcast where there is one, else the trainer's publish."""
    pause_s: float = 0.0
    """The longest an engine stood still for one update (the rollout's batches the step trained)."""


class AgentStatus(BaseModel):
    """The last training step's multi-turn episodes, as the trainer logged them (``rollout/turns_mean``,
    ``rollout/stop/*``, ``rollout/turn_s_p*``, ``rollout/tool_call_error_rate``)."""

    step: int
    turns_mean: float
    stops: dict[str, float] = {}
    """Episodes per stop reason (``env_done``, ``max_turns``, ``engine_length``, ``env_error``, ...)."""
    turn_s: dict[str, float] = {}
    """Per-turn generation latency percentiles: ``p50``, ``p90``, ``p95``, ``p99`` (seconds)."""
    tool_call_error_rate: float | None = None
    agents: dict[str, dict[str, float]] = {}
    """Multi-agent runs (--agents): per agent its ``reward_mean``, ``staleness_mean``, ``turns_mean``, ..."""

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> AgentStatus:
        agents: dict[str, dict[str, float]] = {}
        for k, v in row.items():
            if k.startswith("rollout/agent/"):
                name, _, metric = k.removeprefix("rollout/agent/").partition("/")
                agents.setdefault(name, {})[metric] = v
        return cls(
            agents=agents,
            step=int(row.get("step", 0)),
            turns_mean=row["rollout/turns_mean"],
            stops={
                k.removeprefix("rollout/stop/"): v for k, v in row.items() if k.startswith("rollout/stop/")
            },
            turn_s={
                k.removeprefix("rollout/turn_s_"): v
                for k, v in row.items()
                if k.startswith("rollout/turn_s_")
            },
            tool_call_error_rate=row.get("rollout/tool_call_error_rate"),
        )


class HealthEvent(BaseModel):
    """A failure the health manager saw and what it did (``relax_core.health.Event``), for `relax ui`'s
    timeline."""

    role: str
    reason: str
    action: str
    attempt: int
    at: float
    """When it was detected (wall clock)."""
    recovery_s: float | None = None


class RunStatus(BaseModel):
    """``<output_dir>/status.json``: the whole run at one moment."""

    state: RunState = "starting"
    """``starting`` (roles loading), ``running``, ``finishing`` (final evaluation and checkpoint), then
    ``done``, ``stopped`` (by a signal, with a checkpoint) or ``failed``."""
    mode: str = ""
    """``colocate`` or ``fully_async``."""
    max_staleness: int = 0
    """--max-staleness."""
    output_dir: str = ""
    pid: int = Field(default_factory=os.getpid)
    """The driver's process: a status file that says ``running`` with this process gone is a dead run's."""
    host: str = Field(default_factory=socket.gethostname)
    started_at: float = Field(default_factory=time.time)
    """Unix time the run started."""
    updated_at: float = Field(default_factory=time.time)
    """Unix time of this snapshot."""
    step: int = 0
    """Training steps done (the trainer's version)."""
    num_steps: int = 0
    """--num-rollout: the steps the run is to train."""
    phase: str | None = None
    """Colocate: the turn of the step under way (``generate``, ``compute``, ``train``)."""
    samples_trained: int = 0
    """Samples trained since this process started training (from metrics.jsonl)."""
    samples_per_s: float | None = None
    """Trained samples per second since training started."""
    samples_per_s_recent: float | None = None
    """Trained samples per second over the last few steps."""
    generated_per_s: float | None = None
    """Samples the rollout put on the bus per second since training started."""
    reward_mean: float | None = None
    """The last trained step's mean rollout reward."""
    eval_accuracy: float | None = None
    """The last held-out accuracy, measured at ``eval_step``."""
    eval_step: int | None = None
    roles: dict[str, RoleStatus] = Field(default_factory=dict)
    bus: BusStatus | None = None
    weight_sync: WeightSyncStatus | None = None
    agent: AgentStatus | None = None
    """Multi-turn runs: the last step's episodes (turns, stop reasons, turn latency, tool-call errors)."""
    restarts: int = 0
    """Restarts the health manager made (in place and global)."""
    events: list[HealthEvent] = Field(default_factory=list)
    """The health manager's last failures and actions (at most 100), oldest first."""
    message: str | None = None
    """Why the run stopped or failed; where its checkpoint is."""


def status_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / STATUS_FILE


def read_status(run_dir: str | Path) -> RunStatus:
    """The run's last status; ``FileNotFoundError`` naming the file when the directory has none."""
    path = status_path(run_dir)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no status file; give the --output-dir of a run started with relax-core 0.6 or later"
        )
    return RunStatus.model_validate_json(path.read_text())


class MetricsTail:
    """Reads what the trainer appended to ``metrics.jsonl`` since the last look (a line not ended yet waits
    for its newline); a file that shrank (a global restart starts it again) is read from its start."""

    RECENT = 5
    """Steps the recent samples/s is measured over."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self.steps: list[tuple[float, float]] = []
        """(time, samples) of every training step logged."""
        self.reward: float | None = None
        self.eval: tuple[int, float] | None = None
        self.sync: WeightSyncStatus | None = None
        self.agent: AgentStatus | None = None
        self.last_step = 0
        """The last training step logged."""

    def read(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self.offset:
            self.offset, self.steps, self.last_step = 0, [], 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read(size - self.offset)
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "rollout/reward_mean" in row:
                self.reward, self.last_step = row["rollout/reward_mean"], int(row.get("step", 0))
                self.steps.append((float(row.get("time", time.time())), float(row.get("perf/samples", 0))))
            if "eval/accuracy" in row:
                self.eval = (int(row["step"]), row["eval/accuracy"])
            if "rollout/turns_mean" in row:
                self.agent = AgentStatus.from_row(row)
            if "perf/weight_sync_bytes" in row:
                self.sync = WeightSyncStatus(
                    step=int(row.get("step", 0)),
                    bytes=row["perf/weight_sync_bytes"],
                    sent_bytes=row.get("perf/weight_sync_sent_bytes"),
                    seconds=row.get("perf/weight_sync_broadcast_s", row.get("perf/weight_sync_s", 0.0)),
                    pause_s=row.get("perf/weight_pause_s", 0.0),
                )

    def recent_rate(self) -> float | None:
        last = self.steps[-self.RECENT - 1 :]
        if len(last) < 2 or last[-1][0] <= last[0][0]:
            return None
        return sum(s for _, s in last[1:]) / (last[-1][0] - last[0][0])


class LiveStatus:
    """The driver's writer of ``status.json`` and of the trace while the run goes."""

    def __init__(self, cfg: Any, min_interval_s: float = 0.5, trace_interval_s: float = 10.0) -> None:
        out = Path(cfg.run.output_dir)
        self.path = status_path(out)
        self.status = RunStatus(
            mode=cfg.run.mode,
            max_staleness=cfg.run.max_staleness,
            output_dir=str(out),
            num_steps=cfg.train.num_rollout,
        )
        self.tail = MetricsTail(out / "metrics.jsonl")
        if self.tail.path.is_file():  # (a resumed run appends: its rates count from here)
            self.tail.offset = self.tail.path.stat().st_size
        self.trace_path = out / "trace.json" if cfg.run.trace else None
        self.min_interval_s, self.trace_interval_s = min_interval_s, trace_interval_s
        self._written = self._traced = 0.0
        self._t_train: float | None = None
        self._put_at_start = 0
        self._warned = False

    def training(self, step: int) -> None:
        """Training starts (at ``step`` when resuming): rates are measured from here."""
        self._t_train = time.time()
        self.update(state="running", step=step, force=True)

    def update(self, force: bool = False, **fields: Any) -> None:
        """Set ``fields`` and write the file (at most every ``min_interval_s`` unless ``force``)."""
        s = self.status
        for k, v in fields.items():
            setattr(s, k, v)
        now = time.time()
        if not force and now - self._written < self.min_interval_s:
            return
        self.tail.read()
        s.samples_trained = int(sum(n for _, n in self.tail.steps))
        s.step = max(s.step, self.tail.last_step)  # (the trainer's heartbeat may be a moment behind its log)
        s.reward_mean = self.tail.reward
        s.eval_step, s.eval_accuracy = self.tail.eval or (None, None)
        s.weight_sync = self.tail.sync
        s.agent = self.tail.agent
        s.samples_per_s_recent = self.tail.recent_rate()
        if self._t_train is not None and now > self._t_train:
            s.samples_per_s = s.samples_trained / (now - self._t_train)
            if s.bus is not None:
                s.generated_per_s = (s.bus.samples_put - self._put_at_start) / (now - self._t_train)
        s.updated_at = now
        self._written = now
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomically(self.path, s.model_dump_json(indent=1))
        except OSError as e:
            if not self._warned:
                logger.warning("cannot write %s (the run goes on without it): %s", self.path, e)
                self._warned = True

    def bus(self, stats: dict[str, Any]) -> None:
        """Take the bus's ``stats()``."""
        oldest = stats.get("oldest_policy_version")
        consumers = stats.get("consumers", {})
        bus = BusStatus(
            depth=int(stats.get("live", 0)),
            available={c: int(v.get("available", 0)) for c, v in consumers.items()},
            oldest_version=oldest,
            staleness=None if oldest is None else int(stats.get("trainer_version", 0)) - int(oldest),
            dropped_stale=sum(int(v.get("dropped_stale", 0)) for v in consumers.values()),
            samples_put=int(stats.get("samples_put", 0)),
        )
        if self.status.bus is None or self._t_train is None or bus.samples_put < self._put_at_start:
            self._put_at_start = bus.samples_put
        self.status.bus = bus

    def role(self, name: str, **fields: Any) -> None:
        """Set fields of role ``name``'s status (created on first use)."""
        role = self.status.roles.setdefault(name, RoleStatus())
        for k, v in fields.items():
            setattr(role, k, v)

    def trace_due(self) -> bool:
        """Whether the trace is due a flush: every ``trace_interval_s`` at most, and apart by at least 20
        times what the last flush took (a long run's trace grows)."""
        return self.trace_path is not None and time.time() - self._traced >= self.trace_interval_s

    def flush_trace(self, spans: Callable[[], list[list[dict[str, Any]]]], force: bool = False) -> None:
        """Rewrite trace.json from every role's spans so far (``spans()``) when it is due (or ``force``)."""
        if self.trace_path is None or not (force or self.trace_due()):
            return
        t0 = time.time()
        try:
            write_trace(self.trace_path, [s for role in spans() for s in role])
        except Exception as e:  # noqa: BLE001 - a role restarting; the next flush or the run's end writes it
            logger.debug("trace flush skipped: %s", e)
        took = time.time() - t0
        self._traced = time.time() + max(0.0, 20 * took - self.trace_interval_s)

    def finish(self, state: RunState, message: str | None = None) -> None:
        for role in self.status.roles.values():
            role.state = "done" if state != "failed" else role.state
        self.update(state=state, message=message, phase=None, force=True)
