"""SGLang engines on the other nodes of a Ray cluster: a launcher actor per node starts, polls and stops
the engine processes there.

Why: an SGLang server is a process tree with its own CUDA state, which :class:`~.sglang.SGLangEngine`
starts with ``Popen`` on the rollout's node. On another node nothing of ours runs, so a small Ray actor
pinned to that node (node affinity; it reserves no CPU or GPU: in a colocated run the GPUs are the
trainer's ranks', time-shared with the engines) does the same there, and the engine keeps supervising
through a :class:`RemoteProcess`, which answers ``poll()`` and ``stop()`` as a local process does. The
engine reaches the server over HTTP at the node's address, so a remote server binds that address and
requires a token. Weights go through disk: the remote node must see the rollout node's weights directory
at the same path (a shared filesystem, as the model and the data already are).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


class NodeLauncher:
    """The Ray actor (one per node) that runs engine processes on its node (wrap with ``ray.remote``)."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen] = {}

    def ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def missing(self, paths: list[str]) -> list[str]:
        """Which of ``paths`` this node does not see."""
        return [p for p in paths if not os.path.exists(p)]

    def free_port(self, host: str) -> int:
        from relax_rollout.engines.sglang import _free_port

        return _free_port(host)

    def start(self, cmd: list[str], env: dict[str, str], log_path: str, header: str) -> int:
        """Start ``cmd`` in its own session with ``env`` over this node's environment; its output appended to
        ``log_path`` (created here) after ``header``. Returns its pid."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        full = {**os.environ, **env}
        with open(log_path, "ab") as log:
            log.write(header.encode())
            log.flush()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=full, start_new_session=True)  # fmt: skip
        self._procs[proc.pid] = proc
        return proc.pid

    def poll(self, pid: int) -> int | None:
        return self._procs[pid].poll()

    def stop(self, pids: list[int], grace_s: float) -> None:
        from relax_rollout.engines.sglang import stop_processes

        stop_processes([self._procs[p] for p in pids if p in self._procs], grace_s)

    def environ(self, pid: int) -> dict[str, str]:
        """A live process's environment (what it was started with)."""
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)

    def tail(self, log_path: str, lines: int) -> str:
        from relax_rollout.engines.sglang import _log_tail

        return _log_tail(Path(log_path), lines)


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

    cls = ray.remote(NodeLauncher).options(
        num_cpus=0, num_gpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
    )
    return cls.remote()
