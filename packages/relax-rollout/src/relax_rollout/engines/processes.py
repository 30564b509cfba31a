"""The processes of the ``sglang`` engine: their command lines, their GPUs, their start on this node or on
another node of the Ray cluster, readiness, logs, and their end.

Why apart from :mod:`relax_rollout.engines.sglang`: an SGLang server is a process tree with its own CUDA
state (scheduler and detokenizer processes under the launched one), so ending one means ending its whole
process group, and a start that fails must say why from its log. None of that is about SGLang's API or
the pool; the engine composes it with them and decides what a crash means (restart, rejoin).

- **Here.** Engine ``k`` runs with ``CUDA_VISIBLE_DEVICES`` set to its GPUs, in its own session (process
  group), its stdout/stderr appended to its log. Ready means ``GET /health_generate`` answers 200: SGLang
  answers 503 while starting, then runs a one-token generation, so a 200 proves the scheduler serves. A
  process that exits during start-up fails the start at once with its log's tail.
- **Other nodes.** On a node where nothing of ours runs, a small Ray actor pinned to it
  (:class:`NodeLauncher`; node affinity, it reserves no CPU or GPU: in a colocated run the GPUs are the
  trainer's ranks', time-shared with the engines) starts, polls and stops the processes there, and the
  engine supervises them through a :class:`RemoteProcess`, which answers ``poll()`` and ``stop()`` as a
  local process does. The engine reaches such a server over HTTP at the node's address, so it binds that
  address and requires a token. Weights go through disk or a broadcast: the node must see the model and
  the weights directory at the same paths (a shared filesystem, as the model and the data already are).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from relax_core.net import HeldPorts, interface_of
from relax_rollout.engines.process_groups import log_tail, spawn, stop_processes
from relax_rollout.engines.wire import ServerError, http_json

logger = logging.getLogger(__name__)

# launch flags the engine sets itself; server_args may not override them
RESERVED_FLAGS = {
    "--model-path",
    "--model",
    "--host",
    "--port",
    "--tp-size",
    "--tensor-parallel-size",
    "--tp",
}


class EngineStartError(RuntimeError):
    """An engine process exited or did not become ready during start-up (the message has its log's tail)."""


# -- command lines -----------------------------------------------------------------------------------------
def flag_args(server_args: dict[str, Any]) -> list[str]:
    """``{"context_length": 32768, "enable_metrics": True}`` → ``--context-length 32768 --enable-metrics``:
    True is a bare flag, False/None leave it out, lists give several values, dicts are passed as JSON."""
    out: list[str] = []
    for key, value in server_args.items():
        flag = key if key.startswith("--") else "--" + key.replace("_", "-")
        if flag in RESERVED_FLAGS:
            raise ValueError(f"sglang_server_args may not set {flag}: the engine sets it (one per engine)")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif str(value).startswith("-"):  # (argparse reads "--api-key -x..." as a flag with no value)
            out.append(f"{flag}={value}")
        else:
            out += [flag, str(value)]
    return out


def launch_command(
    model_path: str,
    host: str,
    port: int,
    tp_size: int = 1,
    dtype: str = "auto",
    mem_fraction_static: float | None = None,
    server_args: dict[str, Any] | None = None,
    record_routing: bool = False,
    python: str | None = None,
) -> list[str]:
    """``python -m sglang.launch_server`` for one engine (flags of SGLang's ``server_args.py``)."""
    cmd = [
        python or sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
        "--dtype",
        dtype,
    ]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    extra = dict(server_args or {})
    if record_routing:
        extra.setdefault("enable_return_routed_experts", True)
    return cmd + flag_args(extra)


def fill_template(template: list[str], **values: Any) -> list[str]:
    """``launch_cmd`` with ``{port}``, ``{host}``, ``{model_path}``, ``{tp_size}``, ``{dtype}``,
    ``{engine_index}`` filled in."""
    try:
        return [str(part).format(**values) for part in template]
    except (KeyError, IndexError) as e:
        raise ValueError(f"launch_cmd has an unknown placeholder {e}; known: {sorted(values)}") from None


def server_command(*flags: str) -> list[str]:
    """A ``launch_cmd`` that runs our engine server (``python -m relax_rollout.server``) in SGLang's place,
    serving ``{model_path}`` on ``{port}``, ``flags`` after (e.g. ``--host {host} --token {token}`` on another
    node): what tests and benchmarks launch where they need a stand-in for SGLang."""
    serve = [sys.executable, "-m", "relax_rollout.server"]
    return [*serve, "--model", "{model_path}", "--port", "{port}", *flags]


# -- process groups ----------------------------------------------------------------------------------------
@dataclass
class EngineProcess:
    """One supervised engine slot: its GPUs stay the same across restarts."""

    index: int
    gpus: list[str]
    log_path: Path
    fixed_port: int | None = None
    proc: subprocess.Popen | RemoteProcess | None = None
    url: str | None = None
    member_id: str | None = None
    state: str = "starting"
    """starting, running, restarting, waiting (restarted, joins with the next weight update), failed,
    stopped"""
    restarts: int = 0
    error: str | None = None
    """Why it last failed (kept after a successful restart)."""
    pids: list[int] = field(default_factory=list)
    node: NodeGPUs | None = None
    """The :class:`NodeGPUs` of another node it runs on; None: this node."""

    API_FIELDS: ClassVar[tuple[str, ...]] = tuple(
        "index gpus url state restarts error member_id pids".split()
    )
    """The process as the API shows it (besides ``node_id``, ``pid`` and ``log_path``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: copy.copy(getattr(self, k)) for k in self.API_FIELDS},
            "node_id": self.node.node_id if self.node is not None else None,
            "pid": self.proc.pid if self.proc else None,
            "log_path": str(self.log_path),
        }


# -- other nodes -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeGPUs:
    """GPUs of one node for engines."""

    node_id: str | None
    """Ray node id; None: this process's node (engines started with ``Popen``)."""
    ip: str
    gpus: list[str]


def cluster_gpus(gpus_per_node: int, local_gpus: list[str]) -> list[NodeGPUs]:
    """This node (``local_gpus``, at most ``gpus_per_node``), then every other live node of the Ray
    cluster that has GPUs, in node-id order, with GPUs ``0 .. gpus_per_node-1`` (as Ray numbers them on a
    node started with ``ray start --num-gpus``)."""
    import ray

    if not ray.is_initialized():
        raise ValueError(
            "engines on several nodes need the run's Ray cluster (RAY_ADDRESS=<head>:6379 relax train ...); "
            "this process is not connected to one"
        )
    here = ray.get_runtime_context().get_node_id()
    out = [NodeGPUs(None, "127.0.0.1", list(local_gpus[:gpus_per_node]))]
    others = sorted(
        (n for n in ray.nodes() if n["Alive"] and n["NodeID"] != here and n["Resources"].get("GPU", 0) >= 1),
        key=lambda n: n["NodeID"],
    )
    for n in others:
        count = min(gpus_per_node, int(n["Resources"]["GPU"]))
        out.append(NodeGPUs(n["NodeID"], n["NodeManagerAddress"], [str(g) for g in range(count)]))
    return out


def place_engines(
    num_engines: int, tp_size: int, gpu_ids: list[int | str] | None, gpus_per_node: int | None
) -> list[tuple[NodeGPUs | None, list[str]]]:
    """(node or None for this one, GPUs) of every engine: node by node, ``tp_size`` GPUs each; ``gpu_ids``
    default ``CUDA_VISIBLE_DEVICES``, else ``0 ..``; ``gpus_per_node``: over the Ray cluster's nodes too."""
    need = num_engines * tp_size
    if gpu_ids is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None or not visible.strip():
            gpu_ids = list(range(need if gpus_per_node is None else gpus_per_node))
        else:
            gpu_ids = [g.strip() for g in visible.split(",") if g.strip()]
    gpus = [str(g) for g in gpu_ids]
    if gpus_per_node is None:
        if len(gpus) < need:
            raise ValueError(
                f"{num_engines} engines × {tp_size} GPUs need {need} GPUs; only {len(gpus)} "
                f"visible ({','.join(gpus)}): lower the engines, or spread them over a Ray cluster's nodes "
                "(gpus_per_node)"
            )
        return [(None, gpus[k * tp_size : (k + 1) * tp_size]) for k in range(num_engines)]
    nodes = cluster_gpus(gpus_per_node, gpus)
    places = [
        (None if n.node_id is None else n, n.gpus[i : i + tp_size])
        for n in nodes
        for i in range(0, len(n.gpus) - tp_size + 1, tp_size)
    ]
    if len(places) < num_engines:
        raise ValueError(
            f"{num_engines} engines × {tp_size} GPUs need {need} GPUs; the Ray cluster's "
            f"{len(nodes)} nodes give {len(places) * tp_size} ({gpus_per_node} per node at most, this "
            "node's visible ones): add nodes or lower the engines"
        )
    return places[:num_engines]


class NodeLauncher:
    """The Ray actor (one per node) that runs engine processes on its node (wrap with ``ray.remote``)."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen] = {}
        self._ports = HeldPorts()

    def ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def missing(self, paths: list[str]) -> list[str]:
        """Which of ``paths`` this node does not see."""
        return [p for p in paths if not os.path.exists(p)]

    def free_port(self, host: str) -> int:
        """A port free on this node, held until :meth:`release_port` (:class:`HeldPorts`)."""
        return self._ports.take(host)

    def release_port(self, port: int) -> None:
        self._ports.release(port)

    def start(
        self, cmd: list[str], env: dict[str, str], log_path: str, header: str, secret: str | None = None
    ) -> int:
        """Start ``cmd`` in its own session with ``env`` over this node's environment; its output appended to
        ``log_path`` (created here) after ``header``, ``secret`` written ``***``. Returns its pid."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        # an engine on another node joins the trainer's weight group: its gloo must bind this node's
        # address, not where the hostname resolves (often 127.0.0.1); the user's choice wins
        nic = {}
        if "GLOO_SOCKET_IFNAME" not in os.environ and (name := interface_of(self.ip())):
            nic = {"GLOO_SOCKET_IFNAME": name}
        proc = spawn(cmd, {**os.environ, **nic, **env}, log_path, header, secret)
        self._procs[proc.pid] = proc
        return proc.pid

    def poll(self, pid: int) -> int | None:
        return self._procs[pid].poll()

    def stop(self, pids: list[int], grace_s: float) -> None:
        stop_processes([self._procs[p] for p in pids if p in self._procs], grace_s)

    def environ(self, pid: int) -> dict[str, str]:
        """A live process's environment (what it was started with)."""
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)

    def tail(self, log_path: str, lines: int) -> str:
        return log_tail(Path(log_path), lines)


class RemoteProcess:
    """An engine process on another node, as the engine supervises a ``Popen``: ``pid``, ``poll()`` and
    ``stop(grace_s)``. A launcher that cannot be reached (its node is gone) counts as the process
    having exited (code -1), so the supervisor relaunches it; the relaunch then fails naming the node."""

    remote = True

    def __init__(self, launcher: Any, node: NodeGPUs, pid: int) -> None:
        self.launcher, self.node, self.pid = launcher, node, pid
        self._rc: int | None = None

    def poll(self) -> int | None:
        import ray

        if self._rc is None:
            try:
                self._rc = ray.get(self.launcher.poll.remote(self.pid), timeout=60)
            except Exception:  # noqa: BLE001 — the actor or its node died: so did the process
                self._rc = -1
        return self._rc

    def stop(self, grace_s: float) -> None:
        import ray

        try:
            ray.get(self.launcher.stop.remote([self.pid], grace_s), timeout=grace_s + 30)
        except Exception:  # noqa: BLE001 — nothing left to stop where the node is gone
            pass
        self._rc = self._rc if self._rc is not None else -1


def launcher_on(node: NodeGPUs) -> Any:
    """A :class:`NodeLauncher` actor pinned to ``node`` (no CPU or GPU reserved)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    assert node.node_id is not None, "a launcher runs on another node; this node's engines use Popen"
    cls = ray.remote(NodeLauncher).options(
        num_cpus=0, num_gpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
    )
    return cls.remote()


# -- one engine's processes --------------------------------------------------------------------------------
class Launcher:
    """Starts the processes of one engine's slots, here or through their node's :class:`NodeLauncher`,
    waits until each serves and reads their logs. ``command(slot, port, host)``: the command line;
    ``shared()``: the paths another node must see (model, weights directory); ``lock``, ``closed()`` and
    ``stopping``: the engine's (nothing starts once it is closed; a wait ends when it stops)."""

    def __init__(
        self,
        command: Callable[[EngineProcess, int, str], list[str]],
        host: str,
        env: dict[str, str],
        token: str | None,
        lock: threading.RLock,
        closed: Callable[[], bool],
        stopping: threading.Event,
        shared: Callable[[], list[str]],
    ) -> None:
        self.command, self.host, self.env, self.token = command, host, env, token
        self._lock, self._closed, self._stopping, self._shared = lock, closed, stopping, shared
        self.procs: list[subprocess.Popen | RemoteProcess] = []
        """Every process ever started (what the engine's finalizer stops)."""
        self.nodes: dict[str, Any] = {}
        """Node id → its :class:`NodeLauncher` actor."""
        self.spans_nodes = False
        """Some engines run on other nodes: the ones here join the weight group at this node's address."""
        self._ports = HeldPorts()
        self._held: dict[int, Callable[[], None]] = {}
        """Engine index → what releases the port held for its starting process (:class:`HeldPorts`)."""

    def launch(self, slot: EngineProcess) -> None:
        """Start ``slot``'s engine on its GPUs (a fresh port unless it has a fixed one)."""
        if slot.node is not None:
            self._launch_remote(slot)
            return
        port = slot.fixed_port
        if port is None:
            port = held = self._ports.take(self.host)
            self._hold(slot, lambda: self._ports.release(held))
        cmd = self.command(slot, port, self.host)
        env = {**os.environ, **self._nic(), **self.env, "CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)}
        with self._lock:
            if self._closed():
                self.release_port(slot)
                raise EngineStartError("the engine is closed")
            proc = spawn(cmd, env, slot.log_path, self._header(slot, cmd), self.token)
            self.procs.append(proc)
            connect = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
            slot.proc, slot.url, slot.member_id = proc, f"http://{connect}:{port}", None
            slot.pids.append(proc.pid)
        logger.info(
            "engine %d: started pid %d on GPUs %s, %s", slot.index, proc.pid, ",".join(slot.gpus), slot.url
        )

    def _nic(self) -> dict[str, str]:
        """An engine here whose weight group spans nodes: gloo bound to this node's address (SGLang's group
        code takes no address: gloo binds where the hostname resolves, often 127.0.0.1)."""
        if not self.spans_nodes or "GLOO_SOCKET_IFNAME" in os.environ:
            return {}
        import ray

        name = interface_of(ray.util.get_node_ip_address())
        return {"GLOO_SOCKET_IFNAME": name} if name else {}

    def _header(self, slot: EngineProcess, cmd: list[str]) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        where = f" on node {slot.node.node_id} ({slot.node.ip})" if slot.node is not None else ""
        shown = " ".join("***" if self.token and part == self.token else part for part in cmd)
        return (
            f"=== {stamp} relax: launch #{len(slot.pids) + 1} of engine {slot.index}{where} on GPUs "
            f"{','.join(slot.gpus)}: {shown}\n"
        )

    def _launch_remote(self, slot: EngineProcess) -> None:
        """:meth:`launch` on another node, through its :class:`NodeLauncher`."""
        import ray

        node = slot.node
        assert node is not None and node.node_id is not None, "launch() hands only other nodes' slots here"
        launcher = self.nodes.get(node.node_id)
        if launcher is None:
            launcher = self.nodes[node.node_id] = launcher_on(node)
        ip = ray.get(launcher.ip.remote(), timeout=120)
        missing = ray.get(launcher.missing.remote(self._shared()), timeout=60)
        if missing:
            raise EngineStartError(
                f"node {node.node_id} ({ip}) does not see {', '.join(missing)}: the model and the weights "
                "directory must be at the same paths on every node (a shared filesystem)"
            )
        port = slot.fixed_port
        if port is None:
            port = held = ray.get(launcher.free_port.remote(ip), timeout=60)
            self._hold(slot, lambda: launcher.release_port.remote(held))
        cmd = self.command(slot, port, ip)
        env = {**self.env, "CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)}
        with self._lock:
            if self._closed():
                self.release_port(slot)
                raise EngineStartError("the engine is closed")
            pid = ray.get(
                launcher.start.remote(cmd, env, str(slot.log_path), self._header(slot, cmd), self.token),
                timeout=120,
            )
            proc = RemoteProcess(launcher, node, pid)
            self.procs.append(proc)
            slot.proc, slot.url, slot.member_id = proc, f"http://{ip}:{port}", None
            slot.pids.append(pid)
        logger.info(
            "engine %d: started pid %d on node %s, GPUs %s, %s",
            slot.index,
            pid,
            node.node_id,
            ",".join(slot.gpus),
            slot.url,
        )

    def tail(self, slot: EngineProcess, lines: int = 30) -> str:
        """The end of an engine's log, read on its node."""
        node_id = slot.node.node_id if slot.node is not None else None
        launcher = self.nodes.get(node_id) if node_id is not None else None
        if launcher is None:
            return log_tail(slot.log_path, lines)
        import ray

        try:
            return ray.get(launcher.tail.remote(str(slot.log_path), lines), timeout=30)
        except Exception as e:  # noqa: BLE001 — a report, not a failure of its own
            return f"(no log from node {node_id}: {e})"

    def _hold(self, slot: EngineProcess, release: Callable[[], Any]) -> None:
        """Keep ``release`` of the port held for ``slot``'s new process (a previous one's is released)."""
        self.release_port(slot)
        self._held[slot.index] = release

    def release_port(self, slot: EngineProcess) -> None:
        """Stop holding the port of ``slot``'s starting process: it listens there, or it will not."""
        release = self._held.pop(slot.index, None)
        if release is not None:
            release()

    def wait_ready(self, slot: EngineProcess, timeout_s: float) -> None:
        """Until ``/health_generate`` answers 200 (``/health`` for a server without it); then, or on an
        error, the port held for it is released."""
        try:
            self._wait_ready(slot, timeout_s)
        finally:
            self.release_port(slot)

    def _wait_ready(self, slot: EngineProcess, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        path = "/health_generate"
        assert slot.proc is not None and slot.url is not None
        while True:
            if self._stopping.is_set():
                raise EngineStartError("the engine is closing")
            rc = slot.proc.poll()
            if rc is not None:
                raise EngineStartError(
                    f"process {slot.proc.pid} exited with code {rc} during start-up; the end of "
                    f"{slot.log_path}:\n{self.tail(slot)}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartError(
                    f"not ready after {timeout_s:.0f}s ({slot.url}{path}); the end of {slot.log_path}:\n"
                    f"{self.tail(slot)}"
                )
            try:
                http_json(slot.url, path, None, self.token, min(30.0, max(1.0, left)))
                return
            except ServerError as e:
                if e.status == 404 and path != "/health":
                    path = "/health"
                    continue
                if e.status < 500:
                    raise EngineStartError(f"{slot.url}{path} answered HTTP {e.status}: {e}") from None
            except OSError:  # not listening yet (refused), or the probe timed out
                pass
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    def release_nodes(self) -> None:
        """End the node launchers (after their processes were stopped)."""
        if self.nodes:
            import ray

            for launcher in self.nodes.values():
                try:
                    ray.kill(launcher)
                except Exception:  # noqa: BLE001 — Ray already down: the actor went with it
                    pass
