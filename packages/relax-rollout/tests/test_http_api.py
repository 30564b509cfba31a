"""The shared HTTP layer on a real uvicorn server on 127.0.0.1, with toy routes (no model): errors become
the server's error bodies, bodies have a limit, streams keep the connection, the token guards before the
body is read, and shutdown (plain or abrupt) returns."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from relax_rollout import http_api


class Refused(ValueError):
    pass


def _routes(gate: threading.Event):
    def echo(body, req):
        return 200, {"body": body, "query": req.query, "auth": req.headers.get("Authorization")}

    def events(body, req):
        return 200, http_api.EventStream([{"i": i} for i in range(3)])

    def refuse(body, req):
        raise Refused("no, and here is what to do")

    def crash(body, req):
        raise RuntimeError("boom")

    def slow(body, req):
        gate.wait(30)
        return 200, {"ok": True}

    table = {
        ("POST", "/echo"): echo,
        ("GET", "/events"): events,
        ("POST", "/refuse"): refuse,
        ("GET", "/crash"): crash,
        ("GET", "/slow"): slow,
        ("POST", "/admin/echo"): echo,
    }
    return lambda method, path: (table.get((method, path)), {})


@pytest.fixture
def served():
    started = []

    def start(**kw):
        gate = threading.Event()
        api = http_api.JsonApi(
            "toy",
            _routes(gate),
            lambda code, msg, kind, exc: {"message": msg, "type": kind, "code": code},
            errors=[(Refused, 409)],
            protected=lambda path: path.startswith("/admin/"),
            **kw,
        )
        srv = http_api.Served(api)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        started.append((srv, gate, t))
        return srv, gate, t

    yield start
    for srv, gate, _ in started:
        gate.set()
        srv.shutdown()
        srv.server_close()


def _conn(srv) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)


def _ask(c, method, path, body=b"", headers=None):
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    return r.status, r.getheader("Content-Type"), r.read()


def test_errors_limits_and_streams_on_one_connection(served):
    srv, _, _ = served(max_body_bytes=1000)
    c = _conn(srv)  # every answer below comes over this one connection: keep-alive holds after each
    code, _, data = _ask(c, "POST", "/echo?x=1", json.dumps({"a": 1}))
    assert code == 200 and json.loads(data) == {"body": {"a": 1}, "query": {"x": "1"}, "auth": None}
    code, kind, data = _ask(c, "GET", "/events")
    assert code == 200 and kind == "text/event-stream"
    assert data.decode().split("\n\n")[:4] == [
        'data: {"i": 0}',
        'data: {"i": 1}',
        'data: {"i": 2}',
        "data: [DONE]",
    ]
    code, _, data = _ask(c, "POST", "/echo", b"{not json")
    assert code == 400 and "is not valid JSON" in json.loads(data)["message"]
    code, _, data = _ask(c, "POST", "/echo", b'"\xff\xfe"')
    assert code == 400 and "not UTF-8" in json.loads(data)["message"]
    code, _, data = _ask(c, "POST", "/echo", b"[" + b"1," * 600 + b"1]")  # 1201 bytes
    assert code == 413 and "limit of 1000 bytes" in json.loads(data)["message"]
    code, _, data = _ask(c, "POST", "/refuse", b"{}")
    assert code == 409 and json.loads(data) == {
        "message": "no, and here is what to do",
        "type": "Refused",
        "code": 409,
    }
    code, _, data = _ask(c, "GET", "/crash")
    assert code == 500 and json.loads(data)["message"] == "RuntimeError: boom"
    code, _, data = _ask(c, "GET", "/nope", b"")
    assert code == 404 and json.loads(data)["message"] == "no route GET /nope"
    code, _, data = _ask(c, "POST", "/echo", json.dumps({"still": "alive"}))
    assert code == 200 and json.loads(data)["body"] == {"still": "alive"}


def test_the_token_guards_protected_paths_only(served):
    srv, _, _ = served(token="s3cret")
    c = _conn(srv)
    assert _ask(c, "POST", "/admin/echo", b"{}")[0] == 401
    assert _ask(c, "POST", "/admin/echo", b"{}", {"Authorization": "Bearer wrong"})[0] == 401
    assert _ask(c, "POST", "/admin/echo", b"{}", {"Authorization": "Bearer s3cret"})[0] == 200
    assert _ask(c, "POST", "/echo", b"{}")[0] == 200  # not protected


def test_a_running_route_does_not_block_others_and_abrupt_shutdown_resets_it(served):
    srv, gate, t = served()
    result: dict = {}

    def slow():
        try:
            result["slow"] = _ask(_conn(srv), "GET", "/slow")
        except (ConnectionError, http.client.HTTPException) as e:
            result["slow"] = e

    waiter = threading.Thread(target=slow, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert _ask(_conn(srv), "POST", "/echo", b"{}")[0] == 200  # served while /slow blocks its thread
    srv.shutdown(abrupt=True)
    waiter.join(10)
    t.join(10)
    assert not t.is_alive() and isinstance(result["slow"], (ConnectionError, http.client.HTTPException))


def _half_open(srv, n: int, path: str = "/echo") -> list:
    """``n`` connections that send a request's headers and the first byte of a 100-byte body, then nothing."""
    import socket

    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=30)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode())
        socks.append(s)
    return socks


def test_half_open_connections_hold_no_admission_slot_and_leave_quietly(served, caplog):
    """Before: a request was admitted (counted against ``max_admitted``) before its body was read, so 256
    half-open connections refused every other request with 503 while held, and each one that left logged
    an ERROR with a traceback. Now the body is read first and a client that leaves is dropped quietly."""
    srv, _, _ = served(admitted=lambda method, path: path == "/echo", max_admitted=256)
    socks = _half_open(srv, 256)
    try:
        time.sleep(0.5)  # (every one of them is in: its headers are read)
        code, _, data = _ask(_conn(srv), "POST", "/echo", json.dumps({"a": 1}))
        assert code == 200 and json.loads(data)["body"] == {"a": 1}
    finally:
        with caplog.at_level("DEBUG", logger="relax_rollout.http_api"):
            for s in socks:
                s.close()
            time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")], caplog.text


def test_a_body_that_does_not_arrive_in_time_is_a_408(served):
    srv, _, _ = served(body_timeout_s=0.5)
    (s,) = _half_open(srv, 1)
    try:
        s.settimeout(10)
        t = time.monotonic()
        got = b""
        while b"not received" not in got and (chunk := s.recv(4096)):  # (headers and body may come apart)
            got += chunk
        head = got.decode()
        assert head.startswith("HTTP/1.1 408") and "not received within 0.5 s" in head, head
        assert time.monotonic() - t < 5
    finally:
        s.close()


def test_answers_go_out_without_waiting_for_the_client_s_ack(served):
    """Nagle is off on every connection the server accepts (TCP_NODELAY): before (#49), the listening socket
    did not say it was TCP (proto 0), so asyncio left Nagle on, and every answer after the first on a
    kept-alive connection (the body written after the headers) waited ~40 ms for the client's delayed ACK
    (what OpenAI's client, which keeps connections alive, paid on every request)."""
    import gc
    import socket

    srv, _, _ = served()
    c = _conn(srv)
    assert _ask(c, "POST", "/echo", b'{"a": 1}')[0] == 200
    mine = c.sock.getsockname()
    accepted = [
        s
        for s in gc.get_objects()
        if isinstance(s, socket.socket)
        and s.fileno() != -1
        and s.type == socket.SOCK_STREAM
        and _peer(s) == mine
    ]
    assert accepted, "the server's end of the connection was not found"
    assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in accepted)


def _peer(s):
    try:
        return s.getpeername()
    except OSError:
        return None
