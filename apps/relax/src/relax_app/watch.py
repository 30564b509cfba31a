"""`relax status RUN_DIR` (one snapshot) and `relax watch RUN_DIR` (refreshed until the run ends): each role's
state and weight version, the bus's depth and staleness, samples/s, reward and held-out accuracy.

Read from ``RUN_DIR/status.json``, which the run's driver rewrites as it goes (:mod:`relax_core.live`), so
this needs no connection to the run, its Ray cluster or its machine (a shared disk is enough), and works
the same for colocate and fully-async runs. A plain text view: on a terminal the screen is redrawn, into a
pipe or a file each refresh is printed after the last, separated by a blank line.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

from relax_core.live import FINAL_STATES, AgentStatus, BusStatus, RunStatus, WeightSyncStatus, read_status


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def run_state(s: RunStatus) -> str:
    """The run's state, as the file says, unless the file says it runs but its process is gone (a run
    killed without a chance to say so; checked only where that process would be, on this machine)."""
    if s.state in FINAL_STATES or s.host != socket.gethostname() or _alive(s.pid):
        return s.state
    return f"{s.state}? (its process {s.pid} is gone: killed; nothing was written since)"


def render(s: RunStatus, now: float | None = None) -> str:
    """The status as a few lines of text."""
    now = time.time() if now is None else now
    staleness = f", max staleness {s.max_staleness}" if s.mode == "fully_async" else ""
    lines = [
        f"run {s.output_dir}  [{s.mode}{staleness}]",
        f"state {run_state(s)}  step {s.step}/{s.num_steps}"
        + (f" ({s.phase})" if s.phase else "")
        + _clock(s, now),
        f"samples/s {_num(s.samples_per_s, '.2f')} (recent {_num(s.samples_per_s_recent, '.2f')})"
        f"  generated/s {_num(s.generated_per_s, '.2f')}  trained {s.samples_trained}",
        f"reward {_num(s.reward_mean)}  held-out accuracy {_num(s.eval_accuracy)}"
        + (f" (step {s.eval_step})" if s.eval_step is not None else ""),
    ]
    if s.bus is not None:
        b = s.bus
        waiting = ", ".join(f"{c} {n}" for c, n in b.available.items())
        lines.append(
            f"bus depth {b.depth}  {_oldest(s, b)}  dropped stale {b.dropped_stale}"
            + (f"  ready: {waiting}" if waiting else "")
        )
    if s.weight_sync is not None:
        lines.append(_sync(s.weight_sync))
    if s.agent is not None:
        lines.append(_agent(s.agent))
    if s.roles:
        lines.append(f"{'role':<12}{'state':<16}{'version':>8}{'idle s':>9}{'restarts':>10}  pid")
        for name, r in s.roles.items():
            version = "-" if r.version is None else f"v{r.version}"
            idle = "-" if r.idle_s is None else f"{r.idle_s:.1f}"
            lines.append(
                f"{name:<12}{r.state:<16}{version:>8}{idle:>9}{r.restarts:>10}  {r.pid if r.pid else '-'}"
            )
    if s.restarts:
        lines.append(f"restarts by the health manager: {s.restarts}")
    if s.message:
        lines.append(s.message)
    return "\n".join(lines)


def _sync(w: WeightSyncStatus) -> str:
    """The last weight sync: what went on the wire of the version's bytes, how long, the engines' pause."""
    mb = f"{w.bytes / 1e6:.2f} MB"
    sent = (
        mb
        if w.sent_bytes is None or w.sent_bytes == w.bytes
        else (f"{w.sent_bytes / 1e6:.3f} MB of {mb} ({100 * w.sent_bytes / max(w.bytes, 1.0):.1f}%)")
    )
    return f"weight sync v{w.step}: {sent} in {w.seconds:.3f}s, engine pause {w.pause_s:.3f}s"


def _agent(a: AgentStatus) -> str:
    """The last step's episodes: turns, how they ended, the turn latency, the tool calls that failed."""
    stops = ", ".join(f"{k} {v:g}" for k, v in sorted(a.stops.items(), key=lambda kv: -kv[1]))
    line = f"episodes v{a.step}: {a.turns_mean:.1f} turns, ended {stops or '-'}"
    if a.turn_s:
        line += "; turn s " + " ".join(
            f"{k} {a.turn_s[k]:.3f}" for k in ("p50", "p90", "p95", "p99") if k in a.turn_s
        )
    if a.tool_call_error_rate is not None:
        line += f"; tool calls failed {100 * a.tool_call_error_rate:.1f}%"
    for name, m in sorted(a.agents.items()):  # (multi-agent runs: one line per agent)
        line += f"\n  agent {name}: reward {m.get('reward_mean', float('nan')):.3f}"
        line += f", staleness {m.get('staleness_mean', float('nan')):.2f}, {m.get('turns_mean', 0):.1f} turns"
    return line


def _clock(s: RunStatus, now: float) -> str:
    """How long the run has been up, or, once it ended, how long it ran and when it ended (a finished run's
    "up" went on counting)."""
    if s.state in FINAL_STATES:
        return f"  ran {s.updated_at - s.started_at:.0f}s, ended {max(0.0, now - s.updated_at):.0f}s ago"
    return f"  up {now - s.started_at:.0f}s  updated {max(0.0, now - s.updated_at):.1f}s ago"


def _oldest(s: RunStatus, b: BusStatus) -> str:
    """The oldest sample waiting on the bus and how many updates behind the trainer it is. Not the
    staleness of what trains ("staleness 2" beside "max staleness 1" read as a broken bound): a waiting
    sample past --max-staleness is dropped, never trained, which this says."""
    if b.oldest_version is None or b.staleness is None:
        return "oldest waiting -"
    past = s.mode == "fully_async" and b.staleness > s.max_staleness
    return f"oldest waiting v{b.oldest_version} ({b.staleness} behind the trainer" + (
        f"; past --max-staleness {s.max_staleness}: dropped, not trained)" if past else ")"
    )


def _parse(argv: list[str], prog: str, interval: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"relax {prog}", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the run's --output-dir")
    if interval:
        p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
        p.add_argument("--timeout", type=float, default=None, help="stop watching after this many seconds")
    return p.parse_args(argv)


def status_main(argv: list[str]) -> int:
    """`relax status RUN_DIR`: print the run's status once."""
    args = _parse(argv, "status", interval=False)
    try:
        print(render(read_status(args.run_dir)))
    except FileNotFoundError as e:
        print(f"relax: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(_unreadable(Path(args.run_dir), e), file=sys.stderr)
        return 2
    return 0


DAMAGED_FOR_S = 10.0
"""How long ``relax watch`` reads a status file it cannot parse before it says so and stops (the run writes
it atomically, so only a damaged file, or one of another relax version, stays unreadable)."""


def _unreadable(path: Path, error: ValueError) -> str:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (
        f"relax: {path / 'status.json'}: damaged or of another relax version ({first}); the run rewrites it as"
        f" it goes, so a running run mends it: see `relax summary {path}` for a finished one"
    )


def watch_main(argv: list[str]) -> int:
    """`relax watch RUN_DIR`: print the status every --interval seconds until the run ends (or its process
    is gone, or --timeout); waits for a run that has not written its status yet, not for a status file that
    stays unreadable (:data:`DAMAGED_FOR_S`: before, it waited for ever)."""
    args = _parse(argv, "watch", interval=True)
    tty = sys.stdout.isatty()
    t0 = time.monotonic()
    path = Path(args.run_dir)
    damaged_since: float | None = None
    while True:
        try:
            s = read_status(path)
            damaged_since = None
        except FileNotFoundError:
            s = None
        except ValueError as e:
            s, now = None, time.monotonic()
            damaged_since = now if damaged_since is None else damaged_since
            if now - damaged_since >= min(DAMAGED_FOR_S, args.timeout or DAMAGED_FOR_S):
                print(_unreadable(path, e), file=sys.stderr)
                return 2
        if s is None:
            text = f"waiting for {path / 'status.json'} (the run writes it as it starts) ..."
        else:
            text = render(s)
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J")  # home, clear: the view redrawn in place
        print(text + ("" if tty else "\n"), flush=True)
        if s is not None and (s.state in FINAL_STATES or run_state(s) != s.state):
            return 0 if s.state != "failed" else 1
        if args.timeout is not None and time.monotonic() - t0 > args.timeout:
            return 0
        time.sleep(args.interval)
