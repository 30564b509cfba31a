"""Run reward calls in worker processes that can be killed.

Why processes: a thread cannot be stopped. A reward stuck in a C loop (sympy on a pathological
expression, a regex blow-up) keeps burning a core after the scorer gave up on it, and a reward that
segfaults or calls ``os._exit`` takes the whole rollout worker down with it. With
``Scorer(..., isolation="process")`` every call runs in a pooled child process instead:

- a call that overruns its time-out gets its worker killed (``SIGKILL``) the moment the deadline
  passes, so the time-out is exact to within the scheduler's latency, and a fresh worker replaces it;
- a worker that dies mid-call (``os._exit``, ``SIGKILL``, segfault, out of memory) turns into
  :class:`RewardProcessDied`, which the scorer records as a ``crashed`` failure with the exit code;
- ``memory_limit_mb`` caps each worker's address space (``RLIMIT_AS``).

Workers are forked (cheap: no re-import of sympy) and reused across calls, so the cost per call is
one pickle round trip over a pipe (~0.1 ms) instead of a process start. A worker ends when its parent
does, however the parent ends (``kill -9`` included): it holds only its own end of its pipe, so the
parent's end closing is an end of file; and it holds none of the parent's run locks
(``relax_core.ownership`` closes them in forked children). The reward function and its
arguments must be picklable; module-level functions and registered names always are.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax_rewards.types import RewardResult

__all__ = ["ProcessPool", "RewardProcessDied", "RewardRaised"]


class RewardProcessDied(RuntimeError):
    """The worker process running a reward exited before answering (crash, ``os._exit``, kill)."""


class RewardRaised(Exception):
    """A reward raised inside a worker process; ``type_name`` is the original exception's class."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


def _worker_main(conn, parent_end, memory_limit_mb: int | None) -> None:  # runs in the child
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    if parent_end is not None:  # (forked: our copy of the parent's end; held, no EOF ever came when the
        parent_end.close()  # parent died, and the worker waited for ever)
    if memory_limit_mb:
        import resource

        limit = int(memory_limit_mb) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from relax_rewards.registry import call_reward
    from relax_rewards.types import as_result

    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        fn, response, label, metadata = task
        try:
            value = as_result(call_reward(fn, response, label, metadata))  # (a hostile value dies here)
            reply: tuple[str, RewardResult] | tuple[str, str, str] = ("ok", value)
        except BaseException as exc:  # noqa: BLE001 - sent back to the parent
            reply = ("raised", type(exc).__name__, str(exc)[:500])
        try:
            conn.send(reply)
        except Exception as exc:  # unpicklable return value
            conn.send(("raised", "PicklingError", f"reward returned an unpicklable value: {exc}"))


class _Worker:
    def __init__(self, ctx, memory_limit_mb: int | None):
        self.conn, child = ctx.Pipe()
        forked = ctx.get_start_method() == "fork"  # (spawned children get only what they are sent)
        args = (child, self.conn if forked else None, memory_limit_mb)
        self.process = ctx.Process(target=_worker_main, args=args, daemon=True)
        self.process.start()
        child.close()

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=5)
        self.conn.close()


class ProcessPool:
    """Pooled, killable worker processes; :meth:`submit` returns a ``concurrent.futures.Future``.

    A worker serves one call at a time. :meth:`abandon` kills the worker of a timed-out call.
    """

    def __init__(self, memory_limit_mb: int | None = None, start_method: str | None = None):
        method = start_method or ("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        self._ctx = multiprocessing.get_context(method)
        self._memory_limit_mb = memory_limit_mb
        self._idle: list[_Worker] = []
        self._busy: dict[Future, _Worker] = {}
        self._lock = threading.Lock()

    def prestart(self, n: int) -> None:
        """Start ``n`` idle workers now (before the parent starts threads, for a clean fork)."""
        with self._lock:
            while len(self._idle) < n:
                self._idle.append(_Worker(self._ctx, self._memory_limit_mb))

    def submit(self, fn: Callable | str, response: str, label: Any, metadata: dict | None) -> Future:
        """Run one call on an idle worker; ``fn`` is a reward or a registered reward's name."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is not None and not worker.process.is_alive():
            worker.kill()  # died while idle: reap it
            worker = None
        if worker is None:
            worker = _Worker(self._ctx, self._memory_limit_mb)
        try:
            worker.conn.send((fn, response, label, metadata))
        except Exception as exc:  # unpicklable reward or arguments: fail this call, keep the worker
            with self._lock:
                self._idle.append(worker)
            future.set_exception(RewardRaised("PicklingError", f"cannot send the call to a worker: {exc}"))
            return future
        with self._lock:
            self._busy[future] = worker
        threading.Thread(target=self._wait, args=(future, worker), daemon=True).start()
        return future

    def abandon(self, future: Future) -> None:
        """Kill the worker running ``future`` (a timed-out call); a new worker replaces it later."""
        with self._lock:
            worker = self._busy.pop(future, None)
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        with self._lock:
            workers = self._idle + list(self._busy.values())
            self._idle, self._busy = [], {}
        for worker in workers:
            worker.kill()

    def _wait(self, future: Future, worker: _Worker) -> None:
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=5)
            code = worker.process.exitcode
            with self._lock:
                killed_by_us = self._busy.pop(future, None) is None
            if not killed_by_us:
                worker.kill()
            if not future.done():
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                future.set_exception(RewardProcessDied(f"reward process died ({how})"))
            return
        with self._lock:
            self._busy.pop(future, None)
            self._idle.append(worker)
        if reply[0] == "ok":
            future.set_result(reply[1])
        else:
            future.set_exception(RewardRaised(reply[1], reply[2]))
