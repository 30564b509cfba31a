"""The rollout role's engines when they run as their own processes: a pool, its restarts, the elastic API.

Why here and not in the worker: the rollout worker only needs *an* engine. With ``--rollout-engines N``
(or ``--elastic-port``) that engine is an :class:`~relax_rollout.engines.pool.EnginePool` of HTTP engine
servers launched on the Ray cluster (``ray_native``) plus any ``--rollout-external-urls``; this module
builds it, restarts a crashed engine in place (its requests were already re-issued on the others by the
pool; the restarted one gets the current weights before serving), bounded by --max-restarts-per-role per
engine, and serves the elastic REST API so engines can be added or removed mid-run.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from relax_core.config import RelaxConfig

logger = logging.getLogger(__name__)


def uses_pool(cfg: RelaxConfig) -> bool:
    return cfg.rollout.rollout_engines > 0 or cfg.rollout.elastic_port is not None


class EngineService:
    """Owns the pool (``self.pool``, the rollout engine), engine restarts and the elastic server."""

    def __init__(self, cfg: RelaxConfig, model_path: str) -> None:
        from relax_core.net import alive_nodes
        from relax_rollout.engines.pool import EnginePool
        from relax_rollout.server.served import ray_launcher

        r = cfg.rollout
        if cfg.algo.routing_replay:
            raise ValueError(
                "--routing-replay records routing inside the in-process torch engine; it does not work with "
                "--rollout-engines / --elastic-port (engines in their own processes) yet"
            )
        if cfg.data.multimodal_keys:
            raise ValueError(
                "--multimodal-keys: engine servers take token ids only, so multimodal rollouts need the "
                "in-process engine (drop --rollout-engines / --elastic-port)"
            )
        self.cfg = cfg
        # --elastic-host node: the run spans nodes; its engines bind their own node's address (behind the
        # elastic token, which the pool sends) so a scale-out can put them on any node
        spans = r.elastic_port is not None and r.elastic_host == "node"
        token = r.elastic_token if spans else None
        launch, kill = ray_launcher(
            model_path, cfg.model.dtype, "torch", 1, token=token, host="node" if spans else "127.0.0.1"
        )
        self.events: list[dict[str, Any]] = []
        """Engine failures and restarts: {engine, reason, action, attempt, recovery_s, at}."""
        self._restarts: dict[str, int] = {}
        self._lineage: dict[str, str] = {}  # restarted engine id -> the start-up engine it replaces
        self._lock = threading.Lock()
        weights = Path(cfg.run.output_dir) / "engine_weights"
        external = r.rollout_external_urls if r.rollout_backend == "external" else []
        self.pool = EnginePool(
            external,
            token=token,
            launch=launch,
            kill=kill,
            on_failure=self._on_failure,
            weights_dir=str(weights),
        )
        if r.rollout_engines:  # start-up engines, launched concurrently; protected from scale-in
            self.pool.membership.start(r.rollout_engines)
        self.elastic_url: str | None = None
        self._httpd = None
        if r.elastic_port is not None:
            import ray

            from relax_rollout.elastic import ElasticService, make_elastic_server

            room = r.elastic_max_engines or int(ray.cluster_resources().get("CPU", 0)) or None
            self.elastic = ElasticService(
                self.pool,
                r.drain_timeout_s,
                max_engines=room,
                nodes=(lambda: sorted(alive_nodes())) if spans else None,
            )
            host = ray.util.get_node_ip_address() if spans else r.elastic_host
            self._httpd = make_elastic_server(self.elastic, host, r.elastic_port, r.elastic_token)
            host, port = self._httpd.server_address[:2]
            self.elastic_url = f"http://{host}:{port}"
            threading.Thread(target=self._httpd.serve_forever, name="relax-elastic", daemon=True).start()
            out = Path(cfg.run.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / "elastic.json").write_text(json.dumps({"url": self.elastic_url}))
            logger.info(
                "elastic rollout API on %s (OpenAPI: %s/elastic/openapi.json)", *[self.elastic_url] * 2
            )

    def _on_failure(self, member: Any) -> None:
        """Called by the pool (from a generating thread) when an engine fails: its requests were already
        re-issued; the health manager sees it in the next heartbeat and asks for :meth:`restart` (it
        supervises every process of the run, and bounds and reports restarts in one place)."""
        self.events.append(
            {
                "engine": member.id,
                "reason": member.error,
                "at": time.time(),
                "action": "dropped" if member.kind == "external" else "failed",
            }
        )

    def failed(self) -> list[dict[str, Any]]:
        """Engines this service launched that failed and wait for a restart: [{engine, reason}]."""
        return [
            {"engine": m["id"], "reason": m["error"]}
            for m in self.pool.membership.members()
            if m["state"] == "failed" and m["kind"] != "external"
        ]

    def restart(self, member_id: str) -> dict[str, Any]:
        """Replace a failed engine with a new process holding the current weights (bounded by
        --max-restarts-per-role per start-up engine); returns what happened."""
        with self._lock:
            root = self._lineage.get(member_id, member_id)
            n = self._restarts.get(root, 0) + 1
            self._restarts[root] = n
        ev = {"engine": member_id, "attempt": n, "at": time.time()}
        if n > self.cfg.run.max_restarts_per_role:
            self.pool.membership.get(member_id).state = "removed"  # not restarted again: stop asking
            ev["action"] = "given_up"
            self.events.append(ev)
            return ev
        t0 = time.perf_counter()
        new = self.pool.membership.restart(member_id)
        with self._lock:
            self._lineage[new.id] = root
        ev.update(action="restart", new_engine=new.id, recovery_s=time.perf_counter() - t0)
        self.events.append(ev)
        return ev

    def pids(self) -> dict[str, int]:
        """Process id of every active launched engine (fault-injection tests kill them)."""
        import ray

        active = [m for m in self.pool.membership.active() if m.handle is not None]
        return dict(zip([m.id for m in active], ray.get([m.handle.pid.remote() for m in active])))

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        self.pool.close(kill=True)
