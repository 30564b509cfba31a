"""The routes that read and close recorded agent trajectories (``/relax/trajectories``): each takes
``(EngineServer, body, request)`` and returns ``(status, json)``; the recording itself is
:mod:`.trajectories`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_rollout.server.protocol import NotFound
from relax_rollout.server.trajectories import TrajectoryRecorder, parse_close, parse_index

if TYPE_CHECKING:
    from relax_rollout.http_api import Request
    from relax_rollout.server.state import EngineServer


def _recorder(s: EngineServer) -> TrajectoryRecorder:
    if s.recorder is None:
        raise NotFound("this server has no tokenizer, so it serves no chat and records no trajectories")
    return s.recorder


def trajectory_list(s: EngineServer, body: dict, req: Request):
    return 200, {"object": "list", "data": _recorder(s).sessions()}


def trajectory_get(s: EngineServer, body: dict, req: Request):
    return 200, _recorder(s).get(req.params["session"], parse_index(req.query))


def trajectory_close(s: EngineServer, body: dict, req: Request):
    return 200, _recorder(s).close(req.params["session"], parse_close(body))
