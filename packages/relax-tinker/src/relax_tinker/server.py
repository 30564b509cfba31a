"""The Tinker REST API over :class:`~relax_tinker.service.TinkerService` (Starlette, served by uvicorn as
our engine server is).

Long calls answer a future (``{"request_id"}``) at once; ``POST /api/v1/retrieve_future`` holds each poll
open until the result is ready or :data:`POLL_S` passed (then 408 with ``try_again``, the SDK's "still
pending": it polls again at once). A result is JSON, or protobuf for ``forward_backward`` and ``asample``;
an error is ``{"error", "category"}`` (``user``: the request cannot be done as asked; ``server``: it failed
here). Routes the SDK has and this server does not serve answer 404 with the SDK's error body naming the
route and why (:data:`NOT_SERVED`). With ``token`` every request needs it as its ``X-API-Key`` (the SDK
sends ``TINKER_API_KEY``); without, the server binds loopback only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from relax_tinker.checkpoints import UserError
from relax_tinker.service import TinkerService
from relax_tinker.wire import PROTO_TYPE, decode_forward_backward

logger = logging.getLogger(__name__)
POLL_S = 20.0
"""How long one ``retrieve_future`` poll waits for its result (the SDK's poll times out at 45 s)."""
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
NOT_SERVED = {
    "save_weights_external": "weights are kept on this machine, under the server's --root",
    "copy_weights": "checkpoints are not copied between training runs here",
    "create_custom_loss": "server-side custom losses: forward_backward_custom computes them on the client",
    "join_sampling_session": "not needed: sampling sessions are not shared between processes here",
    "retrieve_futures": "futures are retrieved one by one (sample_use_retrieve_futures is off)",
    "cancel_future": "sample cancelling is off (sample_cancel_enabled false)",
    "auth/token": "no JWT exchange: the API key is the token (pjwt_auth_enabled false)",
    "weights_info": "not served yet",
    "checkpoints": "list checkpoints per training run: GET /api/v1/training_runs/{id}/checkpoints",
    "sessions": "session listing is not served",
    "billing": "there is no billing here",
    "audit": "there is no audit log here",
}
"""The SDK's routes this server does not serve, each with why (the README's compatibility table)."""


def _error(message: str, category: str = "user", status: int = 200) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message, "category": category}, status_code=status)


def build_app(service: TinkerService, token: str | None = None) -> Any:
    """The ASGI app of the API."""
    from starlette.applications import Starlette

    routes = [*_session_routes(service), *_training_routes(service), *_sampling_routes(service)]
    routes.append(("/api/v1/{rest:path}", _not_served, ("GET", "POST", "PUT", "DELETE")))  # (last: the rest)
    guarded = [_guard(path, fn, methods, token) for path, fn, methods in routes]
    return Starlette(routes=guarded)


Handler = Callable[[Any], Awaitable[Any]]
"""A route's work: the request → its JSON (a dict) or a response."""
_GET, _POST = ("GET",), ("POST",)


def _guard(path: str, fn: Handler, methods: tuple[str, ...], token: str | None) -> Any:
    """The route ``path``: its token check, and a refused request's error body."""
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def handler(request: Any) -> Any:
        if token is not None and not hmac.compare_digest(request.headers.get("x-api-key", ""), token):
            return JSONResponse({"error": "a valid X-API-Key is required", "category": "user"}, 401)
        try:
            out = await fn(request)
        except (UserError, KeyError, ValueError) as e:
            return JSONResponse({"error": f"{path}: {e}", "category": "user"}, 400)
        return out if isinstance(out, Response) else JSONResponse(out)

    return Route(path, handler, methods=list(methods))


async def _body(request: Any) -> dict[str, Any]:
    raw = await request.body()
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise UserError(f"the body is not JSON ({e})") from e


async def _not_served(request: Any) -> Any:
    path = request.path_params["rest"]
    reason = next(
        (why for key, why in NOT_SERVED.items() if path.startswith(key)), "not a route of this server"
    )
    return _error(f"/api/v1/{path} is not served by relax-tinker: {reason}", status=404)


def _const(value: Any) -> Handler:
    async def answer(request: Any) -> Any:
        return value

    return answer


def _future(start: Callable[[dict[str, Any]], str]) -> Handler:
    """A route that starts a long call and answers its request id."""

    async def submit(request: Any) -> dict[str, Any]:
        return {"request_id": await asyncio.to_thread(start, await _body(request))}

    return submit


def _session_routes(service: TinkerService) -> list[tuple[str, Handler, tuple[str, ...]]]:
    async def create_session(request: Any) -> dict[str, Any]:
        return {"session_id": service.create_session(await _body(request))}

    async def heartbeat(request: Any) -> dict[str, Any]:
        service.heartbeat((await _body(request))["session_id"])
        return {"type": "session_heartbeat"}

    async def capabilities(request: Any) -> dict[str, Any]:
        names = sorted(service.names)
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True} for n in names]}

    return [
        ("/api/v1/client/config", _const(CLIENT_CONFIG), _POST),
        ("/api/v1/client/dynamic_config", _const({"refresh_interval_sec": 300}), _POST),
        ("/api/v1/healthz", _const({"status": "ok"}), _GET),
        ("/api/v1/get_server_capabilities", capabilities, _GET),
        ("/api/v1/create_session", create_session, _POST),
        ("/api/v1/session_heartbeat", heartbeat, _POST),
        ("/api/v1/sessions/{sid}/finish", _const({}), _POST),
        ("/api/v1/telemetry", _const({"status": "accepted"}), _POST),
        ("/api/v1/retrieve_future", lambda r: _retrieve(service, r), _POST),
    ]


def _training_routes(service: TinkerService) -> list[tuple[str, Handler, tuple[str, ...]]]:
    async def info(request: Any) -> dict[str, Any]:
        return service.info((await _body(request))["model_id"])

    async def forward_backward(request: Any) -> dict[str, Any]:
        call = decode_forward_backward(await request.body())
        return {"request_id": service.forward_backward(call), "model_id": call.model_id}

    async def runs(request: Any) -> dict[str, Any]:
        found = [service.training_run(m) for m in service.models]
        return {
            "training_runs": found,
            "cursor": {"offset": 0, "limit": len(found), "total_count": len(found)},
        }

    async def run(request: Any) -> dict[str, Any]:
        return service.training_run(request.path_params["rid"])

    async def checkpoints(request: Any) -> dict[str, Any]:
        return {"checkpoints": service.checkpoints(request.path_params["rid"])}

    return [
        ("/api/v1/create_model", _future(service.create_model), _POST),
        ("/api/v1/get_info", info, _POST),
        ("/api/v1/forward_backward", forward_backward, _POST),
        ("/api/v1/optim_step", _future(service.optim_step), _POST),
        ("/api/v1/save_weights", _future(service.save_weights), _POST),
        ("/api/v1/save_weights_for_sampler", _future(service.save_for_sampler), _POST),
        ("/api/v1/load_weights", _future(service.load_weights), _POST),
        ("/api/v1/training_runs", runs, _GET),
        ("/api/v1/training_runs/{rid}", run, _GET),
        ("/api/v1/training_runs/{rid}/checkpoints", checkpoints, _GET),
    ]


def _sampling_routes(service: TinkerService) -> list[tuple[str, Handler, tuple[str, ...]]]:
    async def create(request: Any) -> dict[str, Any]:
        return {"sampling_session_id": service.create_sampling_session(await _body(request))}

    async def sampler(request: Any) -> dict[str, Any]:
        snap = service.sampling.describe(request.path_params["sid"])
        return {"sampler_id": snap.session_id, "base_model": snap.base_model, "model_path": snap.model_path}

    async def asample(request: Any) -> dict[str, Any]:
        rid, ids = service.sampling.sample(await _body(request))
        return {"request_id": rid, "sample_sequence_ids": ids}

    return [
        ("/api/v1/create_sampling_session", create, _POST),
        ("/api/v1/samplers/{sid:path}", sampler, _GET),
        ("/api/v1/asample", asample, _POST),
    ]


async def _retrieve(service: TinkerService, request: Any) -> Any:
    """One poll: the result (JSON, or protobuf for forward_backward and asample), its error, or 408 with
    ``try_again`` after :data:`POLL_S`."""
    from starlette.responses import JSONResponse, Response

    rid = (await _body(request))["request_id"]
    fut = service.futures.get(rid)
    if fut is None:
        return _error(f"unknown request_id {rid!r} (expired or never made)", status=404)
    try:
        result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), POLL_S)
    except TimeoutError:
        return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"}, 408)
    except (UserError, KeyError, ValueError) as e:
        return _error(str(e), "user")
    except Exception as e:  # noqa: BLE001 - the call failed here: the client gets it, the server serves on
        logger.exception("request %s failed", rid)
        return _error(f"{type(e).__name__}: {e}", "server")
    if isinstance(result, bytes):
        return Response(result, media_type=PROTO_TYPE)
    return JSONResponse(result)
