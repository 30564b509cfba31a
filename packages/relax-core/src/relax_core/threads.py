"""Torch's intra-op threads on a shared machine: one thread while other processes want the cores.

Why: torch's OpenMP team waits at a barrier after every operation. On a quiet 2-core machine two threads
are the fastest (the CPU demo in colocate: ~830 samples/s against ~590 with one), but when other processes
hold the cores a team member is descheduled and every barrier waits for it: with four busy processes on
the 2 cores the same run made **20 samples/s with two threads and 203 with one** (a matmul loop: 560x
slower with two threads, 1.4x with one). ``OMP_WAIT_POLICY=PASSIVE`` avoids the collapse (133
samples/s) but costs 45% on a quiet machine (454), and the user's environment is not ours to rely on.

So a run measures how long its own threads waited for a core (Linux ``/proc/self/task/*/schedstat``, the
run-queue delay) per second of wall time between two checks: ~0.001 on a quiet machine, ~1.3 with the
busy processes. Above ``CONTENDED``, confirmed by a 50 ms probe (small matrix products on the full
thread count), it drops to one thread. One thread shows no delay even when the machine is busy, so the
probe runs again now and then (after 4 checks, then 8, 16, ... up to ``MAX_BACKOFF``) and the full
count comes back when the probe finds the cores free. A probe also runs before the first step. Where
``schedstat`` is missing (not Linux) nothing changes.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Callable


def run_delay_ns() -> int | None:
    """Nanoseconds this process's threads have waited on a run queue (None where Linux does not say)."""
    total, seen = 0, False
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):  # (a thread that ended meanwhile)
            continue
    return total if seen else None


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def probe_contention(threads: int, seconds: float = 0.05) -> float:
    """Run-queue delay per wall second while ``threads`` torch threads multiply small matrices for about
    ``seconds``: ~0 when the cores are free, ~1 when other processes hold them (each operation's barrier
    then waits for a descheduled thread). Torch's thread count is left as it was."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    x, w = torch.ones(64, 256), torch.ones(256, 256)
    try:
        d0, t0 = run_delay_ns(), time.monotonic()
        while time.monotonic() - t0 < seconds:
            x @ w
        d1, t1 = run_delay_ns(), time.monotonic()
    finally:
        torch.set_num_threads(before)
    return 0.0 if d0 is None or d1 is None else (d1 - d0) / 1e9 / (t1 - t0)


class ThreadGovernor:
    """Between steps, :meth:`check` sets torch's threads: ``threads`` while the cores are free, one while
    they are contended (see the module)."""

    CONTENDED = 0.25
    """Run-queue delay per wall second (summed over the threads) above which the cores count as taken."""
    MAX_BACKOFF = 64

    def __init__(
        self,
        threads: int,
        read_delay: Callable[[], int | None] = run_delay_ns,
        set_threads: Callable[[int], None] = _set_torch_threads,
        probe: Callable[[int], float] = probe_contention,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = print,
    ) -> None:
        self.full, self.now = threads, threads
        self.read_delay, self.set_threads, self.probe = read_delay, set_threads, probe
        self.clock, self.log = clock, log
        self.backoff, self.until_probe = 4, 0
        self.switches = 0
        self._mark = (self.read_delay(), self.clock())

    @property
    def active(self) -> bool:
        return self.full > 1 and self._mark[0] is not None

    def start(self) -> None:
        """Before the first step: one thread already if a probe finds the cores taken; measure from now on
        (loading and the first evaluation do not count)."""
        if self.active and self._probe_taken():
            self._one_thread("a probe found the cores taken by other processes")
        self._mark = (self.read_delay(), self.clock())

    def check(self) -> int:
        """Measure the delay since the last check and set the thread count for the next step; returns it.
        With the full count, a contended interval is confirmed by a probe (a run's first operations may
        wait once while its threads start); with one thread (which shows no delay however busy the cores
        are) a probe with the full count runs after 4 checks, then 8, 16, ... while the cores stay taken."""
        delay, t = self.read_delay(), self.clock()
        (d0, t0), self._mark = self._mark, (delay, t)
        if not self.active or delay is None or d0 is None or t <= t0:
            return self.now
        if self.now > 1:
            ratio = (delay - d0) / 1e9 / (t - t0)
            if ratio > self.CONTENDED and self._probe_taken():
                self.backoff = 4
                self._one_thread(f"the cores are taken by other processes (run-queue delay {ratio:.2f} s/s)")
        else:
            self.until_probe -= 1
            if self.until_probe <= 0:
                if self._probe_taken():  # still taken: probe less often
                    self.backoff = min(self.backoff * 2, self.MAX_BACKOFF)
                    self.until_probe = self.backoff
                else:
                    self._use(self.full, "the cores are free again")
        return self.now

    def _probe_taken(self) -> bool:
        """Whether a probe on the full count finds the cores taken; measuring goes on from after it (the
        probe's own wait does not count)."""
        taken = self.probe(self.full) > self.CONTENDED
        self._mark = (self.read_delay(), self.clock())
        return taken

    def _one_thread(self, why: str) -> None:
        self._use(1, why)
        self.until_probe = self.backoff

    def _use(self, n: int, why: str) -> None:
        if n != self.now:
            self.set_threads(n)
            self.switches += 1
            if self.switches <= 4:
                self.log(f"[relax] torch threads {self.now} -> {n}: {why}")
            self.now = n
