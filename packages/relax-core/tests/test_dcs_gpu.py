"""DCS on a real GPU (skipped without CUDA; CI has none: these run on a lent GPU machine, see
``tools/gpu-check``).

``transport="ipc"`` with ``backend="nccl"`` is colocate's weight sync: receivers in other processes map
the sender's device buffers through CUDA IPC handles and copy the weights out on their own device. It
needs one GPU. The NCCL broadcast transport needs one GPU per rank (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


sys.path.insert(0, str(Path(__file__).parent))
from dcs_workers import VERSIONS, run_exchange  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_ipc_receivers_map_the_senders_device_buffers_bit_for_bit():
    ex = run_exchange("ipc", "nccl")
    assert ex["device"] == "cuda:0"
    assert ex["exitcodes"] == [0, 0]
    for rank in (1, 2):  # receive() and the background thread alike
        assert ex["got"][rank]["results"] == ex["sent"], rank
        # copied out on the receiver's own GPU, not to host memory
        assert ex["got"][rank]["devices"] == [f"cuda:{rank % torch.cuda.device_count()}"], rank
        assert ex["got"][rank]["clean"] and ex["got"][rank]["latest"] == VERSIONS[-1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_nccl_broadcast_reaches_each_receiver_on_its_own_gpu():
    ex = run_exchange("broadcast", "nccl", world_size=2)
    assert ex["exitcodes"] == [0]
    assert ex["got"][1]["results"] == ex["sent"]
