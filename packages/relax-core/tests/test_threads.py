"""The thread governor: one torch thread while other processes hold the cores, the full count back when a
probe finds them free; driven here by a scripted run-queue delay and probe (no timing)."""

from __future__ import annotations

from relax_core.threads import ThreadGovernor, probe_contention, run_delay_ns


class Machine:
    """A fake clock and run-queue delay: each :meth:`interval` advances 1 s with ``ratio`` s of delay;
    ``busy`` says what a probe finds."""

    def __init__(self) -> None:
        self.t, self.delay, self.busy, self.probes, self.threads = 0.0, 0, False, 0, []

    def interval(self, ratio: float) -> None:
        self.t += 1.0
        self.delay += int(ratio * 1e9)

    def probe(self, n: int) -> float:
        self.probes += 1
        return 1.3 if self.busy else 0.001

    def governor(self, threads: int = 2) -> ThreadGovernor:
        return ThreadGovernor(
            threads, lambda: self.delay, self.threads.append, self.probe, lambda: self.t, lambda _: None
        )


def test_a_quiet_machine_keeps_every_thread_and_one_waiting_interval_is_not_enough():
    m = Machine()
    g = m.governor()
    g.start()
    m.interval(0.73)  # a run's first operations wait once while its threads start: the probe finds no load
    assert g.check() == 2
    for _ in range(20):
        m.interval(0.01)
        assert g.check() == 2
    assert m.threads == [] and m.probes == 2  # (the start and the one waiting interval)


def test_taken_cores_give_one_thread_and_free_ones_give_the_count_back_with_a_growing_backoff():
    m = Machine()
    g = m.governor()
    g.start()
    m.busy = True
    m.interval(1.3)
    assert g.check() == 1 and m.threads == [1]
    probes = []
    for k in range(40):  # still busy: one thread; probes after 4 checks, then 8, 16 ...
        m.interval(0.0)  # (one thread shows no delay however busy the machine is)
        before = m.probes
        assert g.check() == 1
        if m.probes > before:
            probes.append(k)
    assert probes == [3, 11, 27]
    m.busy = False
    for _ in range(32):
        m.interval(0.0)
        if g.check() == 2:
            break
    assert m.threads == [1, 2]


def test_a_probe_before_the_first_step_starts_a_busy_run_on_one_thread():
    m = Machine()
    m.busy = True
    g = m.governor()
    g.start()
    assert g.now == 1 and m.threads == [1]


def test_one_thread_asked_for_or_no_schedstat_changes_nothing():
    m = Machine()
    g = m.governor(threads=1)
    g.start()
    m.interval(2.0)
    assert g.check() == 1 and m.probes == 0
    blind = ThreadGovernor(2, lambda: None, m.threads.append, m.probe, lambda: m.t, lambda _: None)
    blind.start()
    m.interval(2.0)
    assert blind.check() == 2 and m.probes == 0 and m.threads == []


def test_the_real_reading_and_probe_on_this_machine():
    """Linux reports the delay (a number that only grows); the probe returns a ratio and leaves torch's
    thread count as it was."""
    import pytest

    torch = pytest.importorskip("torch")

    d0 = run_delay_ns()
    assert d0 is not None and d0 >= 0
    before = torch.get_num_threads()
    assert probe_contention(2, seconds=0.01) >= 0.0
    assert torch.get_num_threads() == before and run_delay_ns() >= d0
