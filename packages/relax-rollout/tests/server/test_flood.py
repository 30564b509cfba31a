"""A flood of concurrent generation requests on the engine server (a subprocess on 127.0.0.1): admission
control (``--max-queued-requests``) answers every request, 200 or at once 503 with ``Retry-After`` and
SGLang's error body, never a reset; ``/health`` answers throughout, and ``/metrics`` counts the refusals."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.integration
N = 200
"""Concurrent requests in a flood."""
BOUND = 8
"""``--max-queued-requests`` of the flooded server: small, so most of the flood is refused."""
WALL_S = 120.0
"""The flood is answered within this (generous: a loaded 2-core CI machine answers in seconds)."""


def _requests() -> list[tuple[str, dict]]:
    """N requests over the three routes that generate, each a prompt and two new tokens."""
    gen = {"input_ids": [3, 12, 4, 13], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    chat = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2, "temperature": 0}
    comp = {"prompt": "1+2=", "max_tokens": 2, "temperature": 0}
    routes = [("/generate", gen), ("/v1/chat/completions", chat), ("/v1/completions", comp)]
    return [routes[i % len(routes)] for i in range(N)]


def _client(url: str):
    # no pool limit: every request of the flood opens its own connection at once
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=WALL_S)


async def _post(client, path: str, body: dict) -> tuple[int, dict, bytes]:
    r = await client.post(path, json=body)
    return r.status_code, dict(r.headers), r.content


def _metric(text: str, name: str) -> float:
    hit = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert hit, f"{name} not in /metrics:\n{text}"
    return float(hit.group(1))


def _check_answers(results: list, bound: int | None) -> tuple[int, int]:
    """Every request answered: no exception (reset, time-out), 200 with a reply, or 503 with an integer
    ``Retry-After`` and the error body naming the limit. Returns (200s, 503s)."""
    import json

    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    assert not errors, f"{len(errors)} of {N} requests failed on the client's side: {errors[:3]}"
    codes = [code for code, _, _ in results]
    assert set(codes) <= {200, 503}, sorted(set(codes))
    for code, headers, data in results:
        body = json.loads(data)
        if code == 200:
            assert "text" in body or "choices" in body, body
            continue
        assert int(headers["retry-after"]) >= 1, headers
        assert body["object"] == "error" and body["code"] == 503 and body["type"] == "Overloaded", body
        assert f"--max-queued-requests {bound}" in body["message"] and "retry" in body["message"], body
    return codes.count(200), codes.count(503)


def test_a_flood_over_the_limit_is_answered_or_refused_with_503_never_reset(tiny_model_dir, launch):
    """Generation paused (requests admitted wait for the engine, as during a weight update): of N concurrent
    requests exactly BOUND are admitted and the rest are refused at once; /health answers meanwhile; after
    continue_generation the admitted ones finish with 200."""
    proc, url = launch(tiny_model_dir, "--max-queued-requests", str(BOUND))
    try:

        async def flood():
            async with _client(url) as client:
                assert (await client.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
                t0 = time.monotonic()
                tasks = [asyncio.create_task(_post(client, path, body)) for path, body in _requests()]
                # the refusals come back at once, while the admitted requests wait for the engine
                while sum(t.done() for t in tasks) < N - BOUND and time.monotonic() - t0 < WALL_S / 2:
                    await asyncio.sleep(0.05)
                held = sum(not t.done() for t in tasks)
                health = (await client.get("/health")).status_code  # during the flood
                metrics = (await client.get("/metrics")).text
                assert (await client.post("/continue_generation", json={})).status_code == 200
                results = await asyncio.wait_for(
                    asyncio.gather(*tasks, return_exceptions=True), WALL_S - (time.monotonic() - t0)
                )
                after = (await client.get("/metrics")).text
                return held, health, metrics, results, time.monotonic() - t0, after

        held, health, during, results, wall, after = asyncio.run(flood())
        assert health == 200
        assert held == BOUND, f"{held} requests held while paused, want {BOUND} (the rest refused)"
        assert _metric(during, "sglang:num_queue_reqs") == BOUND  # admitted = waiting for the engine
        ok, refused = _check_answers(results, BOUND)
        assert (ok, refused) == (BOUND, N - BOUND)
        assert wall < WALL_S
        assert _metric(after, "relax:num_refused_requests_total") == refused
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_flood_within_the_default_limit_is_served_whole(engine_server):
    """The default bound (256) admits N concurrent requests: all 200, none refused, no reset."""

    async def flood():
        async with _client(engine_server) as client:
            before = (await client.get("/metrics")).text
            results = await asyncio.wait_for(
                asyncio.gather(*(_post(client, p, b) for p, b in _requests()), return_exceptions=True), WALL_S
            )
            return before, results, (await client.get("/metrics")).text

    before, results, after = asyncio.run(flood())
    ok, refused = _check_answers(results, None)
    assert (ok, refused) == (N, 0)
    name = "relax:num_refused_requests_total"
    assert _metric(after, name) == _metric(before, name)
