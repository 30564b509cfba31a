"""`relax ui`'s web server: the page and its JSON, over Starlette on uvicorn (the stack the engine server uses).

The page (``static/``: our own HTML, CSS and JavaScript, nothing fetched at run time) polls the JSON routes;
every route reads the run directory as it is at that moment (:class:`~relax_app.ui.data.RunView`), so the
same server shows a live run and a finished one. Bound to 127.0.0.1 by default; bound elsewhere it needs a
token, which the API routes then require (``Authorization: Bearer <token>`` or ``?token=``: the page passes
on the one in its own URL).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

from relax_app.ui.data import RunView, media_type

STATIC = Path(__file__).parent / "static"
PAGES = {"app.js": "text/javascript", "app.css": "text/css", "index.html": "text/html"}
"""The page's files (nothing else under ``static/`` is served)."""


def build_app(run_dir: str | Path, token: str | None = None) -> Any:
    """The ASGI app showing ``run_dir``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Route

    view = RunView(run_dir)

    def allowed(request: Request) -> bool:
        if token is None:
            return True
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        given = given or request.query_params.get("token", "")
        return hmac.compare_digest(given.encode(), token.encode())

    def api(fn: Any) -> Any:
        def endpoint(request: Request) -> Response:
            if not allowed(request):
                return JSONResponse(
                    {"error": "this run explorer needs its token (?token=...)"}, status_code=401
                )
            try:
                out = fn(request)
            except BadParam as e:
                return JSONResponse({"error": str(e)}, status_code=400)
            return out if isinstance(out, Response) else JSONResponse(out)

        return endpoint

    def page(request: Request) -> Response:
        name = request.path_params.get("name", "index.html")
        if name not in PAGES:
            return JSONResponse({"error": f"no page {name!r}"}, status_code=404)
        return FileResponse(STATIC / name, media_type=PAGES[name], headers={"Cache-Control": "no-store"})

    def media(request: Request) -> Response:
        path = view.media_file(request.path_params["row"], _int(request.path_params["k"], "k"))
        if path is None:
            return JSONResponse({"error": "no such media file of that sample"}, status_code=404)
        return FileResponse(path, media_type=media_type(path))

    routes = [
        Route("/", page),
        Route("/static/{name}", page),
        Route("/api/run", api(lambda r: view.overview())),
        Route("/api/metrics", api(lambda r: view.metrics(_int(r.query_params.get("after", "0"), "after")))),
        Route("/api/samples/{step}", api(lambda r: view.samples(_int(r.path_params["step"], "step")))),
        Route("/api/timeline", api(lambda r: view.timeline())),
        Route("/api/media/{row}/{k}", api(media)),
    ]
    return Starlette(routes=routes)


class BadParam(ValueError):
    """A request's parameter that is not what the route takes: a 400 naming it."""


def _int(v: str, name: str) -> int:
    if not (v.isascii() and v.isdigit()) or len(v) > 12:
        raise BadParam(f"{name} must be a non-negative integer (got {v[:40]!r})")
    return int(v)
