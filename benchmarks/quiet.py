"""Is the machine quiet enough to time a run on, and how to make it busy on purpose (the shared condition).

A run is timed only on a quiet machine: before each one the CPUs' idle share over a second (from
``/proc/stat``: other processes' work shows there whatever the load average still remembers of our own
previous run) and a short matmul probe against the machine's quiet peak (``relax_core.roofline``). A run that
starts on a busy machine is marked and left out of the medians, never counted. The shared condition is the
same for every engine: one busy process per core beside the run, started before it and stopped after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

IDLE_MIN = 0.9
"""The idle share of the CPUs a quiet machine shows over the check's second."""
PROBE_MIN = 0.85
"""A quiet machine's probe reaches this share of its cached quiet peak."""


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs so far."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)


def machine_state(threads: int = 2, seconds: float = 1.0) -> dict:
    """The machine now: load average, idle share over ``seconds``, a probe's matmul rate against the quiet
    peak, and whether that makes it quiet."""
    from relax_core.roofline import matmul_peak, probe

    idle0, total0 = _cpu_times()
    time.sleep(seconds)
    idle1, total1 = _cpu_times()
    idle = (idle1 - idle0) / max(total1 - total0, 1)
    peak = matmul_peak(threads)  # (cached from a quiet probe)
    now = probe(threads, seconds=0.1).gflops if idle >= IDLE_MIN else None  # (not cached: a check)
    return {
        "load1": round(os.getloadavg()[0], 2),
        "idle": round(idle, 3),
        "probe_gflops": now,
        "peak_gflops": peak.gflops,
        "quiet": bool(now and idle >= IDLE_MIN and now >= PROBE_MIN * peak.gflops),
    }


def wait_quiet(threads: int = 2, patience_s: float = 120.0) -> dict:
    """:func:`machine_state`, checked again every 10 s until quiet or ``patience_s`` passed (the last one)."""
    deadline = time.monotonic() + patience_s
    while True:
        state = machine_state(threads)
        if state["quiet"] or time.monotonic() > deadline:
            return state
        time.sleep(10)


@contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each for the duration (the shared condition)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(1.0)  # (they are running before the timed run starts)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)
