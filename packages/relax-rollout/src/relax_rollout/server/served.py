"""Engines served over HTTP from a thread of this process, or from their own Ray actor process
(``ray_native`` members of the engine pool).

Why: an engine in its own process can crash without taking the rollout role down; the pool re-issues its
requests on the other engines and the health manager restarts it. Each engine is a Ray actor that builds a
rollout engine and serves it with our SGLang-compatible HTTP server (:class:`~relax_rollout.server.EngineServer`)
in a daemon thread; the pool then drives it over HTTP exactly like an external SGLang server. It lives here,
beside the server it runs, rather than under ``engines/``: an engine is what a server serves, not the other
way round, and the pool only sees the ``(launch, kill)`` pair.

- :class:`ServedEngine`: any engine served in a thread of this process (the building block; also what the
  tests use for real in-process servers). ``close(abrupt=True)`` drops the open connections as a dying
  process would.
- :class:`RayEngineServer`: the actor class (plain; the caller wraps it with ``ray.remote``).
- :func:`ray_launcher`: the ``(launch, kill)`` pair an :class:`~relax_rollout.engines.pool.EnginePool` takes.

Ray is imported lazily, only by the launcher.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from relax_rollout.engines.base import RolloutEngine, build_engine
from relax_rollout.server.app import make_server
from relax_rollout.server.state import MAX_QUEUED_REQUESTS, EngineServer

logger = logging.getLogger(__name__)


class ServedEngine:
    """Serve ``engine`` with :class:`~relax_rollout.server.EngineServer` on ``host:port`` (0: any free
    port) in a daemon thread of this process."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any = None,
        model_path: str = "",
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_queued_requests: int | None = MAX_QUEUED_REQUESTS,
    ) -> None:
        self.state = EngineServer(
            engine,
            tokenizer,
            model_path,
            model_path or "default",
            token,
            max_queued_requests=max_queued_requests,
        )
        self.httpd = make_server(self.state, host, port)
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, daemon=True, name="relax-engine-http"
        )
        self._thread.start()
        self.closed = False

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        if host in ("0.0.0.0", "::"):  # reachable by the node's address, not the wildcard
            host = _node_ip()
        return f"http://{host}:{port}"

    def close(self, abrupt: bool = False) -> None:
        """Stop serving. ``abrupt``: also reset every open connection, so in-flight requests fail on the
        client's side like those of a crashed engine process (their generation still finishes here)."""
        if self.closed:
            return
        self.closed = True
        self.httpd.shutdown(abrupt=abrupt)
        self.httpd.server_close()
        self.state.group.leave()


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 — outside Ray: this host's name
        return socket.gethostbyname(socket.gethostname())


class RayEngineServer:
    """One engine process: builds ``engine`` (a name of ``relax_rollout.engines.ENGINES``) on
    ``model_path`` with its tokenizer and serves it over HTTP. Wrap with ``ray.remote`` (see
    :func:`ray_launcher`); a non-loopback ``host`` needs ``token``; ``"node"``: this node's address."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        engine: str = "torch",
        torch_threads: int | None = 1,
        token: str | None = None,
        host: str = "127.0.0.1",
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        import torch
        from transformers import AutoTokenizer

        from relax_core.hf_files import check_servable

        check_servable(model_path, "engine model")  # (an empty tokenizer would serve garbage)
        if torch_threads:
            torch.set_num_threads(torch_threads)
        tok = AutoTokenizer.from_pretrained(model_path)
        eng = build_engine(
            engine,
            model_path=model_path,
            dtype=dtype,
            eos_token_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
            **(engine_kwargs or {}),
        )
        self._served = ServedEngine(eng, tok, model_path, token, _node_ip() if host == "node" else host, 0)

    def url(self) -> str:
        return self._served.url

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self._served.close()


def ray_launcher(
    model_path: str,
    dtype: str = "float32",
    engine: str = "torch",
    torch_threads: int | None = 1,
    num_cpus: float = 0.1,
    num_gpus: float = 0.0,
    token: str | None = None,
    host: str = "127.0.0.1",
    start_timeout_s: float = 600.0,
) -> tuple[Callable[..., tuple[str, Any]], Callable[[Any], None]]:
    """``(launch, kill)`` for :class:`~relax_rollout.engines.pool.EnginePool`: ``launch()`` starts one
    :class:`RayEngineServer` actor (call ``ray.init`` first) and returns ``(url, actor)`` once it serves;
    ``kill(actor)`` ends its process and returns once it is gone (``ray.kill`` is asynchronous: a call
    sent right after it could still be served, and the engine's GPU would not be free yet).

    Loopback engines (``host`` 127.0.0.1, the default) run on the launching process's node, the only one
    that reaches them. With ``host="node"`` each engine binds its own node's address (behind ``token``):
    ``launch(node)`` puts it on the node at that address (preferred: another node takes it when that one
    is gone, as for a restart after a node loss); ``launch()`` on the launching process's node, preferred."""

    def launch(node: str | None = None) -> tuple[str, Any]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from relax_core.net import alive_nodes

        if node is not None and host == "127.0.0.1":
            raise ValueError(
                f"engines bound to loopback cannot run on node {node}: the pool reaches them only from its "
                "own node (bind them to their node's address: host='node', with a token)"
            )
        target = ray.get_runtime_context().get_node_id()
        if node is not None:
            if node in (alive := alive_nodes()):
                target = alive[node]
            else:  # (a restart after its node was lost; a scale-out checked the node is alive)
                logger.warning("node %s is not alive: the engine is launched on the rollout's node", node)
        here = NodeAffinitySchedulingStrategy(target, soft=host != "127.0.0.1")
        cls = ray.remote(RayEngineServer).options(
            num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, scheduling_strategy=here
        )
        # (Any: Ray types a handle as ActorHandle | the class, its methods without .remote)
        actor: Any = cls.remote(model_path, dtype, engine, torch_threads, token, host)
        try:
            url = ray.get(actor.url.remote(), timeout=start_timeout_s)
        except Exception:
            ray.kill(actor, no_restart=True)
            raise
        return url, actor

    def kill(actor: Any, timeout_s: float = 30.0) -> None:
        import ray

        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(actor.pid.remote(), timeout=5.0)
            except ray.exceptions.RayActorError:
                return
            except ray.exceptions.GetTimeoutError:
                pass
            time.sleep(0.1)
        logger.warning("engine actor still answering %.0fs after ray.kill", timeout_s)

    return launch, kill
