"""DCS on a real GPU (skipped without CUDA; CI has none: these run on a lent GPU machine, see
``tools/gpu-check``).

``transport="ipc"`` with ``backend="nccl"`` is colocate's weight sync: receivers in other processes map
the sender's device buffers through CUDA IPC handles and copy the weights out on their own device. It
needs one GPU. The NCCL broadcast transport needs one GPU per rank (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from relax_core.dcs import WeightSender, checksum, free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from dcs_workers import BUCKET_BYTES, VERSIONS, _receiver_main, make_params  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _exchange(transport: str, world_size: int = 3) -> dict:
    """This process sends ``VERSIONS`` from GPU 0; rank 1 calls receive(), rank 2 runs in background mode
    (on GPU ``rank`` when there are enough, else GPU 0)."""
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_receiver_main, args=(init_method, world_size, rank, rank == 2, queue, transport, "nccl"))
        for rank in range(1, world_size)
    ]
    for p in procs:
        p.start()
    torch.cuda.set_device(0)
    sender = WeightSender(init_method, world_size, bucket_bytes=BUCKET_BYTES, timeout_s=60, transport=transport,
                          backend="nccl")  # fmt: skip
    sender.connect()
    sent = []
    for v in VERSIONS:  # version 5 adds a tensor: new buckets, new IPC handles
        params = [(n, t.cuda()) for n, t in make_params(v)]
        sender.broadcast(params, version=v)
        sent.append((v, checksum(params)))
    sender.close()
    got = {}
    for _ in procs:
        r = queue.get(timeout=120)
        got[r["rank"]] = r
    for p in procs:
        p.join(timeout=30)
    return {"sent": sent, "got": got, "exitcodes": [p.exitcode for p in procs], "device": sender._ep.device}


def test_ipc_receivers_map_the_senders_device_buffers_bit_for_bit():
    ex = _exchange("ipc")
    assert ex["device"] == "cuda:0"
    assert ex["exitcodes"] == [0, 0]
    for rank in (1, 2):  # receive() and the background thread alike
        assert ex["got"][rank]["results"] == ex["sent"], rank
        # copied out on the receiver's own GPU, not to host memory
        assert ex["got"][rank]["devices"] == [f"cuda:{rank % torch.cuda.device_count()}"], rank
        assert ex["got"][rank]["clean"] and ex["got"][rank]["latest"] == VERSIONS[-1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_nccl_broadcast_reaches_each_receiver_on_its_own_gpu():
    ex = _exchange("broadcast", world_size=2)
    assert ex["exitcodes"] == [0]
    assert ex["got"][1]["results"] == ex["sent"]
