"""The elastic rollout REST API: add and remove engines of an :class:`~relax_rollout.engines.pool.EnginePool`
while a run goes on.

Why: rollout throughput should follow the cluster — grow when GPUs free up, shrink when they are needed
elsewhere — without stopping training. Scaling takes time (an engine starts, loads the current weights;
another drains its requests), so every change is an asynchronous *operation* with an id and a status
record, one at a time, idempotent by ``request_id`` and cancellable with rollback.

Operations (JSON bodies; unknown fields are refused):

- ``POST /elastic/scale_out`` — ``{"num_replicas": N}``: launch ``ray_native`` engines (through the
  pool's launcher) until N engines are active; or ``{"engine_urls": [...]}``: join running
  SGLang-compatible servers (each must answer ``/health`` and ``/get_model_info``; the op fails and
  removes what it added otherwise). A new engine receives the current weights before it serves.
- ``POST /elastic/scale_in`` — ``{"num_replicas": N}`` (target; victims newest first among non-protected
  engines), ``{"engine_ids": [...]}`` or ``{"engine_urls": [...]}``; optional ``drain_timeout_s`` (how long
  in-flight requests may finish; then, with ``force`` (default true), they are aborted and re-issued on
  the remaining engines). Start-up engines are protected and never removed; the last engine neither.
- Both take an optional ``request_id``: the same id returns the same operation (200) instead of starting
  a new one (202); the same id with a different request is a 409.
- ``GET /elastic/operations``, ``GET /elastic/operations/{id}``,
  ``POST /elastic/operations/{id}/cancel`` (rolls back: a scale-out's engines are removed; a scale-in's
  draining engines become active again, removed ones are re-launched or re-added; 200 once cancelled,
  202 while the rollback runs, 409 for a finished operation), ``GET /elastic/engines``,
  ``GET /elastic/openapi.json`` (OpenAPI 3.1, generated from the request models in
  :mod:`relax_rollout.elastic_api`), ``GET /elastic/metrics`` (Prometheus: engines by state,
  prompts in flight per engine, the pool's counters, operations by kind and state and their durations;
  each engine serves its own ``/metrics``). An operation that fails half-way is rolled back the same
  way (all or nothing), with the reason in ``error``.

Status codes: 200/202 as above; 400 a body that is not a JSON object, an unknown field, a wrong type or a
request the pool cannot honour (the error's ``param`` names the field); 401 without the bearer token
(when one is set); 404 an unknown route or operation; 409 another operation is pending or running.
Error bodies have SGLang's shape ``{"object": "error", "message", "type", "param", "code"}``.

Security: binds 127.0.0.1 by default; any other host needs a token, and with a token every route needs
``Authorization: Bearer <token>``.

This module is the HTTP face only; the operations themselves (validation, running, rollback) are
:mod:`relax_rollout.elastic_service`'s :class:`ElasticService`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import unquote

from relax_rollout import http_api
from relax_rollout.elastic_api import openapi
from relax_rollout.elastic_service import TERMINAL, Conflict, ElasticService
from relax_rollout.engines.pool_members import STATES
from relax_rollout.http_api import check_bind
from relax_rollout.server.protocol import BadRequest, NotFound, error_body


# -- HTTP ----------------------------------------------------------------------------------------------
def _scale_out(svc: ElasticService, body: Any, _: dict):
    op, created = svc.scale_out(body)
    return (202 if created else 200), op.to_dict()


def _scale_in(svc: ElasticService, body: Any, _: dict):
    op, created = svc.scale_in(body)
    return (202 if created else 200), op.to_dict()


def _list_ops(svc: ElasticService, body: Any, _: dict):
    return 200, {"object": "list", "data": svc.operations()}


def _get_op(svc: ElasticService, body: Any, params: dict):
    return 200, svc.operation(params["id"]).to_dict()


def _cancel_op(svc: ElasticService, body: Any, params: dict):
    op = svc.cancel(params["id"])
    return (200 if op.state in TERMINAL else 202), op.to_dict()


def _engines(svc: ElasticService, body: Any, params: dict):
    everything = params.get("include_removed", "").lower() in ("1", "true", "yes")
    data = svc.engines(everything)
    return 200, {
        "object": "list",
        "data": data,
        "active": sum(m["state"] == "active" for m in data),
        "weight_version": svc.pool.weight_version,
        "stats": svc.pool.stats(),
    }


def _metrics(svc: ElasticService, body: Any, _: dict):
    return 200, http_api.Text(render_metrics(svc), "text/plain; version=0.0.4; charset=utf-8")


def render_metrics(svc: ElasticService) -> str:
    """The pool and its operations in Prometheus' text format (``GET /elastic/metrics``), beside each
    engine's own ``/metrics``: engines by state, prompts in flight per engine, the pool's counters,
    operations by kind and state and their seconds from start to finish (what an autoscaler watches)."""
    stats, members, ops = svc.pool.stats(), svc.engines(), svc.operations()
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP relax:{name} {help_}", f"# TYPE relax:{name} {kind}"])
        lines.extend(
            f"relax:{name}{{{labels}}} {value}" if labels else f"relax:{name} {value}"
            for labels, value in samples
        )

    metric(
        "elastic_engines",
        "gauge",
        "Engines in the pool by state.",
        [(f'state="{s}"', stats[f"engines_{s}"]) for s in STATES],
    )
    metric(
        "elastic_engine_inflight",
        "gauge",
        "Prompts in flight on each engine.",
        [(f'engine="{m["id"]}",kind="{m["kind"]}"', m["inflight"]) for m in members],
    )
    for key, help_ in (
        ("requests", "Requests sent to engines."),
        ("prompts", "Prompts generated."),
        ("reissued_prompts", "Prompts re-sent after their engine failed or drained."),
        ("failures", "Engines marked failed."),
    ):
        metric(f"elastic_{key}_total", "counter", help_, [("", stats[key])])
    metric(
        "elastic_weight_version",
        "gauge",
        "The policy version the pool's engines serve.",
        [("", stats["weight_version"])],
    )
    counts: dict[tuple[str, str], int] = {}
    for op in ops:
        counts[op["kind"], op["state"]] = counts.get((op["kind"], op["state"]), 0) + 1
    metric(
        "elastic_operations_total",
        "counter",
        "Scaling operations by kind and state.",
        [(f'kind="{k}",state="{st}"', n) for (k, st), n in sorted(counts.items())],
    )
    done = [op for op in ops if op["started"] is not None and op["finished"] is not None]
    for kind in ("scale_out", "scale_in"):
        secs = [op["finished"] - op["started"] for op in done if op["kind"] == kind]
        lines.extend(
            [
                f"# TYPE relax:elastic_operation_seconds_{kind} summary",
                f"relax:elastic_operation_seconds_{kind}_sum {sum(secs):.6f}",
                f"relax:elastic_operation_seconds_{kind}_count {len(secs)}",
            ]
        )
    return "\n".join(lines) + "\n"


def _openapi(svc: ElasticService, body: Any, _: dict):
    return 200, openapi()


ROUTES: list[tuple[str, str, Callable]] = [
    ("POST", "/elastic/scale_out", _scale_out),
    ("POST", "/elastic/scale_in", _scale_in),
    ("GET", "/elastic/operations", _list_ops),
    ("GET", "/elastic/operations/{id}", _get_op),
    ("POST", "/elastic/operations/{id}/cancel", _cancel_op),
    ("GET", "/elastic/engines", _engines),
    ("GET", "/elastic/openapi.json", _openapi),
    ("GET", "/elastic/metrics", _metrics),
]


def _pattern(template: str) -> re.Pattern:
    """``/a/{id}/b`` → a regex with a named group per ``{name}`` (one path segment each)."""
    parts = re.split(r"\{(\w+)\}", template)  # literal, name, literal, ...
    return re.compile("".join(re.escape(x) if i % 2 == 0 else f"(?P<{x}>[^/]+)" for i, x in enumerate(parts)))


_PATTERNS = [(m, _pattern(p), fn) for m, p, fn in ROUTES]


def _route(method: str, path: str) -> tuple[Callable | None, dict[str, str]]:
    for m, pattern, fn in _PATTERNS:
        hit = pattern.fullmatch(path) if m == method else None
        if hit:
            return fn, {k: unquote(v) for k, v in hit.groupdict().items()}
    return None, {}


def make_elastic_server(
    service: ElasticService, host: str = "127.0.0.1", port: int = 0, token: str | None = None
) -> http_api.Served:
    """Bind the elastic API (port 0: any free port); call ``serve_forever`` (e.g. in a daemon thread), stop
    with ``shutdown()``. A non-loopback ``host`` needs ``token``, which then guards every route."""
    check_bind(host, token, "elastic API (--elastic-host / --elastic-token; scaling changes the run)")

    def resolve(method: str, path: str):
        fn, params = _route(method, path)
        if fn is None:
            return None, {}
        # query parameters join the path's (``include_removed``)
        return (lambda body, req: fn(service, body, {**req.query, **params})), params

    api = http_api.JsonApi(
        "elastic API",
        resolve,
        partial(error_body, own=(Conflict,)),
        errors=[(BadRequest, 400), (NotFound, 404), (Conflict, 409)],
        token=token,
        not_found=lambda m, p: f"no route {m} {p}; GET /elastic/openapi.json lists them",
    )
    return http_api.Served(api, host, port, backlog=64)
