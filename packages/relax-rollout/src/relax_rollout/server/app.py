"""The engine server's table of routes and its HTTP server.

The routes live by the API they belong to — SGLang's native one (:mod:`.sglang_routes`), its extras
(:mod:`.extra_routes`), OpenAI's (:mod:`.openai_routes`) and the agent trajectories
(:mod:`.trajectory_routes`) — and call the server's state
(:class:`~relax_rollout.server.state.EngineServer`), which knows no HTTP, so that it stays unit-testable;
``ROUTES`` / ``REQUEST_ROUTES`` here are the one place a path is mapped to its route.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from relax_rollout import http_api
from relax_rollout.engines.base import MemoryReleased
from relax_rollout.http_api import check_bind
from relax_rollout.server import (
    extra_routes,
    messages_routes,
    openai_routes,
    responses_routes,
    sglang_routes,
    trajectory_routes,
)
from relax_rollout.server.protocol import BadRequest, NotFound, error_body
from relax_rollout.server.state import EngineServer

CONTROL_PATHS = {
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_tensor",
}
GENERATE_ROUTES = {
    ("POST", "/generate"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/responses"),
}
"""The routes that generate: admission control (``max_queued_requests``) bounds them; every other route
(health, metrics, model info, weights, pause) is never refused by it."""
# Relax endpoints (recorded agent trajectories: other agents' conversations, and closing ends a trajectory)
# need the token too; generation, health and model info stay open.
CONTROL_PREFIXES = ("/relax/",)


# -- routes: (state, body) -> (status, json) ----------------------------------------------------------
ROUTES = {
    ("GET", "/health"): sglang_routes.health,
    ("GET", "/health_generate"): sglang_routes.health,
    ("GET", "/get_model_info"): sglang_routes.model_info,
    ("GET", "/model_info"): sglang_routes.model_info,
    ("GET", "/get_weight_version"): sglang_routes.weight_version,
    ("GET", "/weights_checksum"): sglang_routes.checksum,
    ("POST", "/generate"): sglang_routes.generate,
    ("POST", "/update_weights_from_disk"): sglang_routes.update_from_disk,
    ("POST", "/init_weights_update_group"): sglang_routes.init_group,
    ("POST", "/update_weights_from_distributed"): sglang_routes.update_from_distributed,
    ("POST", "/destroy_weights_update_group"): sglang_routes.destroy_group,
    ("POST", "/begin_weight_update"): sglang_routes.begin_update,
    ("POST", "/end_weight_update"): sglang_routes.end_update,
    ("POST", "/update_weights_from_tensor"): sglang_routes.update_from_tensor,
    ("POST", "/pause_generation"): sglang_routes.pause,
    ("POST", "/continue_generation"): sglang_routes.continue_generation,
    ("POST", "/abort_request"): sglang_routes.abort,
    ("POST", "/release_memory_occupation"): sglang_routes.release_memory,
    ("POST", "/resume_memory_occupation"): sglang_routes.resume_memory,
    ("GET", "/v1/models"): openai_routes.models,
    ("POST", "/v1/completions"): openai_routes.completions,
    ("POST", "/tokenize"): extra_routes.tokenize,
    ("POST", "/v1/tokenize"): extra_routes.tokenize,
    ("POST", "/detokenize"): extra_routes.detokenize,
    ("POST", "/v1/detokenize"): extra_routes.detokenize,
    ("GET", "/server_info"): extra_routes.server_info,
    ("GET", "/get_server_info"): extra_routes.server_info,  # (SGLang's older name, still served by it)
    ("GET", "/flush_cache"): extra_routes.flush_cache,
    ("POST", "/flush_cache"): extra_routes.flush_cache,
}
# Routes that also read headers, path or query parameters: (method, full-match pattern, route(s, body, req)).
REQUEST_ROUTES = [
    ("POST", re.compile(r"/v1/chat/completions"), openai_routes.chat_completions),
    ("POST", re.compile(r"/v1/messages"), messages_routes.messages),  # (Anthropic's Messages API)
    ("POST", re.compile(r"/v1/responses"), responses_routes.responses),  # (OpenAI's Responses API)
    ("GET", re.compile(r"/metrics"), extra_routes.metrics),  # (reads Accept: OpenMetrics or text 0.0.4)
    ("GET", re.compile(r"/relax/trajectories"), trajectory_routes.trajectory_list),
    ("GET", re.compile(r"/relax/trajectories/(?P<session>[^/]+)"), trajectory_routes.trajectory_get),
    ("POST", re.compile(r"/relax/trajectories/(?P<session>[^/]+)/close"), trajectory_routes.trajectory_close),
]


def _match(method: str, path: str) -> tuple[Any, dict[str, str] | None]:
    """(route, None) for a plain route, (route, path parameters) for a request route, (None, None)."""
    route = ROUTES.get((method, path))
    if route is not None:
        return route, None
    for m, pattern, fn in REQUEST_ROUTES:
        hit = pattern.fullmatch(path) if m == method else None
        if hit:
            return fn, {k: unquote(v) for k, v in hit.groupdict().items()}
    return None, None


def make_server(state: EngineServer, host: str = "127.0.0.1", port: int = 0) -> http_api.Served:
    """Bind (port 0 = any free port); a non-loopback host needs ``state.token``. Serve with
    ``serve_forever()`` (in a thread, or the main thread), stop with ``shutdown()``."""
    check_bind(host, state.token, "engine server (--host / --token)")

    def resolve(method: str, path: str):
        route, params = _match(method, path)
        if route is None:
            return None, {}
        if params is None:
            return (lambda body, req: route(state, body)), {}
        return (lambda body, req: route(state, body, req)), params

    api = http_api.JsonApi(
        "engine server",
        resolve,
        error_body,
        errors=[
            (BadRequest, 400),
            (NotFound, 404),
            (TimeoutError, 504),
            # colocate: the trainer holds the device; try again after the step
            (MemoryReleased, 503),
        ],
        token=state.token,
        protected=lambda path: path in CONTROL_PATHS or path.startswith(CONTROL_PREFIXES),
        admitted=lambda method, path: (method, path) in GENERATE_ROUTES,
        max_admitted=state.max_queued_requests,
        limit_name="--max-queued-requests",
        on_refused=lambda method, path: state.metrics.refuse(),
    )
    return http_api.Served(api, host, port)
