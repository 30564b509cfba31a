"""The elastic rollout's scaling operations: :class:`ElasticService` validates a scale-out or scale-in,
runs it as an asynchronous :class:`Operation` on the :class:`~relax_rollout.engines.pool.EnginePool` and
rolls it back when it is cancelled or fails half-way.

Why a module of its own: what an operation does — which engines a scale-in picks, how one is undone, one at
a time and idempotent by ``request_id`` — is the service's, whatever calls it; :mod:`relax_rollout.elastic`
is only its REST API (routes, Prometheus metrics, the server), and a caller in the same process (a test,
an autoscaler) can drive the service without HTTP.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from relax_rollout.elastic_api import SCALE_IN_FIELDS, SCALE_OUT_FIELDS
from relax_rollout.engines.pool import EnginePool
from relax_rollout.engines.pool_members import Cancelled, Member, PoolError, check_url
from relax_rollout.server.protocol import BadRequest, NotFound, error_dict

logger = logging.getLogger(__name__)

TERMINAL = ("succeeded", "failed", "cancelled")


class Conflict(RuntimeError):
    """Another operation is in progress, the operation is finished, or a request_id was reused."""

    def __init__(self, message: str, operation: str | None = None):
        super().__init__(message)
        self.operation = operation

    def body(self) -> dict:
        return error_dict(str(self), "Conflict", code=409, operation=self.operation)


@dataclass
class Operation:
    id: str
    kind: str
    """"scale_out" or "scale_in"."""
    request: dict
    request_id: str | None = None
    state: str = "pending"
    engines_added: list[str] = field(default_factory=list)
    engines_removed: list[str] = field(default_factory=list)
    rollback: list[str] = field(default_factory=list)
    """What a cancel (or a failed scale-out) undid, one line per engine."""
    error: str | None = None
    cancel_requested: bool = False
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    targets: list[str] = field(default_factory=list)
    """Scale-in: the engines chosen when the request was accepted."""
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    API_FIELDS: ClassVar[tuple[str, ...]] = tuple(
        "id kind request request_id state engines_added engines_removed targets rollback error cancel_requested created started finished".split()
    )
    """The operation as the API shows it (each a field of this class, lists copied)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: copy.copy(getattr(self, k)) for k in self.API_FIELDS}

    # -- its two signals: a cancel asked for, and the end ----------------------------------------------
    def request_cancel(self) -> None:
        """Ask the operation to stop; its runner sees :attr:`cancelling` and rolls back what it did."""
        self.cancel_requested = True
        self._cancel.set()

    @property
    def cancelling(self) -> bool:
        """A cancel was asked for (the runner stops at its next check, and rolls back)."""
        return self._cancel.is_set()

    @property
    def cancel_signal(self) -> threading.Event:
        """Set once a cancel is asked for: for a wait that must end at once then (a drain in the pool)."""
        return self._cancel

    def finish(self, state: str) -> None:
        """Record the operation's end (one of :data:`TERMINAL`) and wake its waiters."""
        self.state, self.finished = state, time.time()
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the operation is finished (or ``timeout_s``); True when it is."""
        return self._done.wait(timeout_s)


# -- validation ---------------------------------------------------------------------------------------
def _int(body: dict, key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(key, f"must be an integer (got {v!r})")
    if v < lo:
        raise BadRequest(key, f"must be ≥ {lo} (got {v})")
    return v


def _str_list(body: dict, key: str) -> list[str] | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise BadRequest(key, f"must be a non-empty list of strings (got {v!r})")
    for i, x in enumerate(v):
        if not isinstance(x, str) or not x:
            raise BadRequest(f"{key}[{i}]", f"must be a non-empty string (got {x!r})")
    if len(set(v)) != len(v):
        raise BadRequest(key, f"lists an entry twice: {v}")
    return v


def _urls(body: dict, key: str = "engine_urls") -> list[str] | None:
    v = _str_list(body, key)
    if v is None:
        return None
    out = []
    for i, u in enumerate(v):
        try:
            out.append(check_url(u))
        except ValueError as e:
            raise BadRequest(f"{key}[{i}]", str(e)) from None
    if len(set(out)) != len(out):
        raise BadRequest(key, f"lists an engine twice: {v}")
    return out


def _check_fields(body: Any, allowed: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("body", f"must be a JSON object (got {type(body).__name__})")
    for key in body:
        if key not in allowed:
            raise BadRequest(key, f"is not a field of this request; allowed: {', '.join(allowed)}")
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 200):
        raise BadRequest("request_id", f"must be a non-empty string of at most 200 characters (got {rid!r})")
    return body


def _exactly_one(body: dict, keys: tuple[str, ...]) -> str:
    given = [k for k in keys if body.get(k) is not None]
    if len(given) != 1:
        what = "both " + " and ".join(given) if given else "none"
        raise BadRequest(
            given[-1] if given else keys[0], f"give exactly one of {', '.join(keys)} (got {what})"
        )
    return given[0]


class ElasticService:
    """Scaling operations on ``pool``, one at a time, each in its own thread. ``drain_timeout_s`` and
    ``force`` are the scale-in defaults when a request does not give them; ``cancel_wait_s`` is how long a
    cancel waits for the rollback before answering (202 instead of 200 when it is still running).
    ``nodes``: the cluster's alive node addresses, when launched engines bind their node's address and a
    scale-out may name the node to launch on (None: engines are loopback-bound, on the rollout's node)."""

    def __init__(
        self,
        pool: EnginePool,
        drain_timeout_s: float = 30.0,
        force: bool = True,
        cancel_wait_s: float = 10.0,
        max_operations: int = 1000,
        max_engines: int | None = None,
        nodes: Callable[[], list[str]] | None = None,
    ) -> None:
        self.pool = pool
        self.nodes = nodes
        self.max_engines = max_engines
        """The most engines a scale-out may ask for (the cluster's room; None: no limit)."""
        self.drain_timeout_s, self.force, self.cancel_wait_s = drain_timeout_s, force, cancel_wait_s
        self.max_operations = max_operations
        self._lock = threading.RLock()
        self._ops: dict[str, Operation] = {}
        self._by_request: dict[str, str] = {}
        self._current: Operation | None = None
        self._ids = itertools.count(1)

    # -- queries ---------------------------------------------------------------------------------
    def operation(self, op_id: str) -> Operation:
        with self._lock:
            if op_id not in self._ops:
                raise NotFound(f"no operation {op_id!r}; GET /elastic/operations lists them")
            return self._ops[op_id]

    def operations(self) -> list[dict[str, Any]]:
        with self._lock:
            return [op.to_dict() for op in self._ops.values()]

    def engines(self, include_removed: bool = False) -> list[dict[str, Any]]:
        return self.pool.membership.members(include_removed)

    def wait(self, op_id: str, timeout_s: float | None = None) -> Operation:
        """Block until the operation is finished (or ``timeout_s``); returns it."""
        op = self.operation(op_id)
        op.wait(timeout_s)
        return op

    # -- requests --------------------------------------------------------------------------------
    def scale_out(self, body: Any) -> tuple[Operation, bool]:
        """Validate and start a scale-out; ``(operation, created)`` — created False for a known request_id."""
        body = _check_fields(body, SCALE_OUT_FIELDS)
        with self._lock:
            if (known := self._known(body, "scale_out")) is not None:
                return known, False
            n, urls = _int(body, "num_replicas", 1), _urls(body)
            _exactly_one(body, ("num_replicas", "engine_urls"))
            self._check_free()
            active = len(self.pool.membership.active())
            if n is not None:
                if self.pool.membership.launch is None:
                    raise BadRequest(
                        "num_replicas",
                        "this run has no engine launcher (no --rollout-engines on Ray); add running servers "
                        "with engine_urls instead",
                    )
                if n < active:
                    raise BadRequest(
                        "num_replicas", f"{n} is below the {active} active engines; use /elastic/scale_in"
                    )
                if self.max_engines is not None and n > self.max_engines:
                    raise BadRequest(
                        "num_replicas",
                        f"{n} is above the {self.max_engines} engines this cluster has room for "
                        "(--elastic-max-engines); add nodes or ask for fewer",
                    )
            for i, u in enumerate(urls or []):
                if (m := self.pool.membership.find(u)) is not None and m.state != "failed":
                    raise BadRequest(f"engine_urls[{i}]", f"{u} is already in the pool as {m.id} ({m.state})")
            self._check_node(body.get("node"), n)
            return self._start("scale_out", body, self._run_scale_out), True

    def _check_node(self, node: Any, n: int | None) -> None:
        """A scale-out's ``node``: a string, with num_replicas, on a run whose engines bind their node's
        address, naming an alive node of the cluster."""
        if node is None:
            return
        if not isinstance(node, str) or not node:
            raise BadRequest("node", f"must be a node's address, e.g. 10.0.0.3 (got {node!r})")
        if n is None:
            raise BadRequest("node", "only with num_replicas: engine_urls are already running somewhere")
        if self.nodes is None:
            raise BadRequest(
                "node",
                "this run's engines bind loopback and run on the rollout's node; start it with "
                "--elastic-host node (and --elastic-token) to launch engines on other nodes",
            )
        alive = self.nodes()
        if node not in alive:
            raise BadRequest("node", f"no alive node at {node}; the cluster's nodes: {', '.join(alive)}")

    def scale_in(self, body: Any) -> tuple[Operation, bool]:
        """Validate and start a scale-in; ``(operation, created)``."""
        body = _check_fields(body, SCALE_IN_FIELDS)
        with self._lock:
            if (known := self._known(body, "scale_in")) is not None:
                return known, False
            n, ids, urls = _int(body, "num_replicas", 1), _str_list(body, "engine_ids"), _urls(body)
            if body.get("drain_timeout_s") is not None:
                d = body["drain_timeout_s"]
                if isinstance(d, bool) or not isinstance(d, (int, float)) or d < 0:
                    raise BadRequest("drain_timeout_s", f"must be a number of seconds ≥ 0 (got {d!r})")
            if body.get("force") is not None and not isinstance(body["force"], bool):
                raise BadRequest("force", f"must be true or false (got {body['force']!r})")
            key = _exactly_one(body, ("num_replicas", "engine_ids", "engine_urls"))
            self._check_free()
            victims = self._victims(key, n, ids, urls)
            op = self._start("scale_in", body, self._run_scale_in, start=False)
            op.targets = [m.id for m in victims]
            self._launch(op, self._run_scale_in)
            return op, True

    def _victims(
        self, key: str, n: int | None, ids: list[str] | None, urls: list[str] | None
    ) -> list[Member]:
        active = self.pool.membership.active()
        if key == "num_replicas":
            assert n is not None
            if n > len(active):
                raise BadRequest(
                    "num_replicas", f"{n} is above the {len(active)} active engines; use /elastic/scale_out"
                )
            removable = sorted(
                (m for m in active if not m.protected), key=lambda m: (m.created, int(m.id[1:]))
            )
            need = len(active) - n
            if need > len(removable):
                protected = [m.id for m in active if m.protected]
                raise BadRequest(
                    "num_replicas",
                    f"{n} would remove protected start-up engines ({', '.join(protected)}); the lowest reachable "
                    f"target is {len(active) - len(removable)}",
                )
            return removable[::-1][:need]  # newest first
        victims: list[Member] = []
        for i, x in enumerate((ids if key == "engine_ids" else urls) or []):
            where = f"{key}[{i}]"
            if key == "engine_ids":
                try:
                    m = self.pool.membership.get(x)
                except PoolError:
                    raise BadRequest(
                        where, f"unknown engine {x!r}; GET /elastic/engines lists them"
                    ) from None
            else:
                found = self.pool.membership.find(x)
                if found is None:
                    raise BadRequest(where, f"no engine serves {x}; GET /elastic/engines lists them")
                m = found
            if m.state == "removed":
                raise BadRequest(where, f"engine {m.id} is already removed")
            if m.protected:
                raise BadRequest(
                    where, f"engine {m.id} is a protected start-up engine; scale-in never removes it"
                )
            victims.append(m)
        if sum(m.state == "active" for m in victims) >= len(active):
            raise BadRequest(
                key, f"would leave no active engine ({len(active)} active); at least 1 must remain"
            )
        return victims

    def _known(self, body: dict, kind: str) -> Operation | None:
        rid = body.get("request_id")
        if rid is None or rid not in self._by_request:
            return None
        op = self._ops[self._by_request[rid]]
        if op.kind != kind or op.request != body:
            raise Conflict(
                f"request_id {rid!r} was already used by operation {op.id} ({op.kind} {op.request}); "
                "use a new request_id for a different request",
                op.id,
            )
        return op

    def _check_free(self) -> None:
        cur = self._current
        if cur is not None and cur.state not in TERMINAL:
            raise Conflict(
                f"operation {cur.id} ({cur.kind}) is {cur.state}; wait for it to finish or cancel it "
                f"(POST /elastic/operations/{cur.id}/cancel)",
                cur.id,
            )

    def _start(
        self, kind: str, body: dict, run: Callable[[Operation], None], start: bool = True
    ) -> Operation:
        op = Operation(
            id=f"op-{next(self._ids)}", kind=kind, request=dict(body), request_id=body.get("request_id")
        )
        self._ops[op.id] = op
        if op.request_id is not None:
            self._by_request[op.request_id] = op.id
        self._current = op
        self._evict()
        if start:
            self._launch(op, run)
        return op

    def _launch(self, op: Operation, run: Callable[[Operation], None]) -> None:
        threading.Thread(
            target=self._body, args=(op, run), daemon=True, name=f"relax-elastic-{op.id}"
        ).start()

    def _evict(self) -> None:
        done = [k for k, op in self._ops.items() if op.state in TERMINAL]
        for k in done[: max(0, len(self._ops) - self.max_operations)]:
            op = self._ops.pop(k)
            if op.request_id is not None:
                self._by_request.pop(op.request_id, None)

    def cancel(self, op_id: str, wait_s: float | None = None) -> Operation:
        """Stop the operation and roll it back; waits up to ``wait_s`` (default ``cancel_wait_s``) for the
        rollback. 409 when it is already finished."""
        with self._lock:
            op = self.operation(op_id)
            if op.state in TERMINAL:
                raise Conflict(f"operation {op_id} is already {op.state}; there is nothing to cancel", op_id)
            op.request_cancel()
        op.wait(self.cancel_wait_s if wait_s is None else wait_s)
        return op

    # -- running ---------------------------------------------------------------------------------
    def _body(self, op: Operation, run: Callable[[Operation], None]) -> None:
        with self._lock:
            op.state, op.started = "running", time.time()
        error: str | None = None
        if not op.cancelling:
            try:
                run(op)
            except Exception as e:  # noqa: BLE001 — recorded on the operation
                logger.warning("elastic %s %s failed: %s", op.kind, op.id, e)
                error = f"{type(e).__name__}: {e}" if not isinstance(e, PoolError) else str(e)
        with self._lock:
            if error is None and not op.cancelling:
                self._finish(op, "succeeded")
                return
        try:  # cancelled (or a scale-out that failed half-way): undo what it did
            self._rollback(op)
        except Exception as e:  # noqa: BLE001
            logger.exception("elastic %s %s: rollback failed", op.kind, op.id)
            error = (error + "; " if error else "") + f"rollback failed: {e}"
        with self._lock:
            op.error = error
            self._finish(op, "cancelled" if op.cancelling else "failed")

    def _finish(self, op: Operation, state: str) -> None:
        op.finish(state)
        logger.info(
            "elastic %s %s %s (added %s, removed %s)",
            op.kind,
            op.id,
            state,
            op.engines_added,
            op.engines_removed,
        )

    def _run_scale_out(self, op: Operation) -> None:
        urls = op.request.get("engine_urls")
        if urls is not None:
            for u in urls:
                if op.cancelling:
                    return
                m = self.pool.membership.add(u, kind="external")
                with self._lock:
                    op.engines_added.append(m.id)
            return
        need = op.request["num_replicas"] - len(self.pool.membership.active())
        errors: list[str] = []

        def one() -> None:
            if op.cancelling:
                return
            try:
                m = self.pool.membership.spawn("ray_native", node=op.request.get("node"))
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
                return
            with self._lock:
                op.engines_added.append(m.id)

        if need > 0:
            with ThreadPoolExecutor(
                max_workers=min(need, 8), thread_name_prefix="relax-elastic-launch"
            ) as ex:
                for f in [ex.submit(one) for _ in range(need)]:
                    f.result()
        if errors:
            raise PoolError(f"{len(errors)} of {need} engine launch(es) failed: {errors[0]}")

    def _run_scale_in(self, op: Operation) -> None:
        drain = float(op.request.get("drain_timeout_s", self.drain_timeout_s))
        force = op.request.get("force", self.force)
        errors: list[str] = []

        def one(member_id: str) -> None:
            try:
                self.pool.membership.remove(member_id, drain, force, cancel=op.cancel_signal)
            except Cancelled:  # the pool made it active again
                with self._lock:
                    op.rollback.append(f"{member_id} active again")
                return
            except Exception as e:  # noqa: BLE001
                errors.append(f"{member_id}: {e}")
                return
            with self._lock:
                op.engines_removed.append(member_id)

        with ThreadPoolExecutor(
            max_workers=max(1, min(len(op.targets), 8)), thread_name_prefix="relax-elastic-drain"
        ) as ex:
            for f in [ex.submit(one, m) for m in op.targets]:
                f.result()
        if errors:
            raise PoolError("; ".join(errors))

    def _rollback(self, op: Operation) -> None:
        if op.kind == "scale_out":
            for mid in list(op.engines_added):
                try:
                    self.pool.membership.remove(mid, self.drain_timeout_s, force=True)
                    op.rollback.append(f"removed {mid}")
                except PoolError as e:
                    op.rollback.append(f"could not remove {mid}: {e}")
            return
        for mid in list(op.engines_removed):
            old = self.pool.membership.get(mid)
            try:
                if old.kind == "external":
                    m = self.pool.membership.add(old.url, kind="external")
                elif self.pool.membership.launch is not None:
                    m = self.pool.membership.spawn(old.kind)
                else:
                    op.rollback.append(f"could not bring {mid} back: no engine launcher")
                    continue
            except PoolError as e:
                op.rollback.append(f"could not bring {mid} back: {e}")
                continue
            op.engines_added.append(m.id)
            op.rollback.append(
                f"{mid} replaced by {m.id}" if m.url != old.url else f"{mid} re-added as {m.id}"
            )
        for mid in op.targets:
            if mid not in op.engines_removed and self.pool.membership.get(mid).state == "draining":
                self.pool.membership.reactivate(mid)
                op.rollback.append(f"{mid} active again")
