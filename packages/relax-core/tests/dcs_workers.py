"""Receiver entry points for test_dcs: a plain top-level module, so spawned children can import it
(pytest's importlib mode gives test modules names a child process cannot import)."""

import json
import multiprocessing as mp

import torch

from relax_core.dcs import WeightReceiver, WeightSender, checksum
from relax_core.net import free_port

VERSIONS = [1, 2, 5]
BUCKET_BYTES = 1024  # small: forces several buckets per dtype


def make_params(version: int) -> list[tuple[str, "torch.Tensor"]]:
    """Mixed dtypes; version 5 adds a buffer, so the layout (metadata) changes mid-stream."""
    g = torch.Generator().manual_seed(version)
    params = [
        ("layer.0.weight", torch.randn(16, 33, generator=g)),  # 2112 B: a bucket of its own
        ("layer.0.bias", torch.randn(33, generator=g)),
        ("embed.weight", torch.randn(40, 16, generator=g).to(torch.bfloat16)),
        ("norm.scale", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("num_batches_tracked", torch.tensor(version * 1000, dtype=torch.int64)),
        ("position_ids", torch.arange(50, dtype=torch.int64) * version),
        ("layer.1.weight", torch.randn(8, 8, generator=g).t()),  # non-contiguous
    ]
    if version >= 5:
        params.append(("extra.buffer", torch.full((3, 3), float(version))))
    return params


def _receiver_main(
    init_method: str,
    world_size: int,
    rank: int,
    background: bool,
    queue,
    transport: str = "broadcast",
    backend: str = "gloo",
) -> None:
    if backend == "nccl":  # a GPU per rank where there are enough (NCCL needs that; IPC does not)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    recv = WeightReceiver(init_method, world_size, rank, timeout_s=60, transport=transport, backend=backend)
    recv.connect()
    results: list[tuple[int, str]] = []
    devices: set[str] = set()  # where the received tensors live
    if background:

        def on_weights(version, tensors):
            results.append((version, checksum(tensors.items())))
            devices.update(str(t.device) for t in tensors.values())

        recv.start_background(on_weights)
        recv.join(timeout=60)
        recv.check()
        shutdown_clean = not recv.running
    else:
        while (got := recv.receive()) is not None:
            version, tensors = got
            results.append((version, checksum(tensors.items())))
            devices.update(str(t.device) for t in tensors.values())
        shutdown_clean = True
    latest = recv.latest_version
    recv.close()
    queue.put(
        {
            "rank": rank,
            "results": results,
            "latest": latest,
            "clean": shutdown_clean,
            "devices": sorted(devices),
        }
    )


def run_exchange(transport: str, backend: str = "gloo", world_size: int = 3) -> dict:
    """One sender (this process) and ``world_size - 1`` spawned receivers: rank 1 calls receive(), rank 2
    runs in background mode. ``VERSIONS`` are sent (version 5 adds a tensor: new buckets; with ``ipc``, new
    shared buffers), from GPU 0 with ``backend="nccl"``. Returns what was sent and what each rank got."""
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_receiver_main, args=(init_method, world_size, rank, rank == 2, queue, transport, backend)
        )
        for rank in range(1, world_size)
    ]
    for p in procs:
        p.start()
    if backend == "nccl":
        torch.cuda.set_device(0)
    sender = WeightSender(
        init_method, world_size, bucket_bytes=BUCKET_BYTES, timeout_s=60, transport=transport, backend=backend
    )
    sender.connect()  # rendezvous with the receivers connecting concurrently
    sent, stats = [], []
    for v in VERSIONS:
        params = [(n, t.cuda() if backend == "nccl" else t) for n, t in make_params(v)]
        stats.append(sender.broadcast(params, version=v))
        sent.append((v, checksum(params)))
    shm = transport == "ipc" and backend == "gloo"
    segments = [json.loads(h)["shm"] for h in sender._shared.handles] if shm else []
    sender.close()
    got = {}
    for _ in procs:
        r = queue.get(timeout=120)
        got[r["rank"]] = r
    for p in procs:
        p.join(timeout=30)
    return {
        "sent": sent,
        "stats": stats,
        "got": got,
        "exitcodes": [p.exitcode for p in procs],
        "segments": segments,
        "device": sender._ep.device,
    }


def _ready_receiver_main(init_method: str, world_size: int, rank: int, queue) -> None:
    """A background receiver that says "ready" (torch imported, its receiver made) before it connects, for
    a sender whose time-out is shorter than a spawned process's start."""
    recv = WeightReceiver(init_method, world_size, rank, timeout_s=60)
    queue.put("ready")
    recv.connect()
    recv.start_background(lambda version, tensors: None)
    recv.join(timeout=600)


def connect_all(sender, receivers) -> None:
    """The rendezvous of a group whose members share this process: the receivers connect from threads."""
    import threading

    threads = [threading.Thread(target=r.connect) for r in receivers]
    for t in threads:
        t.start()
    sender.connect()
    for t in threads:
        t.join()
