"""What the ``sglang`` engine, its lifecycle and its weight updates share: one :class:`SGLangServers`.

Why a module of its own: the supervisor (:mod:`~relax_rollout.engines.sglang.lifecycle`) and the weight
updates (:mod:`~relax_rollout.engines.sglang.weights`) act on the same servers as the engine
(:mod:`~relax_rollout.engines.sglang.engine`) — their slots, the pool serving them, whether they are paused
or closed, the lock guarding all that and the way to call them. Holding that here, and handing this object
to each helper, lets them share it without reaching into the engine, and keeps the three modules from
importing each other.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from relax_rollout.engines.pool import EnginePool
from relax_rollout.engines.pool_members import Member, PoolError
from relax_rollout.engines.processes import EngineProcess
from relax_rollout.engines.wire import http_json

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SGLangServers:
    """One ``sglang`` engine's servers and the state its parts share (see the module docstring).

    Every engine request goes through :meth:`call` (one engine) or :meth:`call_all` (every serving one), so
    a test can intercept them by setting ``call`` on this object."""

    slots: list[EngineProcess]
    """Engine ``k``'s process, GPUs, URL and state (``slots[k]``)."""
    pool: EnginePool
    """The pool the serving engines are members of."""
    executor: ThreadPoolExecutor
    """Where requests to several engines run concurrently."""
    weight_update: str
    """How weights reach the engines: ``disk``, ``tensor``, ``distributed`` or ``delta``."""
    tp_size: int
    """GPUs (tensor-parallel ranks) per engine."""
    token: str | None = None
    """The bearer token of every request (None: none sent)."""
    request_timeout_s: float = 600.0
    """The default time-out of one request."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    """Guards ``slots``' states, ``paused`` and ``closed``."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set once the engine closes: the supervisor and pending launches end."""
    paused: str | None = None
    """The mode generation is paused in (``abort``, ``retract``, ``in_place``), None while it runs."""
    closed: bool = False
    """Whether the engine was closed (nothing is started or restarted any more)."""

    @property
    def may_flush(self) -> bool:
        """Whether a weight update may flush SGLang's cache: not while requests are held paused in place
        (they still use it, and SGLang refuses the update's flush: HTTP 400, measured)."""
        return self.paused != "in_place"

    def call(self, url: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        """``path`` on the engine at ``url`` (one retry of a reset connection), its JSON reply."""
        return http_json(url, path, body, self.token, timeout_s or self.request_timeout_s, 1, 0.1)

    def call_all(
        self, path: str, body: Any | Callable[[int, Member], Any] = None, timeout_s: float | None = None
    ) -> list[tuple[Member, Any]]:
        """``path`` on every active engine concurrently (``body(i, member)`` for a per-engine body); raises
        the first error after all answered."""
        members = self.pool.membership.active()
        if not members:
            raise PoolError(f"no active SGLang engine for {path}: {self.describe()}")
        futs = [
            (
                m,
                self.executor.submit(
                    self.call, m.url, path, body(i, m) if callable(body) else body, timeout_s
                ),
            )
            for i, m in enumerate(members)
        ]
        out, error = [], None
        for m, f in futs:
            try:
                out.append((m, f.result()))
            except Exception as e:  # noqa: BLE001 — re-raised after every engine answered
                error = error or e
                logger.warning("engine %s (%s): %s failed: %s", m.id, m.url, path, e)
        if error is not None:
            raise error
        return out

    def describe(self) -> list[dict[str, Any]]:
        """Every engine slot: index, gpus, url, state, pid, restarts, error, member_id, log_path, pids."""
        with self.lock:
            return [s.to_dict() for s in self.slots]
