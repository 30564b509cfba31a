"""How DCS moves a version's bytes: a ``TCPStore`` plus a standalone process group, or buffers shared
with the processes of this machine.

Why apart from :mod:`relax_core.dcs`: the protocol there (versions, headers in the store,
acknowledgements, the shutdown handshake) is the same whichever way the buckets travel; what differs is
torch.distributed and CUDA plumbing, which lives here:

- :class:`Endpoint`: the rendezvous store and a gloo/NCCL group built from it, never ``torch.distributed``'s
  default group, so DCS coexists with a trainer's own FSDP or Megatron collectives (no group for ``ipc``).
  The device its buffers live on is fixed when it is made (:func:`resolve_device`): CUDA's current device
  is per thread, and the overlapped sender and the receiver thread are not the thread that chose the GPU.
- :class:`SharedBuckets` (``transport="ipc"``): bucket buffers other processes of this machine map instead
  of receiving a copy — CUDA IPC handles of device memory, or named POSIX shared memory on CPU.

torch is imported inside functions only: relax-core does not depend on torch at import time.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    import torch


def parse_tcp(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must look like 'tcp://HOST:PORT' (got {init_method!r})")
    return url.hostname, url.port


TRANSPORTS = ("broadcast", "ipc")


def resolve_device(backend: str, device: str | None = None) -> str:
    """The device DCS buffers live on: ``device`` when given, ``cpu`` for gloo, else ``cuda:<index>`` of
    the calling thread's current GPU. A bare ``cuda`` is never returned: another thread would read it as
    its own current device, GPU 0 by default, so every rank's background thread would land there."""
    if device is not None:
        if device.startswith("cuda") and ":" not in device:
            raise ValueError(
                f"give the GPU's index (cuda:N), not {device!r}: each thread has its own default"
            )
        return device
    if backend == "gloo":
        return "cpu"
    import torch

    return f"cuda:{torch.cuda.current_device()}"


class Endpoint:
    """Store + standalone process group shared by sender and receivers (no group for ``ipc``)."""

    def __init__(
        self,
        init_method: str,
        world_size: int,
        rank: int,
        backend: str,
        timeout_s: float,
        group_name: str,
        transport: str = "broadcast",
        device: str | None = None,
    ):
        if world_size < 2:
            raise ValueError(
                f"world_size must be ≥ 2: one sender plus at least one receiver (got {world_size})"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) (got {rank})")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl' (got {backend!r})")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {list(TRANSPORTS)} (got {transport!r})")
        self.transport = transport
        self.device = resolve_device(backend, device)
        """Where buffers are allocated: ``cpu`` (gloo), else one GPU by index, fixed when the endpoint is
        made — CUDA's current device is per thread, and the overlapped sender and the receiver thread are
        other threads than the one that chose the GPU."""
        self.host, self.port = parse_tcp(init_method)
        self.world_size, self.rank, self.backend = world_size, rank, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.group_name = group_name
        self.store: Any = None
        self.pg: Any = None
        self._root_store: torch.distributed.TCPStore | None = None
        """The TCP store under the prefix stores ``store`` and the group's, held until :meth:`close`."""

    def connect(self) -> None:
        import torch.distributed as dist

        if self.pg is not None:
            return
        store = dist.TCPStore(
            self.host, self.port, self.world_size, self.rank == 0, self.timeout, wait_for_workers=False
        )
        self.store = dist.PrefixStore(f"{self.group_name}/ctl/", store)
        self._root_store = store
        if self.transport == "ipc":  # the buffers are shared, not sent: no collective
            self.pg = False
            return
        pg_store = dist.PrefixStore(f"{self.group_name}/pg/", store)
        if self.backend == "gloo":  # (bound to the address the host is reached from: it may span nodes)
            from relax_core.net import gloo_options

            self.pg = dist.ProcessGroupGloo(
                pg_store, self.rank, self.world_size, gloo_options(self.host, self.timeout)
            )
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout  # third-party: ProcessGroupNCCL.Options has no public timeout
            self.pg = dist.ProcessGroupNCCL(pg_store, self.rank, self.world_size, opts)
        self._root_store = store

    def bcast(self, t: torch.Tensor) -> None:
        pg = self.pg
        if not pg:  # closed by another thread: the group is being re-formed
            raise RuntimeError("DCS: the group was closed during a broadcast (a member died)")
        pg.broadcast([t]).wait()

    def close(self) -> None:
        if self.pg and self.backend == "nccl":
            self.pg.shutdown()
        self.pg = self.store = self._root_store = None


def map_shm(name: str, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the POSIX shared-memory segment ``name`` (Linux: its /dev/shm file)."""
    import torch

    path = Path("/dev/shm") / name
    if not path.exists():
        raise RuntimeError(
            f"DCS transport='ipc': shared-memory segment {path} not found (the sender closed, or this "
            "platform has no /dev/shm: use transport='broadcast')"
        )
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


class SharedBuckets:
    """``transport="ipc"``: one buffer per bucket that other processes of this machine can map — device
    memory exported as a CUDA IPC handle, or a named POSIX shared-memory segment on CPU. The sender's are
    created (and re-created when the bucket sizes change); a receiver's are attached from the handles."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.sizes: list[int] = []
        self.bufs: list[torch.Tensor] = []
        self.handles: list[str] = []
        self._segments: list[Any] = []

    def create(self, sizes: list[int]) -> bool:
        """Buffers of these sizes; True when they are new (the handles must be sent again)."""
        import torch

        if sizes == self.sizes:
            return False
        self.free()
        self.sizes = list(sizes)
        for n in sizes:
            if self.device == "cpu":
                from multiprocessing.shared_memory import SharedMemory

                # a tracked segment (removed even if this process dies), mapped through its /dev/shm file
                seg = SharedMemory(create=True, size=max(n, 1))
                seg.close()
                self._segments.append(seg)
                self.bufs.append(map_shm(seg.name, n))
                self.handles.append(json.dumps({"shm": seg.name}))
            else:
                import base64
                import pickle

                from torch.multiprocessing.reductions import reduce_tensor

                buf = torch.empty(n, dtype=torch.uint8, device=self.device)
                self.bufs.append(buf)
                self.handles.append(
                    json.dumps({"cuda": base64.b64encode(pickle.dumps(reduce_tensor(buf))).decode()})
                )
        return True

    def attach(self, sizes: list[int], handles: list[str]) -> None:
        self.free()
        self.sizes = list(sizes)
        for n, handle in zip(sizes, handles):
            h = json.loads(handle)
            if "shm" in h:  # mapped straight from its file: not tracked, the sender owns the segment
                self.bufs.append(map_shm(h["shm"], n))
            else:
                import base64
                import pickle

                rebuild, args = pickle.loads(base64.b64decode(h["cuda"]))
                self.bufs.append(rebuild(*args))

    def free(self) -> None:
        self.bufs, self.handles, self.sizes = [], [], []  # a mapping goes with the last view of it
        for seg in self._segments:
            seg.unlink()
        self._segments = []
