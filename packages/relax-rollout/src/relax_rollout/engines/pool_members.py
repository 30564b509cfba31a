"""Who is in an :class:`~relax_rollout.engines.pool.EnginePool`: its members, their states, and how one
joins, drains, fails, restarts and leaves.

Why a module of its own: the pool does two jobs on one set of members — keeping that set right while
engines come and go (here) and spreading requests and weights over it (:mod:`relax_rollout.engines.pool`,
which builds the pool and the state both halves work on). The rules a member follows (joins only with the
current weights, drains before it goes, the last active one stays) read here without the routing.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlparse

from relax_rollout.engines.wire import ServerClient, ServerError, http_json, model_info, version_number

logger = logging.getLogger(__name__)

KINDS = ("startup", "ray_native", "external")
STATES = ("joining", "active", "draining", "removed", "failed")


class PoolError(RuntimeError):
    """A pool operation that cannot be done (the last active member, an unknown id, a failed join...)."""


class NoActiveEngine(PoolError):
    """No active member is left to serve a request."""


class DrainTimeout(PoolError):
    """``remove(force=False)``: the member still had requests in flight at the drain time-out."""


class Cancelled(PoolError):
    """A drain was cancelled (the elastic operation that asked for it was cancelled)."""


@dataclass
class Member:
    id: str
    url: str
    kind: str
    changes: list[tuple[float, str]] = field(default_factory=list, repr=False)
    """Every state it entered, with when (``time.time()``): its lane on the run's timeline (``relax ui``).
    Kept by :meth:`__setattr__`, so no assignment of :attr:`state` anywhere can miss it."""
    state: str = "joining"
    protected: bool = False
    inflight: int = 0
    """Prompts sent to this member and not answered yet."""
    created: float = field(default_factory=time.time)
    handle: Any = None
    """What the launcher returned for it (a Ray actor): ``kill(handle)`` ends it."""
    weight_version: int | None = None
    served: int = 0
    """Prompts this member answered."""
    error: str | None = None
    """Why it failed (or why it was removed)."""
    replaced_by: str | None = None
    node: str | None = None
    """The node address it was launched on when a scale-out named one (a restart asks for it again); None:
    where the launcher puts engines by default, or an external engine."""
    incremental_stream: bool | None = None
    """Whether it streams the new tokens only (SGLang's ``--incremental-streaming-output``); None: not
    asked yet (its ``/server_info`` says, at its first stream)."""

    API_FIELDS: ClassVar[tuple[str, ...]] = tuple(
        "id url kind state protected inflight weight_version created served error replaced_by node".split()
    )
    """The member as the API shows it (each a field of this class)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: copy.copy(getattr(self, k)) for k in self.API_FIELDS}

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and self.__dict__.get("state") != value:  # (the first: set by __init__)
            self.changes.append((time.time(), value))
        super().__setattr__(name, value)


def check_url(url: str) -> str:
    """``http(s)://host[:port]`` without a trailing slash, or ValueError."""
    if not isinstance(url, str):
        raise ValueError(f"must be a string URL (got {url!r})")
    u = urlparse(url.strip())
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host (got {url!r})")
    try:
        u.port  # noqa: B018 — raises on a bad port
    except ValueError:
        raise ValueError(f"has an invalid port (got {url!r})") from None
    return url.strip().rstrip("/")


def member_spans(members: list[Member], now: float | None = None) -> list[dict[str, Any]]:
    """Each engine's life as spans in :class:`relax_core.trace.Tracer`'s format, a row per engine
    (``engine <id>``): one span per state it was in (joining, active, draining) until it was removed or
    failed, or until ``now`` — so the run's timeline shows elastic engines join and leave."""
    now = time.time() if now is None else now
    out = []
    for m in members:
        changes = list(m.changes)
        for (t, state), (end, _) in zip(changes, [*changes[1:], (now, "")]):
            if state in ("removed", "failed"):
                continue
            args = {"kind": m.kind, "url": m.url, "node": m.node, "error": m.error}
            out.append(
                {
                    "name": f"engine {state}",
                    "role": f"engine {m.id}",
                    "thread": "engine",
                    "start_ns": int(t * 1e9),
                    "dur_ns": max(0, int((end - t) * 1e9)),
                    "args": {k: v for k, v in args.items() if v is not None},
                }
            )
    return out


STATS = ("requests", "prompts", "reissued_prompts", "failures", "aborts_reissued", "busy_retries")
"""The pool's counters (:meth:`~relax_rollout.engines.pool.EnginePool.stats`)."""


@dataclass
class PoolState:
    """What the pool's two parts share — its members and the weights a newcomer joins with — under one
    condition: :class:`PoolMembership` changes who is in, :class:`~relax_rollout.engines.pool.EnginePool`
    sends requests and weights to them."""

    cond: threading.Condition = field(default_factory=lambda: threading.Condition(threading.RLock()))
    members: dict[str, Member] = field(default_factory=dict)
    next_id: int = 0
    weights_lock: Any = field(default_factory=threading.RLock)
    """Weight updates and joins are serialised (a newcomer never misses an update)."""
    version: int | None = None
    """The version every active member holds (None before the first member or update)."""
    weights_path: str | None = None
    """The directory holding the current weights, for newcomers (None: none to give them)."""
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATS, 0))


class PoolMembership:
    """Who is in an engine pool and how they join, drain, fail, restart and leave: a part of
    :class:`~relax_rollout.engines.pool.EnginePool`, given the pool's shared ``state``, its HTTP ``client``
    and ``executor``; the launcher and callbacks as the pool's docstring says."""

    def __init__(
        self,
        state: PoolState,
        client: ServerClient,
        executor: ThreadPoolExecutor,
        join_timeout_s: float,
        launch: Callable[..., tuple[str, Any]] | None = None,
        kill: Callable[[Any], None] | None = None,
        on_failure: Callable[[Member], None] | None = None,
        on_removed: Callable[[Member], None] | None = None,
    ) -> None:
        self.state, self.client, self.executor = state, client, executor
        self.join_timeout_s = join_timeout_s
        self.launch = launch
        """``launch()`` or ``launch(node)`` → (url, handle): see :class:`~relax_rollout.engines.pool.EnginePool`."""
        self.kill = kill
        self.on_failure, self.on_removed = on_failure, on_removed

    def get(self, member_id: str) -> Member:
        with self.state.cond:
            if member_id not in self.state.members:
                raise PoolError(f"unknown engine {member_id!r}; known: {sorted(self.state.members)}")
            return self.state.members[member_id]

    def members(self, include_removed: bool = False) -> list[dict[str, Any]]:
        """Every member as a dict (id, url, kind, state, protected, inflight, weight_version, created,
        served, error, replaced_by), oldest first; removed ones only with ``include_removed``."""
        with self.state.cond:
            return [
                m.to_dict() for m in self.state.members.values() if include_removed or m.state != "removed"
            ]

    def spans(self) -> list[dict[str, Any]]:
        """Every member's life on the run's timeline (:func:`member_spans`), removed ones included."""
        with self.state.cond:
            return member_spans(list(self.state.members.values()))

    def active(self) -> list[Member]:
        with self.state.cond:
            return [m for m in self.state.members.values() if m.state == "active"]

    def find(self, url: str) -> Member | None:
        """The member (not removed) serving ``url``."""
        url = url.rstrip("/")
        with self.state.cond:
            for m in self.state.members.values():
                if m.url == url and m.state != "removed":
                    return m
        return None

    def add(
        self,
        url: str,
        kind: str = "external",
        handle: Any = None,
        protected: bool = False,
        node: str | None = None,
    ) -> Member:
        """Join the engine serving ``url``: it must answer ``/health``; it gets the current weights (when an
        update happened) and must then report the pool's weight version in ``/model_info``; only then
        does it become active. On failure it is left ``removed`` (with the reason) and PoolError raised. A
        failed member at the same URL is replaced (marked removed)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS} (got {kind!r})")
        try:
            url = check_url(url)
        except ValueError as e:
            raise PoolError(f"engine url {e}") from None
        with self.state.cond:
            other = self.find(url)
            if other is not None and other.state != "failed":
                raise PoolError(f"{url} is already in the pool as {other.id} ({other.state})")
            m = Member(
                id=f"e{self.state.next_id}", url=url, kind=kind, protected=protected, handle=handle, node=node
            )
            self.state.next_id += 1
            self.state.members[m.id] = m
            if other is not None:  # a failed engine at this URL came back: the new member replaces it
                other.state, other.replaced_by = "removed", m.id
        try:
            self._wait_healthy(m)
            with self.state.weights_lock:  # no update may slip in between the sync and the activation
                if self.state.weights_path is not None:
                    self.client.request(
                        m.url,
                        "/update_weights_from_disk",
                        {"model_path": self.state.weights_path, "weight_version": str(self.state.version)},
                    )
                info = model_info(m.url, self.client.token, self.join_timeout_s)
                got = version_number(info.get("weight_version"))
                with self.state.cond:
                    if self.state.version is None:  # the first member sets the pool's version
                        self.state.version = got
                    if got != self.state.version:
                        raise PoolError(
                            f"{url} holds weight version {got} after the sync, the pool serves "
                            f"{self.state.version}"
                        )
                    m.weight_version, m.state = got, "active"
                    self.state.cond.notify_all()
        except Exception as e:
            with self.state.cond:
                m.state, m.error = "removed", f"join failed: {describe(e)}"
            if isinstance(e, PoolError):
                raise
            raise PoolError(f"engine {url} could not join the pool: {describe(e)}") from e
        logger.info("engine %s (%s, %s) joined at weight version %s", m.id, kind, url, m.weight_version)
        return m

    def _wait_healthy(self, m: Member) -> None:
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            try:
                http_json(m.url, "/health", None, self.client.token, min(10.0, self.join_timeout_s))
                return
            except (ConnectionError, ServerError) as e:  # not listening yet, or 503 while warming up
                if isinstance(e, ServerError) and e.status < 500 or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def spawn(self, kind: str = "ray_native", protected: bool = False, node: str | None = None) -> Member:
        """Launch one engine with ``launch`` (on the node at address ``node`` when given: ``launch(node)``)
        and :meth:`add` it (killed again when it cannot join)."""
        if self.launch is None:
            raise PoolError("this pool has no engine launcher (engines are not launched on Ray)")
        url, handle = self.launch() if node is None else self.launch(node)
        try:
            return self.add(url, kind=kind, handle=handle, protected=protected, node=node)
        except Exception:
            self.kill_engine(handle)
            raise

    def start(self, n: int) -> list[Member]:
        """Launch ``n`` protected start-up engines concurrently."""
        futs = [self.executor.submit(self.spawn, "startup", True) for _ in range(n)]
        return [f.result() for f in futs]

    def remove(
        self,
        member_id: str,
        drain_timeout_s: float = 30.0,
        force: bool = True,
        cancel: threading.Event | None = None,
    ) -> Member:
        """Drain then remove a member: no new requests; its in-flight ones may finish for
        ``drain_timeout_s``, then (``force``) are aborted and come back to be re-issued elsewhere (without
        ``force``: :class:`DrainTimeout`, and it is active again). Setting ``cancel`` during the drain
        makes it active again and raises :class:`Cancelled`. The last active member is never removed."""
        with self.state.cond:
            m = self.get(member_id)
            if m.state == "removed":
                raise PoolError(f"engine {member_id} is already removed")
            if m.state == "joining":
                raise PoolError(f"engine {member_id} is still joining; remove it once it is active")
            if m.state == "active" and not any(
                o.state == "active" for o in self.state.members.values() if o is not m
            ):
                raise PoolError(f"engine {member_id} is the last active engine; the pool never removes it")
            was_active = m.state in ("active", "draining")
            if was_active:
                m.state = "draining"
            deadline = time.monotonic() + drain_timeout_s
            while m.inflight and was_active:
                left = deadline - time.monotonic()
                if cancel is not None and cancel.is_set():
                    m.state = "active"
                    self.state.cond.notify_all()
                    raise Cancelled(f"the drain of engine {member_id} was cancelled; it is active again")
                if left <= 0:
                    break
                self.state.cond.wait(min(left, 0.05))
            pending = m.inflight if was_active else 0
        if pending:
            if not force:
                with self.state.cond:
                    m.state = "active"
                    self.state.cond.notify_all()
                raise DrainTimeout(
                    f"engine {member_id} still had {pending} request(s) in flight after {drain_timeout_s}s; "
                    "it is active again (use force to abort them and re-issue them elsewhere)"
                )
            logger.info("engine %s: aborting %d in-flight request(s) after the drain time-out", m.id, pending)
            try:
                self.client.request(m.url, "/abort_request", {"abort_all": True}, timeout_s=10.0)
            except (OSError, ServerError) as e:
                logger.warning("engine %s: abort_request failed (%s)", m.id, describe(e))
            with self.state.cond:  # the aborted requests come back (and are re-issued) before it goes away
                self.state.cond.wait_for(lambda: m.inflight == 0, timeout=max(10.0, drain_timeout_s))
        with self.state.cond:
            m.state = "removed"
            self.state.cond.notify_all()
        self.kill_engine(m.handle)
        self._notify(self.on_removed, m)
        logger.info("engine %s (%s) removed", m.id, m.url)
        return m

    def reactivate(self, member_id: str) -> Member:
        """Put a draining member back to active (a cancelled scale-in)."""
        with self.state.cond:
            m = self.get(member_id)
            if m.state != "draining":
                raise PoolError(f"engine {member_id} is {m.state}, not draining")
            m.state = "active"
            self.state.cond.notify_all()
            return m

    def restart(self, member_id: str) -> Member:
        """Replace a (failed) launched member in place: kill its process, launch a new one with the current
        weights and the same ``protected`` flag (a new id). The old member ends ``removed``."""
        with self.state.cond:
            old = self.get(member_id)
            if old.kind == "external":
                raise PoolError(
                    f"engine {member_id} is external: it was not launched here, so it cannot be restarted"
                )
            if old.state == "removed":
                raise PoolError(f"engine {member_id} is removed; nothing to restart")
            if self.launch is None:
                raise PoolError("this pool has no engine launcher: cannot restart engines")
            if old.state in ("active", "draining") and not any(
                o.state == "active" for o in self.state.members.values() if o is not old
            ):
                logger.warning("restarting %s, the last active engine: requests wait for the new one", old.id)
            old.state, old.error = "failed", old.error or "restarted"
            self.state.cond.notify_all()
        self.kill_engine(old.handle)
        new = self.spawn(kind=old.kind, protected=old.protected, node=old.node)
        with self.state.cond:
            old.state, old.replaced_by = "removed", new.id
        logger.info("engine %s restarted as %s (%s)", old.id, new.id, new.url)
        return new

    def mark_failed(self, member_id: str, reason: str) -> Member:
        """Mark a member failed from outside (its process was seen to exit): it gets no more requests, and
        ``on_failure`` is called as for a failure the pool saw itself. A no-op for a failed or removed one."""
        m = self.get(member_id)
        self.fail(m, RuntimeError(reason))
        return m

    def retire(self, member_id: str, replaced_by: str | None = None) -> Member:
        """Mark a failed member removed (replaced by ``replaced_by``, e.g. a restarted process)."""
        with self.state.cond:
            m = self.get(member_id)
            if m.state not in ("failed", "removed"):
                raise PoolError(f"engine {member_id} is {m.state}: only a failed engine is retired")
            m.state = "removed"
            m.replaced_by = replaced_by or m.replaced_by
            self.state.cond.notify_all()
            return m

    def kill_engine(self, handle: Any) -> None:
        """End a launched engine (``kill(handle)``); a failure is logged, not raised: it may be dead already."""
        if handle is not None and self.kill is not None:
            try:
                self.kill(handle)
            except Exception as e:  # noqa: BLE001 — it may be dead already
                logger.warning("killing an engine failed: %s", describe(e))

    def _notify(self, cb: Callable[[Member], None] | None, m: Member) -> None:
        if cb is not None:
            try:
                cb(m)
            except Exception:  # noqa: BLE001 — a callback must not break the pool
                logger.exception("pool callback %s failed for %s", cb, m.id)

    def fail(self, m: Member, err: BaseException) -> None:
        """Mark ``m`` failed for ``err`` (no more requests), once, and call ``on_failure``."""
        with self.state.cond:
            if m.state in ("failed", "removed"):
                return
            if m.state == "draining":  # it was going away anyway: no failure to report
                return
            m.state, m.error = "failed", describe(err)
            self.state.stats["failures"] += 1
            self.state.cond.notify_all()
        logger.warning("engine %s (%s) failed: %s", m.id, m.url, m.error)
        self._notify(self.on_failure, m)

    def health(self) -> dict[str, bool]:
        """Probe every active or draining member's ``/health`` (a failing one is marked failed)."""
        ok: dict[str, bool] = {}
        with self.state.cond:
            targets = [m for m in self.state.members.values() if m.state in ("active", "draining")]
        for m in targets:
            try:
                http_json(m.url, "/health", None, self.client.token, 10.0)
                ok[m.id] = True
            except (OSError, ServerError) as e:
                self.fail(m, e)
                ok[m.id] = False
        return ok

    def summary(self) -> str:
        """Every member's id and state (and why it failed), for an error message."""
        parts = []
        for m in self.state.members.values():
            why = f" ({m.error})" if m.error and m.state in ("failed", "removed") else ""
            parts.append(f"{m.id} {m.state}{why}")
        return "; ".join(parts) or "the pool has no engines"


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
