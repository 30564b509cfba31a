"""Several Ray nodes on one Linux machine, each in its own network namespace with its own IP (#40).

Why: ``ray.cluster_utils.Cluster`` starts several raylets that share one address, so nothing that binds
loopback, or reaches a peer through 127.0.0.1, is ever caught. Here each node is a namespace joined to a
bridge by a veth pair (``10.77.0.<k>/24``, the bridge ``10.77.0.254`` in the root namespace), and each node's
Ray is the real ``ray start`` run inside it (``ip netns exec``): the head in the first, the others joined to
its address. A process meant to run *on* a node (a run's driver) is started the same way. Killing a node is
killing every process in its namespace; cutting its network is taking its veth down.

Needs root (CI runs as root) and ``ip``; :func:`available` says whether this machine can.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BRIDGE = "relaxbr0"
SUBNET = "10.77.0"


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a test's skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = "relaxprobe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
    return out


@dataclass
class Node:
    """One namespace node: its name, address and the Ray it runs."""

    name: str
    ip: str
    index: int
    veth: str
    """The node's end of its veth pair (the bridge's end is ``<veth>h``)."""

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def pids(self) -> list[int]:
        """Every process in this node's namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill(self, timeout_s: float = 10.0) -> int:
        """SIGKILL every process of the node (its raylet, workers, servers), again until none is left (a
        process may have started another meanwhile); how many."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return len(killed)

    def link(self, up: bool) -> None:
        """Cut this node off the network (``up`` False) or bring it back."""
        _ip("link", "set", f"{self.veth}h", "up" if up else "down")


@dataclass
class NetnsCluster:
    """``n`` namespace nodes on a bridge, Ray started in each (the head on the first); a context manager
    that tears all of it down, processes included."""

    n: int = 3
    prefix: str = "relaxn"
    """Namespace names ``<prefix><k>``; clusters side by side need their own prefix, bridge and subnet."""
    bridge: str = BRIDGE
    subnet: str = SUBNET
    """The nodes are ``<subnet>.1`` .. ``<subnet>.<n>``, the bridge ``<subnet>.254``."""
    ray_args: dict[int, list[str]] = field(default_factory=dict)
    """Per node index: extra ``ray start`` arguments (``--num-cpus``, ``--resources``)."""
    start_ray: bool = True
    """Start Ray on the nodes (False: the namespaces and their bridge only, for what starts its own)."""
    temp_dir: str = ""
    """The head's Ray temp dir (default ``/tmp/<prefix>_ray``)."""
    nodes: list[Node] = field(default_factory=list)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:6379"

    def __enter__(self) -> NetnsCluster:
        self.temp_dir = self.temp_dir or f"/tmp/{self.prefix}_ray"
        try:
            self._network()
            if self.start_ray:
                self._ray()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _network(self) -> None:
        bridge, gateway = self.bridge, f"{self.subnet}.254"
        _ip("link", "del", bridge, check=False)
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{gateway}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for k in range(self.n):
            node = Node(f"{self.prefix}{k}", f"{self.subnet}.{k + 1}", k, f"{self.prefix[:8]}v{k}")
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)  # (a killed run's)
            _ip("link", "del", f"{node.veth}h", check=False)
            _ip("netns", "add", node.name)
            self.nodes.append(node)  # (from here on the teardown removes it)
            _ip("link", "add", f"{node.veth}h", "type", "veth", "peer", "name", node.veth)
            _ip("link", "set", node.veth, "netns", node.name)
            _ip("link", "set", f"{node.veth}h", "master", bridge)
            _ip("link", "set", f"{node.veth}h", "up")
            _ip("addr", "add", f"{node.ip}/24", "dev", node.veth, ns=node.name)
            _ip("link", "set", node.veth, "up", ns=node.name)
            _ip("link", "set", "lo", "up", ns=node.name)
            _ip("route", "add", "default", "via", gateway, ns=node.name)

    def ray_start(self, node: Node, timeout_s: float = 120.0) -> None:
        """``ray start`` on ``node``: the head, or a worker joined to the head's address."""
        ray = str(Path(sys.executable).with_name("ray"))
        base = [ray, "start", f"--node-ip-address={node.ip}", "--disable-usage-stats"]
        if node.index == 0:
            argv = [
                *base,
                "--head",
                "--port=6379",
                f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false",
            ]
        else:
            argv = [*base, f"--address={self.address}"]
        argv += self.ray_args.get(node.index, [])
        out = subprocess.run(
            node.exec_argv(argv), capture_output=True, text=True, timeout=timeout_s, env=self.env()
        )
        if out.returncode != 0:
            raise RuntimeError(f"ray start on {node.name} ({node.ip}) failed:\n{out.stdout}\n{out.stderr}")

    def env(self) -> dict[str, str]:
        """The environment of a process on a node: Ray's token authentication on (a head bound to a
        non-loopback address requires it of every node and driver; the token is ~/.ray/auth_token, one file
        for the namespaces of this machine). Without this machine's interface choices (``GLOO_SOCKET_IFNAME``,
        ``NCCL_SOCKET_IFNAME``): a node has interfaces of its own, and an ``eth0`` pinned here (by an
        earlier run in this process) does not exist there."""
        own = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        return {**{k: v for k, v in os.environ.items() if k not in own}, "RAY_AUTH_MODE": "token"}

    def _ray(self) -> None:
        ray = str(Path(sys.executable).with_name("ray"))  # (the token every node and driver presents)
        subprocess.run([ray, "get-auth-token", "--generate"], capture_output=True, timeout=60, check=True)
        for node in self.nodes:
            self.ray_start(node)
        self.wait_for_nodes(self.n)

    def alive_addresses(self) -> list[str]:
        """The addresses of the nodes the head's GCS counts alive, sorted (asked by a driver on the head)."""
        code = (
            "import ray; ray.init(address='auto', logging_level='ERROR'); "
            "print(','.join(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
        )
        out = subprocess.run(
            self.head.exec_argv([sys.executable, "-c", code]),
            capture_output=True,
            text=True,
            timeout=120,
            env=self.env(),
        )
        lines = out.stdout.strip().splitlines()
        return [a for a in lines[-1].split(",") if a] if out.returncode == 0 and lines else []

    def wait_for_nodes(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.alive_addresses()) >= n:
                return
            time.sleep(1.0)
        raise TimeoutError(f"the namespace cluster did not reach {n} alive nodes in {timeout_s:.0f} s")

    def __exit__(self, *exc) -> None:
        for node in reversed(self.nodes):
            node.kill()
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)
            _ip("link", "del", f"{node.veth}h", check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.nodes = []
