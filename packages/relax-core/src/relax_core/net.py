"""The address this process is reached at, for the groups it joins across nodes (#40).

Why: gloo binds where the machine's hostname resolves unless told otherwise, and on many machines (this
CI's, most containers) the hostname resolves to 127.0.0.1. A group whose members all sit on one node
works that way; across nodes every member then advertises 127.0.0.1 to the others and the first
collective never connects. So a member binds the local address its packets to the group's rendezvous
host leave from (:func:`route_address`): 127.0.0.1 when the host is loopback, as before; the node's own
address when the host is on another node.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datetime import timedelta

_SIOCGIFADDR = 0x8915
"""Linux ioctl: an interface's IPv4 address."""


def route_address(peer: str) -> str:
    """The local IPv4 address packets to ``peer`` (a host name or address) leave from. A UDP
    ``connect`` sends nothing: the kernel only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        address: str = s.getsockname()[0]
        return address


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (None if none here does)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # (no IPv4 address on it)
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def gloo_interface(peer: str) -> str | None:
    """The interface a gloo group with rendezvous host ``peer`` should bind: the one its route to ``peer``
    leaves from, when that is not loopback (a group on one machine works with gloo's own choice), and
    the launcher set none (``GLOO_SOCKET_IFNAME``). None: leave gloo's choice."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    address = route_address(peer)
    return None if address.startswith("127.") else interface_of(address)


_PINNED: list[str] = []
"""What :func:`pin_gloo_interface` set (so :func:`unpin_gloo_interface` takes back only that)."""


def pin_gloo_interface(peer: str) -> str | None:
    """For a process about to join a gloo group through ``torch.distributed.init_process_group`` with
    rendezvous host ``peer`` (e.g. megatron's ranks, MASTER_ADDR): set ``GLOO_SOCKET_IFNAME`` until
    :func:`unpin_gloo_interface` (megatron makes more groups later) to :func:`gloo_interface`. Returns
    what is set."""
    name = gloo_interface(peer)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        _PINNED.append(name)
    return os.environ.get("GLOO_SOCKET_IFNAME")


def unpin_gloo_interface() -> None:
    """Take back what :func:`pin_gloo_interface` set, when the group is gone: a process that leads more
    runs (a notebook, a test session) must not hand an interface of this machine to processes it starts
    elsewhere (another node's has other names)."""
    if _PINNED and os.environ.get("GLOO_SOCKET_IFNAME") == _PINNED[-1]:
        del os.environ["GLOO_SOCKET_IFNAME"]
    _PINNED.clear()


@contextmanager
def gloo_bound_to_route(peer: str) -> Iterator[None]:
    """While inside, gloo groups made through ``torch.distributed`` bind :func:`gloo_interface` of ``peer``
    (its helpers take no device; gloo reads ``GLOO_SOCKET_IFNAME`` when a group is made)."""
    name = gloo_interface(peer)
    if name is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def gloo_options(peer: str, timeout: timedelta) -> Any:
    """``ProcessGroupGloo`` options that bind the device to :func:`route_address` of ``peer`` (a group
    built directly, as DCS and the weight group to the engines build theirs). Typed ``Any``: torch's stubs
    name neither ``ProcessGroupGloo._Options`` nor the constructor that takes it."""
    import torch.distributed as dist

    # third-party: the documented constructor takes no device; torch's stubs lack _Options
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=route_address(peer))]
    opts._threads = 2
    return opts


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` (an address of this node; loopback for ``0.0.0.0``) at the time of
    asking, e.g. for ``init_method=f"tcp://{host}:{port}"`` bound at once. A port another process binds
    seconds later: :class:`HeldPorts`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class HeldPorts:
    """Free ports held for servers that bind them later (an engine process, seconds after its launch).

    Why: a port :func:`free_port` found is free only when asked. Between that and the server's bind, any
    ``bind(0)`` on the machine (a gloo pair, another server) may be handed it; CI saw an SGLang engine
    fail start-up so (its port taken, uvicorn exits 3) while its warm-up spoke to whatever held the port.
    A held port is bound, not listening, with ``SO_REUSEADDR``: no ``bind(0)`` or ``connect()`` gets it,
    while a server that sets ``SO_REUSEADDR`` (asyncio and uvicorn, ``http.server``, ours) binds and
    listens on it. :meth:`release` once the server listens (or gave up)."""

    def __init__(self) -> None:
        self._held: dict[int, socket.socket] = {}
        self._lock = threading.Lock()

    def take(self, host: str = "127.0.0.1") -> int:
        """A port free on ``host`` (loopback for ``0.0.0.0``), held until :meth:`release`."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        port: int = s.getsockname()[1]
        with self._lock:
            self._held[port] = s
        return port

    def release(self, port: int) -> None:
        """Stop holding ``port`` (nothing if it is not held)."""
        with self._lock:
            s = self._held.pop(port, None)
        if s is not None:
            s.close()


def alive_nodes(ray: Any = None) -> dict[str, str]:
    """The connected Ray cluster's alive nodes, address → node id (``ray``: the module, for callers that
    hold one; imported here otherwise; ``Any``: Ray's module API is dynamic)."""
    if ray is None:
        import ray
    return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def node_endpoint() -> tuple[str, int]:
    """(this node's address as Ray knows it, a port free on it): where a group this process hosts
    listens, reachable from the other nodes; loopback outside Ray."""
    try:
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except ImportError:
        host = "127.0.0.1"
    return host, free_port(host)
