"""A rollout engine over a changing set of HTTP engine servers (the elastic rollout's engine pool).

Why: with engines in their own processes (``ray_native`` actors, or SGLang servers started elsewhere and
joined by URL) the set of engines changes during a run — one crashes, the elastic API adds or removes
some — while the rollout manager keeps seeing one ``RolloutEngine``. The pool guarantees:

- **No request is lost.** A batch is split into contiguous chunks over the *active* members, sent
  concurrently. A member that fails (connection refused or reset: its process died; an HTTP 5xx; a
  time-out) is marked ``failed``, ``on_failure(member)`` is called (the health manager restarts it) and its
  chunk is re-issued on the remaining members. A chunk that comes back aborted because its member is
  being drained (scale-in after the drain time-out) is re-issued too. ``generate`` returns one output per
  prompt, or raises :class:`NoActiveEngine` saying what happened to every member.
- **Every serving member holds the current weights.** ``update_weights`` writes the tensors once to a
  pool-owned directory (one sub-directory per version, replaced atomically, the previous one deleted
  after the push) that is *kept*: a newcomer (``add``, ``restart``) loads it through
  ``/update_weights_from_disk`` and must report the pool's version in ``/model_info`` before it gets
  any request. A member that fails the push is marked failed instead of failing the update.
- **Scale-in drains.** ``remove`` stops sending to the member, waits for its in-flight requests up to
  the drain time-out, then (``force``) aborts them with ``/abort_request`` — they come back and are
  re-issued elsewhere — and only then reports it removed (``kill(handle)`` for a launched engine, then
  ``on_removed(member)``). The last active member is never removed; start-up members are ``protected``
  (the elastic API's scale-in never picks them).

Member states: ``joining`` (receiving the current weights), ``active``, ``draining``, ``removed``,
``failed``. Ids (``e0``, ``e1``, ...) are never reused.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from relax_rollout.engines.base import GenerateOutput, SamplingParams
from relax_rollout.engines.wire import (
    ServerError,
    generate_body,
    http_json,
    min_tokens,
    model_info,
    parse_reply,
    save_safetensors,
    version_number,
)

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "kind": self.kind,
            "state": self.state,
            "protected": self.protected,
            "inflight": self.inflight,
            "weight_version": self.weight_version,
            "created": self.created,
            "served": self.served,
            "error": self.error,
            "replaced_by": self.replaced_by,
        }


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


class EnginePool:
    """A :class:`~relax_rollout.engines.base.RolloutEngine` over HTTP engine servers.

    ``urls``: start-up engines already serving (kind ``startup``, protected); more join with :meth:`add`,
    :meth:`spawn` (through ``launch``) or :meth:`start`. ``launch() -> (url, handle)`` starts one engine
    (e.g. :func:`~relax_rollout.server.served.ray_launcher`), ``kill(handle)`` ends one.
    ``on_failure(member)`` and ``on_removed(member)`` are called (from the calling thread, keep them
    short) when a member fails and after one is removed. ``weights_dir``: where the current weights are
    kept for newcomers (default: a temporary directory owned by the pool, deleted by :meth:`close`); it
    must be readable by every engine (same host or a shared filesystem)."""

    features = frozenset({"top_logprobs", "stop"})
    """Passed on to the members (SGLang's ``top_logprobs_num`` and ``stop``)."""

    def __init__(
        self,
        urls: list[str] | str | None = None,
        *,
        token: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 1,
        retry_backoff_s: float = 0.1,
        join_timeout_s: float = 60.0,
        launch: Callable[[], tuple[str, Any]] | None = None,
        kill: Callable[[Any], None] | None = None,
        on_failure: Callable[[Member], None] | None = None,
        on_removed: Callable[[Member], None] | None = None,
        weights_dir: str | None = None,
        max_workers: int = 64,
        **_ignored: Any,  # model_path, dtype, eos/pad ids: the servers own their model
    ) -> None:
        self.token, self.timeout_s = token, timeout_s
        self.retries, self.retry_backoff_s, self.join_timeout_s = retries, retry_backoff_s, join_timeout_s
        self.launch, self.kill = launch, kill
        self.on_failure, self.on_removed = on_failure, on_removed
        self._own_dir = weights_dir is None
        self.weights_root = Path(weights_dir or tempfile.mkdtemp(prefix="relax-pool-weights-"))
        self.weights_root.mkdir(parents=True, exist_ok=True)
        self.weights_path: str | None = None
        """The directory holding the current weights (None until the first update)."""
        self._version: int | None = None
        self._members: dict[str, Member] = {}
        self._next_id = 0
        self._cond = threading.Condition(threading.RLock())
        self._weights_lock = threading.RLock()  # updates and joins are serialised
        self._exec = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="relax-pool")
        self._stats = {
            "requests": 0,
            "prompts": 0,
            "reissued_prompts": 0,
            "failures": 0,
            "aborts_reissued": 0,
        }
        if isinstance(urls, str):
            urls = [urls]
        for url in urls or []:
            self.add(url, kind="startup", protected=True)

    # -- HTTP ------------------------------------------------------------------------------------
    def _call(self, url: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        return http_json(
            url, path, body, self.token, timeout_s or self.timeout_s, self.retries, self.retry_backoff_s
        )

    # -- membership ------------------------------------------------------------------------------
    def get(self, member_id: str) -> Member:
        with self._cond:
            if member_id not in self._members:
                raise PoolError(f"unknown engine {member_id!r}; known: {sorted(self._members)}")
            return self._members[member_id]

    def members(self, include_removed: bool = False) -> list[dict[str, Any]]:
        """Every member as a dict (id, url, kind, state, protected, inflight, weight_version, created,
        served, error, replaced_by), oldest first; removed ones only with ``include_removed``."""
        with self._cond:
            return [m.to_dict() for m in self._members.values() if include_removed or m.state != "removed"]

    def active(self) -> list[Member]:
        with self._cond:
            return [m for m in self._members.values() if m.state == "active"]

    def find(self, url: str) -> Member | None:
        """The member (not removed) serving ``url``."""
        url = url.rstrip("/")
        with self._cond:
            for m in self._members.values():
                if m.url == url and m.state != "removed":
                    return m
        return None

    def add(self, url: str, kind: str = "external", handle: Any = None, protected: bool = False) -> Member:
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
        with self._cond:
            other = self.find(url)
            if other is not None and other.state != "failed":
                raise PoolError(f"{url} is already in the pool as {other.id} ({other.state})")
            m = Member(id=f"e{self._next_id}", url=url, kind=kind, protected=protected, handle=handle)
            self._next_id += 1
            self._members[m.id] = m
            if other is not None:  # a failed engine at this URL came back: the new member replaces it
                other.state, other.replaced_by = "removed", m.id
        try:
            self._wait_healthy(m)
            with self._weights_lock:  # no update may slip in between the sync and the activation
                if self.weights_path is not None:
                    self._call(
                        m.url,
                        "/update_weights_from_disk",
                        {"model_path": self.weights_path, "weight_version": str(self._version)},
                    )
                info = model_info(m.url, self.token, self.join_timeout_s)
                got = version_number(info.get("weight_version"))
                with self._cond:
                    if self._version is None:  # the first member sets the pool's version
                        self._version = got
                    if got != self._version:
                        raise PoolError(
                            f"{url} holds weight version {got} after the sync, the pool serves "
                            f"{self._version}"
                        )
                    m.weight_version, m.state = got, "active"
                    self._cond.notify_all()
        except Exception as e:
            with self._cond:
                m.state, m.error = "removed", f"join failed: {_describe(e)}"
            if isinstance(e, PoolError):
                raise
            raise PoolError(f"engine {url} could not join the pool: {_describe(e)}") from e
        logger.info("engine %s (%s, %s) joined at weight version %s", m.id, kind, url, m.weight_version)
        return m

    def _wait_healthy(self, m: Member) -> None:
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            try:
                http_json(m.url, "/health", None, self.token, min(10.0, self.join_timeout_s))
                return
            except (ConnectionError, ServerError) as e:  # not listening yet, or 503 while warming up
                if isinstance(e, ServerError) and e.status < 500 or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def spawn(self, kind: str = "ray_native", protected: bool = False) -> Member:
        """Launch one engine with ``launch`` and :meth:`add` it (killed again when it cannot join)."""
        if self.launch is None:
            raise PoolError("this pool has no engine launcher (engines are not launched on Ray)")
        url, handle = self.launch()
        try:
            return self.add(url, kind=kind, handle=handle, protected=protected)
        except Exception:
            self._kill(handle)
            raise

    def start(self, n: int) -> list[Member]:
        """Launch ``n`` protected start-up engines concurrently."""
        futs = [self._exec.submit(self.spawn, "startup", True) for _ in range(n)]
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
        with self._cond:
            m = self.get(member_id)
            if m.state == "removed":
                raise PoolError(f"engine {member_id} is already removed")
            if m.state == "joining":
                raise PoolError(f"engine {member_id} is still joining; remove it once it is active")
            if m.state == "active" and not any(
                o.state == "active" for o in self._members.values() if o is not m
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
                    self._cond.notify_all()
                    raise Cancelled(f"the drain of engine {member_id} was cancelled; it is active again")
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            pending = m.inflight if was_active else 0
        if pending:
            if not force:
                with self._cond:
                    m.state = "active"
                    self._cond.notify_all()
                raise DrainTimeout(
                    f"engine {member_id} still had {pending} request(s) in flight after {drain_timeout_s}s; "
                    "it is active again (use force to abort them and re-issue them elsewhere)"
                )
            logger.info("engine %s: aborting %d in-flight request(s) after the drain time-out", m.id, pending)
            try:
                self._call(m.url, "/abort_request", {"abort_all": True}, timeout_s=10.0)
            except (OSError, ServerError) as e:
                logger.warning("engine %s: abort_request failed (%s)", m.id, _describe(e))
            with self._cond:  # the aborted requests come back (and are re-issued) before it goes away
                self._cond.wait_for(lambda: m.inflight == 0, timeout=max(10.0, drain_timeout_s))
        with self._cond:
            m.state = "removed"
            self._cond.notify_all()
        self._kill(m.handle)
        self._notify(self.on_removed, m)
        logger.info("engine %s (%s) removed", m.id, m.url)
        return m

    def reactivate(self, member_id: str) -> Member:
        """Put a draining member back to active (a cancelled scale-in)."""
        with self._cond:
            m = self.get(member_id)
            if m.state != "draining":
                raise PoolError(f"engine {member_id} is {m.state}, not draining")
            m.state = "active"
            self._cond.notify_all()
            return m

    def restart(self, member_id: str) -> Member:
        """Replace a (failed) launched member in place: kill its process, launch a new one with the current
        weights and the same ``protected`` flag (a new id). The old member ends ``removed``."""
        with self._cond:
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
                o.state == "active" for o in self._members.values() if o is not old
            ):
                logger.warning("restarting %s, the last active engine: requests wait for the new one", old.id)
            old.state, old.error = "failed", old.error or "restarted"
            self._cond.notify_all()
        self._kill(old.handle)
        new = self.spawn(kind=old.kind, protected=old.protected)
        with self._cond:
            old.state, old.replaced_by = "removed", new.id
        logger.info("engine %s restarted as %s (%s)", old.id, new.id, new.url)
        return new

    def mark_failed(self, member_id: str, reason: str) -> Member:
        """Mark a member failed from outside (its process was seen to exit): it gets no more requests, and
        ``on_failure`` is called as for a failure the pool saw itself. A no-op for a failed or removed one."""
        m = self.get(member_id)
        self._fail(m, RuntimeError(reason))
        return m

    def retire(self, member_id: str, replaced_by: str | None = None) -> Member:
        """Mark a failed member removed (replaced by ``replaced_by``, e.g. a restarted process)."""
        with self._cond:
            m = self.get(member_id)
            if m.state not in ("failed", "removed"):
                raise PoolError(f"engine {member_id} is {m.state}: only a failed engine is retired")
            m.state = "removed"
            m.replaced_by = replaced_by or m.replaced_by
            self._cond.notify_all()
            return m

    def _kill(self, handle: Any) -> None:
        if handle is not None and self.kill is not None:
            try:
                self.kill(handle)
            except Exception as e:  # noqa: BLE001 — it may be dead already
                logger.warning("killing an engine failed: %s", _describe(e))

    def _notify(self, cb: Callable[[Member], None] | None, m: Member) -> None:
        if cb is not None:
            try:
                cb(m)
            except Exception:  # noqa: BLE001 — a callback must not break the pool
                logger.exception("pool callback %s failed for %s", cb, m.id)

    def _fail(self, m: Member, err: BaseException) -> None:
        with self._cond:
            if m.state in ("failed", "removed"):
                return
            if m.state == "draining":  # it was going away anyway: no failure to report
                return
            m.state, m.error = "failed", _describe(err)
            self._stats["failures"] += 1
            self._cond.notify_all()
        logger.warning("engine %s (%s) failed: %s", m.id, m.url, m.error)
        self._notify(self.on_failure, m)

    # -- RolloutEngine ---------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The version every active member holds (the last update's; before any, the members' own)."""
        with self._cond:
            return self._version if self._version is not None else 0

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        fields: list[dict[str, Any]] | None = None,
        common: dict[str, Any] | None = None,
        parse: Callable[[list[dict], list[list[int]]], list[GenerateOutput]] | None = None,
    ) -> list[GenerateOutput]:
        """One output per prompt. ``fields`` (one dict per prompt) and ``common`` are extra ``/generate``
        request fields (see :func:`~relax_rollout.engines.wire.generate_body`); ``parse(reply, prompts)``
        replaces :func:`~relax_rollout.engines.wire.parse_reply` (e.g. routed experts in the model's shape)."""
        if not prompts:
            return []
        if fields is not None and len(fields) != len(prompts):
            raise ValueError(f"{len(fields)} per-prompt field dicts for {len(prompts)} prompts")
        mins = min_tokens(params, len(prompts))
        results: list[GenerateOutput | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        with self._cond:
            self._stats["prompts"] += len(prompts)
        rounds = 0
        while todo:
            rounds += 1
            if rounds > 4 + 2 * max(1, self._next_id):  # every round retires a member: cannot loop forever
                raise PoolError(f"{len(todo)} prompt(s) still unanswered after {rounds - 1} re-issues")
            chunks = self._assign(todo, len(prompts))
            futs = [
                (
                    m,
                    idx,
                    self._exec.submit(
                        self._send,
                        m,
                        [prompts[i] for i in idx],
                        params,
                        [mins[i] for i in idx],
                        None if fields is None else [fields[i] for i in idx],
                        common,
                        parse,
                    ),
                )
                for m, idx in chunks
            ]
            again: list[int] = []
            aborted = 0
            error: BaseException | None = None
            for m, idx, fut in futs:
                try:
                    outs = fut.result()
                except ServerError as e:
                    if e.status < 500:  # the request itself is wrong: no other member will take it
                        error = error or e
                        continue
                    self._fail(m, e)
                    again += idx
                    continue
                except (OSError, ValueError, KeyError) as e:  # died, hung, or answered garbage
                    self._fail(m, e)
                    again += idx
                    continue
                with self._cond:
                    going = m.state in ("draining", "removed")
                    m.served += sum(o.finish_reason != "abort" or not going for o in outs)
                for i, o in zip(idx, outs):
                    if o.finish_reason == "abort" and going:  # aborted by a scale-in: serve it elsewhere
                        again.append(i)
                        aborted += 1
                    else:
                        results[i] = o
            if error is not None:
                raise error
            if again:
                with self._cond:
                    self._stats["reissued_prompts"] += len(again)
                    self._stats["aborts_reissued"] += aborted
                logger.info("re-issuing %d prompt(s) on the remaining engines", len(again))
            todo = sorted(again)
        return results  # type: ignore[return-value]

    def _assign(self, todo: list[int], total: int) -> list[tuple[Member, list[int]]]:
        """Contiguous chunks of ``todo`` over the active members; counts them in flight at once (so a drain
        that starts now waits for them)."""
        with self._cond:
            live = [m for m in self._members.values() if m.state == "active"]
            if not live:
                raise NoActiveEngine(
                    f"no active engine left for {len(todo)} of {total} prompt(s): {self._summary()}"
                )
            size = -(-len(todo) // len(live))
            chunks = [(m, todo[i : i + size]) for m, i in zip(live, range(0, len(todo), size))]
            for m, idx in chunks:
                m.inflight += len(idx)
            self._stats["requests"] += len(chunks)
            return chunks

    def _send(
        self,
        m: Member,
        prompts: list[list[int]],
        params: SamplingParams,
        mins: list[int],
        fields: list[dict[str, Any]] | None = None,
        common: dict[str, Any] | None = None,
        parse: Callable[[list[dict], list[list[int]]], list[GenerateOutput]] | None = None,
    ) -> list[GenerateOutput]:
        try:
            reply = self._call(m.url, "/generate", generate_body(prompts, params, mins, fields, common))
            outs = (parse or parse_reply)(reply, prompts)
            if len(outs) != len(prompts):
                raise ValueError(f"{m.url} answered {len(outs)} outputs for {len(prompts)} prompts")
            return outs
        finally:
            with self._cond:
                m.inflight -= len(prompts)
                self._cond.notify_all()

    def _summary(self) -> str:
        parts = []
        for m in self._members.values():
            why = f" ({m.error})" if m.error and m.state in ("failed", "removed") else ""
            parts.append(f"{m.id} {m.state}{why}")
        return "; ".join(parts) or "the pool has no engines"

    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Keep ``tensors`` as the current weights (for newcomers) and load them on every serving member."""
        with self._weights_lock:
            tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.weights_root))
            final = self.weights_root / f"v{version}-{uuid.uuid4().hex[:8]}"
            try:
                save_safetensors(tensors, str(tmp))
                tmp.rename(final)  # atomic: a reader sees the whole version or none
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            with self._cond:
                targets = [m for m in self._members.values() if m.state in ("active", "draining")]
            body = {"model_path": str(final), "weight_version": str(version)}
            futs = [
                (m, self._exec.submit(self._call, m.url, "/update_weights_from_disk", body)) for m in targets
            ]
            # A member that did not load it is failed, a refusal (HTTP 400) included: SGLang refuses after a
            # partial load whose roll-back re-reads the new directory, so its weights are unknown.
            errors: list[str] = []
            for m, fut in futs:
                try:
                    fut.result()
                    with self._cond:
                        m.weight_version = version
                except (OSError, ValueError, ServerError) as e:
                    self._fail(m, e)
                    errors.append(f"{m.id} ({m.url}): {_describe(e)}")
            if targets and len(errors) == len(targets):  # none took it: the previous version stays
                shutil.rmtree(final, ignore_errors=True)
                raise PoolError(f"no engine loaded weight version {version}: {'; '.join(errors)}")
            previous, self.weights_path = self.weights_path, str(final)
            with self._cond:
                self._version = version
            self._drop_owned(previous)

    def _drop_owned(self, path: str | None) -> None:
        """Delete a weights directory the pool wrote (never one it was given by :meth:`adopt_weights`)."""
        if path is not None and Path(path).parent == self.weights_root:
            shutil.rmtree(path, ignore_errors=True)

    def adopt_weights(self, version: int, path: str | None = None) -> None:
        """The serving members were updated to ``version`` outside the pool (an NCCL broadcast, a checkpoint
        loaded with ``/update_weights_from_disk``): record it as the pool's version. ``path``: a directory a
        newcomer can load that version from (the pool never deletes it); None: newcomers cannot be synced,
        so they fail to join (rather than serve older weights) until the next update that leaves a path."""
        with self._weights_lock:
            previous, self.weights_path = self.weights_path, path
            with self._cond:
                self._version = version
                for m in self._members.values():
                    if m.state in ("active", "draining"):
                        m.weight_version = version
            if previous != path:
                self._drop_owned(previous)

    def weights_checksum(self) -> str:
        """The active members' checksum (a relax extension); they must agree."""
        sums: dict[str, str] = {}
        for m in self.active():
            try:
                sums[m.id] = self._call(m.url, "/weights_checksum")["checksum"]
            except ServerError as e:
                if e.status == 404:
                    raise NotImplementedError(
                        f"{m.url} has no /weights_checksum (not a relax engine server)"
                    ) from e
                raise
        if not sums:
            raise NoActiveEngine(f"no active engine to ask for a checksum: {self._summary()}")
        if len(set(sums.values())) != 1:
            raise RuntimeError(f"pool engines hold different weights: {sums}")
        return next(iter(sums.values()))

    # -- extras ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters: requests (chunks sent), prompts, reissued_prompts (of which aborts_reissued came back
        aborted from a drained engine), failures (members marked failed); members by state."""
        with self._cond:
            out: dict[str, Any] = dict(self._stats)
            for s in STATES:
                out[f"engines_{s}"] = sum(m.state == s for m in self._members.values())
            out["weight_version"] = self._version
            return out

    def health(self) -> dict[str, bool]:
        """Probe every active or draining member's ``/health`` (a failing one is marked failed)."""
        ok: dict[str, bool] = {}
        with self._cond:
            targets = [m for m in self._members.values() if m.state in ("active", "draining")]
        for m in targets:
            try:
                http_json(m.url, "/health", None, self.token, 10.0)
                ok[m.id] = True
            except (OSError, ServerError) as e:
                self._fail(m, e)
                ok[m.id] = False
        return ok

    def close(self, kill: bool = False) -> None:
        """Stop the pool's threads; ``kill``: also end every launched engine. Deletes its own weights dir."""
        self._exec.shutdown(wait=False, cancel_futures=True)
        if kill:
            with self._cond:
                handles = [m.handle for m in self._members.values() if m.state != "removed"]
            for h in handles:
                self._kill(h)
        if self._own_dir:
            shutil.rmtree(self.weights_root, ignore_errors=True)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
