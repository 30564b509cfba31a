"""One JSON HTTP layer for the engine server and the elastic API: an ASGI app served by uvicorn.

Both servers were hand-rolled on ``http.server``, each with its own routing, bearer auth, body reading and
exception → status mapping, and each had to get keep-alive, server-sent events and the listen backlog
right by hand (a 404 that left the body unread broke the connection's next request; a backlog of 5 reset
most of 200 concurrent clients). uvicorn (h11) does the HTTP — keep-alive, chunked streams, back-pressure —
as it does for SGLang and vLLM; this module keeps only what is ours:

- a route is a plain synchronous function ``(body, request) -> (status, out)`` found by ``resolve``; it runs
  in a worker thread (routes block: generation, weight updates), so the event loop only moves bytes;
- ``out`` is JSON (a dict / list / None), :class:`Text` or :class:`EventStream` (SSE, then ``[DONE]``);
- exceptions map to statuses through one table, each with the error body the server speaks;
- a bearer token guards the paths ``protected`` says, before the body is read;
- a body larger than ``max_body_bytes`` is refused with 413 before it is read whole;
- the body is read first, within ``body_timeout_s`` (then 408); a client that leaves mid-body is dropped
  quietly (it used to log an ERROR traceback per connection);
- admission control: the routes ``admitted`` names (those that generate) are bounded by ``max_admitted``
  requests at once (running + waiting for the engine), counted once the body is in — 256 half-open
  connections used to fill every slot and refuse all generation for as long as they were held; one beyond
  is refused at once with 503, the server's error body and ``Retry-After``, so a flood is answered, not
  queued without end. Other routes (health, metrics) are never refused and run on their own threads, so
  health checks pass under load.

:class:`Served` binds the socket itself (port 0 works, ``server_address`` is known at once, the backlog is
ours) and has the ``serve_forever`` / ``shutdown`` / ``server_close`` of the standard library's servers,
so callers run it in a thread as before.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import itertools
import json
import logging
import re
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

if TYPE_CHECKING:
    import anyio

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
"""Largest request body served (64 MiB: a 128k-token prompt as JSON ids is ~1 MB; base64 media more)."""
BACKLOG = 1024
"""Connections the kernel holds while the server accepts (the standard library's 5 reset most of 200
concurrent clients: 89 ``/generate`` resets, 21 ``/health`` time-outs, measured)."""
THREADS = 256
"""Routes running at once (each in a worker thread; the rest wait their turn, their connections open)."""
RETRY_AFTER_S = 1
"""``Retry-After`` (seconds) of a 503 refused by admission control: a generation slot frees in about that."""
BODY_TIMEOUT_S = 30.0
"""Default time for a request body to arrive (64 MiB at ~2 MB/s, far above any prompt)."""
MAX_DEPTH = 64
"""How deeply a body's arrays and objects may nest (no API here nests more than a few levels; a body nested
100k deep made the JSON decoder exceed Python's recursion limit: a 500)."""


@dataclass
class Text:
    """A response sent as text (Prometheus metrics, SGLang's plain-text answers)."""

    body: str
    content_type: str = "text/plain; charset=utf-8"


@dataclass
class EventStream:
    """A response sent as server-sent events: one ``data:`` line per event, then ``data: [DONE]``. Each
    event is sent as soon as the iterable yields it (``next`` runs in a worker thread: it may block until
    the next token); an error raised after the first event ends the stream with the event
    ``{"error": <the server's error body>}`` (what SGLang sends; OpenAI clients raise it)."""

    events: Iterable[Any]
    on_close: Callable[[], None] | None = None
    """Called once the stream ends, whether sent whole, failed, or the client left (from the event loop:
    it must not block), e.g. to abort the generation behind it so its engine rows are freed."""
    named: bool = False
    """Events are ``(name, data)`` pairs, each sent with its ``event:`` line, and no ``[DONE]`` ends the
    stream (Anthropic's Messages API: its clients dispatch on the event's name)."""


@dataclass
class Request:
    """What a route gets besides the body: headers, path parameters and query parameters."""

    headers: Mapping[str, str]
    """Case-insensitive (``headers.get("Authorization")`` and ``"authorization"`` alike)."""
    params: dict[str, str]
    query: dict[str, str]
    method: str = "GET"
    path: str = "/"


class Overloaded(RuntimeError):
    """A request refused by admission control (503 with ``Retry-After``): too many admitted at once."""


class BodyError(ValueError):
    """The body is not JSON (400) or too large (413); ``field`` is ``body``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.field = "body"


Route = Callable[[Any, Request], tuple[int, Any]]


@dataclass
class JsonApi:
    """The ASGI app. ``resolve(method, path)`` → ``(route, path params)`` or ``(None, {})``;
    ``error_body(status, message, kind, exc)`` → the JSON error body this server speaks; ``errors`` maps
    exception types (checked in order) to statuses — anything else is a 500, logged."""

    name: str
    resolve: Callable[[str, str], tuple[Route | None, dict[str, str]]]
    error_body: Callable[[int, str, str, BaseException | None], Any]
    errors: list[tuple[type[BaseException], int]] = field(default_factory=list)
    token: str | None = None
    protected: Callable[[str], bool] = lambda path: True
    not_found: Callable[[str, str], str] = lambda method, path: f"no route {method} {path}"
    max_body_bytes: int = MAX_BODY_BYTES
    threads: int = THREADS
    admitted: Callable[[str, str], bool] = lambda method, path: False
    """``(method, path)`` → whether the request counts against ``max_admitted`` (the routes that generate)."""
    max_admitted: int | None = None
    """At most this many ``admitted`` requests at once, running or waiting for the engine (each has its own
    worker thread, apart from ``threads``); one beyond is refused at once with 503 and ``Retry-After``.
    None: no bound (they share ``threads`` with the other routes)."""
    limit_name: str = "max_admitted"
    """How the refusal names the bound (the server's flag), so its reader knows what to raise."""
    retry_after_s: int = RETRY_AFTER_S
    body_timeout_s: float = BODY_TIMEOUT_S
    """Seconds a request's body may take to arrive; then 408 and the connection closed (a half-open
    connection, or one that trickles, is not held for ever)."""
    on_refused: Callable[[str, str], None] = lambda method, path: None
    """Called (in the event loop) for each request refused by admission control: count it."""

    def __post_init__(self) -> None:
        if self.max_admitted is not None and (
            isinstance(self.max_admitted, bool)
            or not isinstance(self.max_admitted, int)
            or self.max_admitted < 1
        ):
            raise ValueError(
                f"{self.limit_name}: must be a positive integer or None (got {self.max_admitted!r})"
            )
        # built in the serving loop (anyio's limiter belongs to one event loop)
        self._limiter: anyio.CapacityLimiter | None = None
        self._admitted_limiter: anyio.CapacityLimiter | None = None
        self._running_admitted = 0  # read and changed only in the event loop: no lock

    # -- ASGI ------------------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":  # (served with lifespan off: nothing to start or stop)
            return
        from starlette.requests import Request as StarletteRequest

        request = StarletteRequest(scope, receive)
        # matched still percent-encoded, as sent (a session "a/b" arrives as a%2Fb: one path segment);
        # resolvers decode the parameters they take from it
        method, path = scope["method"], (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        path = path.partition("?")[0]
        if not self._authorised(path, request.headers.get("authorization", "")):  # (unknown routes too)
            message = "missing or wrong bearer token (Authorization: Bearer <token>)"
            await self._json(send, 401, self.error_body(401, message, "Unauthorized", None))
            return
        route, params = self.resolve(method, path)
        if route is None:
            await self._json(send, 404, self.error_body(404, self.not_found(method, path), "NotFound", None))
            return
        req = Request(
            request.headers, params, dict(parse_qsl(scope.get("query_string", b"").decode())), method, path
        )
        from starlette.requests import ClientDisconnect

        try:  # the body first, within its time: a client that never finishes holds no slot and no thread
            body = (
                await asyncio.wait_for(self._body(request), self.body_timeout_s) if method == "POST" else {}
            )
        except ClientDisconnect:  # (the client is gone: nobody to answer, nothing wrong with the server)
            logger.debug("%s: %s %s: the client left before sending its body", self.name, method, path)
            return
        except Exception as e:  # noqa: BLE001 — a body too large, not JSON, or too slow: answered
            if isinstance(e, TimeoutError):
                e = BodyError(
                    f"body: not received within {self.body_timeout_s:g} s; send the whole request at once",
                    408,
                )
            await self._answer(send, method, path, *self._failure(e, method, path))
            return
        limit = self.max_admitted if self.max_admitted is not None and self.admitted(method, path) else None
        limited = limit is not None
        if limit is not None:
            if self._running_admitted >= limit:
                await self._refuse(send, method, path)
                return
            self._running_admitted += 1  # (no await between the check and this: the loop is one thread)
        try:
            try:
                code, out = await self._run(route, body, req, limited)
            except Exception as e:  # noqa: BLE001 — every failure is an answer; the server keeps serving
                code, out = self._failure(e, method, path)
            await self._answer(send, method, path, code, out, receive, limited)
        finally:
            if limited:
                self._running_admitted -= 1

    def _failure(self, e: Exception, method: str, path: str) -> tuple[int, Any]:
        """The status and error body of a request that failed with ``e`` (a 500 is logged with its traceback)."""
        code, kind = self._status(e), type(e).__name__
        if code == 500:
            logger.exception("%s: %s %s failed", self.name, method, path)
            return code, self.error_body(code, f"{kind}: {e}", kind, e)
        return code, self.error_body(code, str(e), kind, e)

    async def _answer(
        self,
        send: Callable,
        method: str,
        path: str,
        code: int,
        out: Any,
        receive: Callable | None = None,
        admitted: bool = False,
    ) -> None:
        if isinstance(out, EventStream):
            await self._events(send, out, receive, admitted, f"{method} {path} (stream)")
        elif isinstance(out, Text):
            await self._send(send, code, out.body.encode(), out.content_type)
        else:  # every 503 (busy, or the device lent to the trainer) says when to try again
            retry = [(b"retry-after", str(self.retry_after_s).encode())] if code == 503 else None
            await self._json(send, code, out, retry)

    # -- pieces ----------------------------------------------------------------------------------------
    def _authorised(self, path: str, got: str) -> bool:
        if self.token is None or not self.protected(path):
            return True
        return got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), self.token.encode())

    def _status(self, e: BaseException) -> int:
        if isinstance(e, BodyError):
            return e.status
        for kind, status in self.errors:
            if isinstance(e, kind):
                return status
        return 500

    async def _body(self, request: Any) -> dict[str, Any]:
        """The JSON object of the body ({} when empty); refused before it is read whole when over the limit,
        and refused when nested over :data:`MAX_DEPTH`, not JSON, or JSON but not an object."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyError(self._too_large(int(declared)), 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyError(self._too_large(size), 413)
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            return {}
        if (depth := _nesting(raw)) > MAX_DEPTH:
            raise BodyError(f"body: nested {depth} levels deep, over this server's limit of {MAX_DEPTH}")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:  # (an integer of over 4,300 digits: a ValueError)
            reason = (
                e.msg
                if isinstance(e, json.JSONDecodeError)
                else "not UTF-8"
                if isinstance(e, UnicodeDecodeError)
                else str(e).split(";")[0]
            )
            raise BodyError(f"body: is not valid JSON ({reason}); send a JSON object") from None
        if not isinstance(body, dict):  # (every route reads an object: a list or a number made them fail)
            raise BodyError(f"body: must be a JSON object, got {type(body).__name__}; send a JSON object")
        if b"\\ud" in raw.lower():  # an escaped surrogate: JSON allows a lone one, no text holds one
            try:
                json.dumps(body, ensure_ascii=False).encode()
            except UnicodeEncodeError:
                raise BodyError("body: holds a lone UTF-16 surrogate (\\ud800-\\udfff): not text") from None
        return body

    def _too_large(self, size: int) -> str:
        return (
            f"body: {size} bytes is over this server's limit of {self.max_body_bytes} bytes; send less "
            f"per request (split the batch), or raise the limit (max_body_bytes)"
        )

    async def _refuse(self, send: Callable, method: str, path: str) -> None:
        """503 with ``Retry-After``: ``max_admitted`` requests are running or waiting for the engine."""
        n = self.max_admitted
        e = Overloaded(
            f"server busy: {n} requests are already running or waiting for the engine, this server's limit "
            f"({self.limit_name} {n}); retry after {self.retry_after_s}s (Retry-After), send fewer at once, "
            f"or raise {self.limit_name}"
        )
        self.on_refused(method, path)
        retry = [(b"retry-after", str(self.retry_after_s).encode())]
        await self._json(send, 503, self.error_body(503, str(e), type(e).__name__, e), retry)

    async def _run(self, route: Route, body: Any, req: Request, admitted: bool = False) -> tuple[int, Any]:
        import anyio.to_thread

        # a thread for each admitted request: the other routes keep theirs (health under load)
        limiter = self._limiter_for(admitted)
        return await anyio.to_thread.run_sync(route, body, req, limiter=limiter)

    async def _send(
        self,
        send: Callable,
        code: int,
        data: bytes,
        content_type: str | None,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        headers = [(b"content-length", str(len(data)).encode())]
        if content_type is not None:
            headers.append((b"content-type", content_type.encode()))
        headers += extra or []
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _json(
        self, send: Callable, code: int, body: Any, extra: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        await self._send(send, code, data, None if body is None else "application/json", extra)

    async def _events(
        self,
        send: Callable,
        events: EventStream,
        receive: Callable | None = None,
        admitted: bool = False,
        what: str = "stream",
    ) -> None:
        """200, ``text/event-stream``, chunked (the connection stays open for the client's next request).
        Each event goes out as the iterable yields it; a client that disconnects ends the stream
        (``on_close``) at once, whatever the iterable is waiting for."""
        import anyio.to_thread

        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        it, end = iter(events.events), object()
        gone = asyncio.ensure_future(self._disconnected(receive)) if receive is not None else None
        limiter = self._limiter_for(admitted)
        try:
            while True:
                step = asyncio.ensure_future(anyio.to_thread.run_sync(next, it, end, limiter=limiter))
                waiting = {step} if gone is None else {step, gone}
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():  # the client left: stop here (on_close aborts what the step waits for)
                    step.add_done_callback(_swallow)
                    return
                try:
                    event = step.result()
                except Exception as e:  # noqa: BLE001 — the stream began: its end says what went wrong
                    failure = self._failure(e, what, "")[1]
                    event = {"error": failure}
                    if events.named:
                        event = (
                            "error",
                            {"type": "error", "error": {"type": "api_error", "message": str(failure)}},
                        )
                    body = _sse(event, events.named)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    break
                if event is end:
                    break
                body = _sse(event, events.named)
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"" if events.named else b"data: [DONE]\n\n"})
        finally:
            if gone is not None:
                gone.cancel()
            if events.on_close is not None:
                events.on_close()

    @staticmethod
    async def _disconnected(receive: Callable) -> None:
        """Returns once the client has disconnected (the body was read before: only that can come)."""
        while (await receive())["type"] != "http.disconnect":
            pass

    def _limiter_for(self, admitted: bool) -> anyio.CapacityLimiter:
        """The threads a route (or a stream's ``next``) runs on: an admitted request's own (one at a time
        each), else the other routes' (anyio's default of 40 would hold streams back behind each other)."""
        import anyio

        if admitted:
            assert self.max_admitted is not None, "requests are admitted only under max_admitted"
            if self._admitted_limiter is None:
                self._admitted_limiter = anyio.CapacityLimiter(self.max_admitted)
            return self._admitted_limiter
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        return self._limiter


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _nesting(raw: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` in a JSON text outside its strings (0 where it cannot pass
    :data:`MAX_DEPTH`), found at C speed: strings removed, the brackets kept, their running sum."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _sse(event: Any, named: bool = False) -> bytes:
    if named:  # (name, data)
        return f"event: {event[0]}\n".encode() + b"data: " + json.dumps(event[1]).encode() + b"\n\n"
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _swallow(task: asyncio.Future) -> None:
    """Retrieve a finished task's outcome (an abandoned stream step's), so none is logged as unread."""
    if not task.cancelled():
        task.exception()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None, what: str) -> None:
    """A server that changes the run binds loopback, or needs a token; a blank token protects nothing."""
    if token is not None and not token.strip():
        raise ValueError(f"{what}: the token is blank; give one of visible characters (or none on loopback)")
    if not is_loopback(host) and not token:
        raise ValueError(
            f"{what}: host {host} is not a loopback address: give a token so control endpoints need it"
        )


class Served:
    """An ASGI app bound to ``host:port`` (0: any free port), served by uvicorn when ``serve_forever`` runs
    (in a thread, or the main thread, where SIGINT / SIGTERM stop it)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, backlog: int = BACKLOG):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio turns Nagle off only on sockets that say so, and accepted ones copy the
        # listener's; with proto 0 every answer after the first on a kept-alive connection waited ~40 ms
        # for the client's delayed ACK (the body sent after the headers)
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(backlog)
        except OSError:
            self._sock.close()
            raise
        self.server_address = self._sock.getsockname()
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            backlog=backlog,
            timeout_graceful_shutdown=3,
            server_header=False,
        )
        self._server = uvicorn.Server(config)
        self._running, self._done = False, threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def serve_forever(self, poll_interval: float | None = None) -> None:
        """Serve until :meth:`shutdown` (``poll_interval`` is accepted for the standard library's signature)."""
        self._running = True
        try:
            with asyncio.Runner(loop_factory=self._server.config.get_loop_factory()) as runner:
                runner.run(self._serve())
        finally:
            self._done.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._server.serve(sockets=[self._sock])

    def shutdown(self, timeout_s: float = 10.0, abrupt: bool = False) -> None:
        """Stop serving and wait for ``serve_forever`` to return (requests still running get 3 s).
        ``abrupt``: reset every open connection at once, so requests in flight fail on the client's side as
        those of a crashed process do (their routes still run to the end here)."""
        if abrupt and self._loop is not None:
            self._server.force_exit = True
            self._loop.call_soon_threadsafe(self._abort_connections)
        self._server.should_exit = True
        if self._running and not self._done.wait(timeout_s):
            raise TimeoutError(f"HTTP server on {self.server_address} did not stop within {timeout_s}s")

    def _abort_connections(self) -> None:
        for conn in list(self._server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()

    def server_close(self) -> None:
        self._sock.close()
