"""Calls to a run's REST APIs as a client outside it makes them (the elastic API, an engine's metrics):
the status and the decoded JSON, errors included, so a test asserts the documented codes. Shared by the
one-node and the across-nodes elastic tests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def call(base: str, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """``method base+path`` with ``body`` as JSON (bytes as they are) and ``token`` as a bearer token;
    ``(status, decoded body)``, an HTTP error's too."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def scrape(url: str, token: str | None = None) -> dict[str, float]:
    """A Prometheus text page as ``{series: value}`` (comments dropped)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().splitlines()
    return {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln and not ln.startswith("#")
    }


def series(page: dict[str, float], name: str) -> float:
    """The sum of a metric's series over its labels."""
    return sum(v for k, v in page.items() if k.split("{")[0] == name)
