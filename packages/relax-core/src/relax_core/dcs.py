"""DCS weight sync: the trainer publishes its weights to rollout engines and other roles after every step.

Why it looks like this:

- **Versioned.** Every publication carries the policy version (the trainer step). An engine records the
  version it generated a sample with, so the bus can enforce ``max_staleness`` and the loss can correct
  for off-policy samples. Versions must strictly increase; receivers see them in order.
- **Bucketed.** Parameters are packed into flat buffers of at most ``bucket_bytes`` (one tensor larger
  than that gets a bucket of its own), so sending a 70B model never needs a second full copy in memory,
  and each bucket is one collective instead of one per parameter. Buckets hold a single dtype, so every
  tensor sits at an aligned offset and is recovered as a zero-copy view of the bucket; on the wire a
  bucket is raw bytes (``uint8``), which every backend supports (gloo lacks some dtypes).
- **Control plane in the store, data plane in the collective.** Waiting for the next version takes a
  whole training step, which has no upper bound, so it must not sit inside a collective with a timeout.
  The sender writes a small JSON header (version, number of buckets, and the parameter layout when it
  changed, i.e. on the first call) to the rendezvous ``TCPStore``; receivers poll for it, then join the
  bucket broadcasts, which therefore only wait for a transfer. ``close()`` publishes a shutdown header
  (version -1) and waits for receivers to acknowledge it before tearing the store down.
- **Or shared memory, when colocated** (``transport="ipc"``): every receiver on the sender's machine (the
  same GPU, or CPU processes) maps the sender's bucket buffers instead of receiving a copy: CUDA IPC
  handles of device buffers with ``backend="nccl"``, named POSIX shared memory with ``backend="gloo"``.
  The header carries the handles (when the buffers change); each receiver copies the weights out of the
  mapping and acknowledges, and ``broadcast`` returns once all have, so the buffers are rewritten only
  after everyone read them. One device-to-device copy per receiver, no collective. A receiver that died
  is noticed when the group is re-formed (``abandon``) or at the time-out, not at once.
- **A dedicated process group.** Sender and receivers build a standalone gloo/NCCL group from their own
  ``TCPStore`` and never touch ``torch.distributed``'s default group, so DCS coexists with a trainer that
  already runs FSDP or Megatron collectives in the same process. ``connect()`` is a rendezvous: call it
  on every rank concurrently (each in its own process or Ray actor). The store, the group and the shared
  buffers are :mod:`relax_core.dcs_transport`; this module is the protocol over them.

torch is imported inside functions only: relax-core does not depend on torch at import time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict

from relax_core.dcs_delta import encode_version, header_of, payload, receive_version
from relax_core.dcs_transport import (
    Endpoint,
    SharedBuckets,
)
from relax_core.weight_delta import DeltaReceiver, DeltaSender

if TYPE_CHECKING:
    import torch

    _Views: TypeAlias = tuple[int, dict[str, torch.Tensor], Callable[[], None]]
    """A received version: (version, tensors, done): see :meth:`WeightReceiver._receive_views`."""

logger = logging.getLogger(__name__)

SHUTDOWN_VERSION = -1


class SyncTimeout(RuntimeError):
    """A collective of a sync waited ``timeout_s`` for a receiver. A RuntimeError like a dead member's
    error, so the trainer trains on the same way (:mod:`relax_core.weight_sync`) while the health manager
    restarts the receiver and re-forms the group."""


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor, sorted by name (iteration order is
    irrelevant). Equal checksums mean bitwise-equal weights."""
    items = sorted(named_tensors, key=lambda kv: kv[0])
    h = hashlib.sha256()
    for name, t in items:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_as_bytes(t).cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass
class SyncStats:
    version: int
    num_bytes: int
    """Bytes sent (with delta sync: the deltas' payloads)."""
    num_buckets: int
    seconds: float
    full_bytes: int | None = None
    """With delta sync: the version's whole size (``num_bytes`` of a full sync)."""


class _Bucket(TypedDict):
    """One bucket of a version's layout (sent as JSON in the header when the layout changes)."""

    dtype: str
    nbytes: int
    params: list[list[Any]]
    """[name, shape, bytes] of each tensor, in the bucket's order."""


def _layout(items: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[_Bucket]:
    """Buckets of one dtype, ≤ bucket_bytes each (a larger tensor gets its own)."""
    by_dtype: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, t in items:
        by_dtype.setdefault(str(t.dtype).removeprefix("torch."), []).append((name, t))
    buckets: list[_Bucket] = []
    for dtype, group in by_dtype.items():
        cur: _Bucket | None = None
        for name, t in group:
            n = t.numel() * t.element_size()
            if cur is None or (cur["nbytes"] + n > bucket_bytes and cur["params"]):
                cur = {"dtype": dtype, "nbytes": 0, "params": []}
                buckets.append(cur)
            cur["params"].append([name, list(t.shape), n])
            cur["nbytes"] += n
    return buckets


def _unpack(bucket: _Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``bucket`` (one entry of :func:`_layout`), zero-copy views of its bytes ``flat``."""
    import torch

    dtype, offset, out = getattr(torch, bucket["dtype"]), 0, {}
    for name, shape, n in bucket["params"]:
        out[name] = flat[offset : offset + n].view(dtype).reshape(shape)
        offset += n
    return out


class WeightSender:
    """Rank 0, in the trainer process: ``connect()`` once, ``broadcast(model.named_parameters(), step)``
    after every step, ``close()`` at the end."""

    def __init__(
        self,
        init_method: str,
        world_size: int,
        backend: str = "gloo",
        bucket_bytes: int = 32 << 20,
        timeout_s: float = 300.0,
        group_name: str = "relax_dcs",
        transport: str = "broadcast",
        device: str | None = None,
        delta: bool = False,
        full_every: int = 50,
    ):
        """``delta``: each version as its difference from the last (:mod:`relax_core.dcs_delta`; broadcast
        transport only), full every ``full_every`` versions and when a receiver asks."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0 (got {bucket_bytes})")
        if delta and transport != "broadcast":
            raise ValueError(
                "delta weight sync is for the broadcast transport (ipc maps the weights: nothing to save)"
            )
        self._codec = DeltaSender(full_every) if delta else None
        self._full_asked = 0
        self._ep = Endpoint(init_method, world_size, 0, backend, timeout_s, group_name, transport, device)
        self._shared = SharedBuckets(self._ep.device) if transport == "ipc" else None
        self._abandoned = False
        self._share_lock = threading.Lock()  # held while the shared buffers are written and read
        self.bucket_bytes = bucket_bytes
        self._layout: list[_Bucket] | None = None
        self._seq = 0
        self._last_version: int | None = None
        self._unacked: list[int] = []
        self.last_stats: SyncStats | None = None

    @classmethod
    def for_run(cls, run: Any, init_method: str, world_size: int) -> WeightSender:
        """The sender a run's config asks for (``run.weight_sync_backend`` / ``weight_sync_transport`` /
        ``weight_sync_timeout_s``)."""
        return cls(
            init_method,
            world_size,
            backend=run.weight_sync_backend,
            transport=run.weight_sync_transport,
            timeout_s=run.weight_sync_timeout_s,
            delta=run.weight_sync_delta,
            full_every=run.weight_sync_full_every,
        )

    def connect(self) -> None:
        self._ep.connect()

    @property
    def last_version(self) -> int | None:
        """The last version broadcast through this sender (None before the first)."""
        return self._last_version

    def _publish(self, header: dict[str, Any]) -> int:
        store = self._ep.store
        if store is None:
            raise RuntimeError("DCS: the group was closed (a member died and it is being re-formed)")
        for seq in list(self._unacked):  # drop headers every receiver has read
            if store.add(f"ack/{seq}", 0) >= self._ep.world_size - 1:
                store.delete_key(f"hdr/{seq}")
                store.delete_key(f"ack/{seq}")
                self._unacked.remove(seq)
        self._seq += 1
        store.set(f"hdr/{self._seq}", json.dumps(header))
        self._unacked.append(self._seq)
        return self._seq

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        import torch

        if self._ep.pg is None:
            raise RuntimeError("WeightSender.broadcast() before connect()")
        if version < 0 or (self._last_version is not None and version <= self._last_version):
            raise ValueError(f"version must be ≥ 0 and increase (got {version} after {self._last_version})")
        t0 = time.perf_counter()
        items = list(named_tensors)
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            raise ValueError("named_tensors has duplicate names")
        tensors = dict(items)
        layout = _layout(items, self.bucket_bytes)
        changed = layout != self._layout
        self._layout = layout
        if self._shared is not None:
            return self._share(tensors, layout, changed, version, t0)
        if self._codec is not None and not self._codec.gave_up:  # (given up: plain full syncs, no checksums)
            return self._send_deltas(tensors, layout, changed, version, t0)
        self._publish({"version": version, "num_buckets": len(layout), "layout": layout if changed else None})
        num_bytes = 0
        for bucket in layout:
            with torch.no_grad():
                parts = [_as_bytes(tensors[name]).to(self._ep.device) for name, _, _ in bucket["params"]]
                flat = torch.cat(parts) if len(parts) > 1 else parts[0]  # root only reads it
            self._bcast(flat, version)
            num_bytes += flat.numel()
        self._last_version = version
        self.last_stats = SyncStats(version, num_bytes, len(layout), time.perf_counter() - t0)
        return self.last_stats

    def _bcast(self, flat: torch.Tensor, version: int) -> None:
        try:
            self._ep.bcast(flat)
        except RuntimeError as e:
            if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                raise
            raise SyncTimeout(
                f"DCS: version {version} waited {self._ep.timeout} for a receiver in a bucket broadcast "
                f"(one is cut off the network, stopped or dead); the group must be re-formed. A sync "
                f"that is only slow needs a longer --weight-sync-timeout-s. ({e})"
            ) from e

    def _send_deltas(
        self, tensors: dict[str, torch.Tensor], layout: list[_Bucket], changed: bool, version: int, t0: float
    ) -> SyncStats:
        """Delta sync: every bucket as its delta against the last version (full where due or asked)."""
        import torch

        assert self._codec is not None
        with torch.no_grad():
            flats = [torch.cat([_as_bytes(tensors[n]).cpu() for n, _, _ in b["params"]]) for b in layout]
        deltas, self._full_asked = encode_version(
            self._codec, self._ep.store, self._full_asked, flats, [b["dtype"] for b in layout], version
        )
        header = {"version": version, "num_buckets": len(layout), "layout": layout if changed else None}
        self._publish({**header, "delta": header_of(deltas)})
        for d in deltas:
            self._bcast(payload(d).to(self._ep.device), version)
        self._last_version = version
        sent, full = sum(len(d.payload) for d in deltas), sum(f.numel() for f in flats)
        self.last_stats = SyncStats(version, sent, len(layout), time.perf_counter() - t0, full)
        return self.last_stats

    def _share(
        self, tensors: dict[str, torch.Tensor], layout: list[_Bucket], changed: bool, version: int, t0: float
    ) -> SyncStats:
        """``ipc``: write the buckets into the shared buffers, publish, wait until every receiver read them."""
        shared = self._shared
        assert shared is not None, "transport='ipc' only"
        with self._share_lock:
            try:
                return self._share_locked(shared, tensors, layout, changed, version, t0)
            except RuntimeError:
                if self._abandoned:
                    shared.free()
                raise

    def _share_locked(
        self,
        shared: SharedBuckets,
        tensors: dict[str, torch.Tensor],
        layout: list[_Bucket],
        changed: bool,
        version: int,
        t0: float,
    ) -> SyncStats:
        import torch

        new = shared.create([b["nbytes"] for b in layout])
        with torch.no_grad():
            for bucket, buf in zip(layout, shared.bufs):
                offset = 0
                for name, _, n in bucket["params"]:
                    buf[offset : offset + n].copy_(_as_bytes(tensors[name]))
                    offset += n
        if self._ep.device != "cpu":
            torch.cuda.current_stream(
                self._ep.device
            ).synchronize()  # the copies land before a receiver reads
        header: dict[str, Any] = {
            "version": version,
            "num_buckets": len(layout),
            "layout": layout if changed else None,
        }
        if new or changed:
            header["handles"] = shared.handles
        seq = self._publish(header)
        store, deadline = self._ep.store, time.monotonic() + self._ep.timeout.total_seconds()
        while store.add(f"done/{seq}", 0) < self._ep.world_size - 1:
            if self._abandoned:
                raise RuntimeError(f"DCS: the group was re-formed while version {version} was being read")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"DCS: not every receiver read version {version} within {self._ep.timeout}; one may have died"
                )
            time.sleep(0.001)
        store.delete_key(f"done/{seq}")
        self._last_version = version
        num_bytes = sum(b["nbytes"] for b in layout)
        self.last_stats = SyncStats(version, num_bytes, len(layout), time.perf_counter() - t0)
        return self.last_stats

    def abandon(self) -> None:
        """Drop the group without the shutdown handshake: a member died and the group is being re-formed
        (receivers blocked in a broadcast see the connection close and give up; with ``ipc`` a sender
        waiting for the receivers gives up)."""
        self._abandoned = True
        self._ep.close()
        if self._shared is not None and self._share_lock.acquire(blocking=False):
            self._shared.free()  # (else the broadcast in flight frees them when it gives up)
            self._share_lock.release()

    def close(self) -> None:
        """Tell receivers to stop (version -1), wait for their acknowledgement, destroy the group."""
        if self._ep.pg is None:
            return
        seq = self._publish({"version": SHUTDOWN_VERSION, "num_buckets": 0, "layout": None})
        deadline = time.monotonic() + self._ep.timeout.total_seconds()
        while self._ep.store.add(f"ack/{seq}", 0) < self._ep.world_size - 1:
            if time.monotonic() > deadline:
                logger.warning("DCS close: not every receiver acknowledged the shutdown; closing anyway")
                break
            time.sleep(0.01)
        self._ep.close()
        if self._shared is not None:
            self._shared.free()


class WeightReceiver:
    """Ranks 1..world_size-1, in an engine or ActorFwd process: ``receive()`` blocks for the next version,
    or ``start_background(on_weights)`` applies every version from a daemon thread."""

    def __init__(
        self,
        init_method: str,
        world_size: int,
        rank: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        group_name: str = "relax_dcs",
        transport: str = "broadcast",
        device: str | None = None,
    ):
        if rank == 0:
            raise ValueError("rank 0 is the WeightSender; receivers use ranks 1..world_size-1")
        self._ep = Endpoint(init_method, world_size, rank, backend, timeout_s, group_name, transport, device)
        self._shared = SharedBuckets(self._ep.device) if transport == "ipc" else None
        self._codec = DeltaReceiver()
        """Delta sync: the last complete version's buckets (the base of the next delta)."""
        self._layout: list[_Bucket] | None = None
        self._seq = 0
        self._latest = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_stats: SyncStats | None = None

    @classmethod
    def for_run(cls, run: Any, init_method: str, world_size: int, rank: int) -> WeightReceiver:
        """The receiver a run's config asks for (``run.weight_sync_backend`` / ``weight_sync_transport`` /
        ``weight_sync_timeout_s``)."""
        return cls(
            init_method,
            world_size,
            rank,
            backend=run.weight_sync_backend,
            transport=run.weight_sync_transport,
            timeout_s=run.weight_sync_timeout_s,
        )

    def connect(self) -> None:
        self._ep.connect()

    @property
    def latest_version(self) -> int:
        """Version of the last weights received (-1 before the first)."""
        return self._latest

    def _wait_header(self) -> dict[str, Any] | None:
        key = f"hdr/{self._seq + 1}"
        delay = 0.001
        while not self._ep.store.check([key]):
            if self._stop.is_set():
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        self._seq += 1
        header: dict[str, Any] = json.loads(self._ep.store.get(key))
        self._ep.store.add(f"ack/{self._seq}", 1)
        return header

    def receive(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Block for the next version; ``(version, tensors)``, or None once the sender closed.

        Tensors are fresh each call but those of one bucket are views of one buffer: copy them into the
        model (``param.copy_(t)``) rather than keeping them around piecemeal."""
        got = self._receive_views()
        if got is None:
            return None
        version, tensors, done = got
        if self._shared is not None:  # views of the sender's buffers: copies, before it may rewrite them
            tensors = {name: t.clone() for name, t in tensors.items()}
        done()
        return version, tensors

    def _receive_views(self) -> _Views | None:
        """``(version, tensors, done)``: with ``ipc`` the tensors are views of the sender's shared buffers,
        valid until ``done()`` tells the sender this receiver has read them."""
        import torch

        if self._ep.pg is None:
            raise RuntimeError("WeightReceiver.receive() before connect()")
        while True:  # (a delta version this receiver refused is skipped: it waits for the full one)
            header = self._wait_header()
            if header is None or header["version"] == SHUTDOWN_VERSION:
                return None
            t0 = time.perf_counter()
            if header["layout"] is not None:
                self._layout = header["layout"]
            if self._layout is None or len(self._layout) != header["num_buckets"]:
                raise RuntimeError("DCS protocol error: no parameter layout for this version")
            if self._shared is not None:
                return self._map_shared(self._shared, self._layout, header, t0)
            out: dict[str, torch.Tensor] = {}
            if "delta" in header:
                ep = self._ep
                committed = receive_version(ep.bcast, ep.store, ep.device, self._codec, header)
                if committed is None:
                    continue
                flats = [torch.from_numpy(b).to(ep.device) for b in committed]
                num_bytes = sum(m[2] for m in header["delta"])
            else:
                flats = []
                for bucket in self._layout:
                    flats.append(torch.empty(bucket["nbytes"], dtype=torch.uint8, device=self._ep.device))
                    self._ep.bcast(flats[-1])
                num_bytes = sum(f.numel() for f in flats)
            for bucket, flat in zip(self._layout, flats):
                out.update(_unpack(bucket, flat))
            self._latest = header["version"]
            self.last_stats = SyncStats(self._latest, num_bytes, len(self._layout), time.perf_counter() - t0)
            return self._latest, out, lambda: None

    def _map_shared(
        self, shared: SharedBuckets, layout: list[_Bucket], header: dict[str, Any], t0: float
    ) -> _Views:
        import torch

        if "handles" in header:
            shared.attach([b["nbytes"] for b in layout], header["handles"])
        if len(shared.bufs) != len(layout):
            raise RuntimeError("DCS protocol error: no shared buffers for this version")
        out: dict[str, torch.Tensor] = {}
        for bucket, flat in zip(layout, shared.bufs):
            out.update(_unpack(bucket, flat))
        seq, store = self._seq, self._ep.store
        self._latest = header["version"]

        def done() -> None:
            if self._ep.device != "cpu":  # the copies out of the sender's memory have finished
                torch.cuda.current_stream(self._ep.device).synchronize()
            num_bytes = sum(b["nbytes"] for b in layout)
            self.last_stats = SyncStats(self._latest, num_bytes, len(layout), time.perf_counter() - t0)
            store.add(f"done/{seq}", 1)

        return self._latest, out, done

    def start_background(self, on_weights: Callable[[int, dict[str, torch.Tensor]], None]) -> None:
        """Loop ``receive()`` on a daemon thread, calling ``on_weights(version, tensors)`` for each
        version; an exception stops the loop and is re-raised by ``check()``."""
        if self._thread is not None:
            raise RuntimeError("start_background() was already called")

        def loop() -> None:
            try:
                while (got := self._receive_views()) is not None:
                    version, tensors, done = got
                    on_weights(version, tensors)  # (copies them into the model)
                    done()
            except BaseException as e:  # surfaced through check()
                self._error = e

        self._thread = threading.Thread(target=loop, name="relax-dcs-receiver", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def check(self) -> None:
        """Re-raise the background thread's exception, if any."""
        if self._error is not None:
            raise RuntimeError("DCS background receiver failed") from self._error

    @property
    def failed(self) -> bool:
        """The background loop stopped on an error (typically: the sender or another member died)."""
        return self._error is not None

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the background loop (waiting up to ``timeout_s``, default the group's time-out) and leave."""
        self._stop.set()
        self.join(timeout=self._ep.timeout.total_seconds() if timeout_s is None else timeout_s)
        self._ep.close()
        if self._shared is not None:
            self._shared.free()
