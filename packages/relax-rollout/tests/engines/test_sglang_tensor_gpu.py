"""``weight_update="tensor"`` against SGLang 0.5.23's own receiving code, on a real GPU (skipped without
CUDA or without SGLang's files; CI has no GPU: run on a lent GPU machine by ``tools/gpu-check``).

Our side serializes the trainer's CUDA tensors as IPC handles that name their GPU by UUID; in another
process SGLang's TP worker code (``sglang_receiver``) patches torch's reductions and deserializes through
its allow-listing unpickler. What CPU tests cannot show: that SGLang's unpickler admits every global our
payload names, that the UUID maps back to a device there, and that the bytes it maps are the weights."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from relax_core.dcs import checksum  # noqa: E402
from relax_rollout.engines.wire_weights import tensor_update_request  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from sglang_receiver import receive_main, sglang_site  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(sglang_site() is None, reason="needs SGLang's files (bash tools/sglang-cpu/setup.sh)"),
]


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(300, 64, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, generator=g)),
        ("model.norm.weight", torch.ones(64)),
        ("lm_head.weight", torch.randn(64, 300, generator=g).t()),  # a non-contiguous view
    ]


def _sglang_reads(payload: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=receive_main, args=(str(sglang_site()), payload, queue))
    child.start()
    try:
        got = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
    assert "error" not in got, got["error"]
    return got


@pytest.mark.parametrize("devices", ["where they are", "each rank's device"])
def test_sglang_maps_the_trainers_gpu_tensors_by_uuid(devices):
    named = [(n, t.cuda()) for n, t in _weights()]
    ranks = 1 if devices == "where they are" else [torch.device("cuda", 0)] * 2  # two TP ranks on GPU 0
    body = tensor_update_request(named, version=3, devices=ranks)
    assert body["weight_version"] == "3" and len(body["serialized_named_tensors"]) == (1 if ranks == 1 else 2)
    for entry in body["serialized_named_tensors"]:  # each TP rank reads its own entry
        got = _sglang_reads(entry)
        assert got["names"] == [n for n, _ in named]
        assert got["devices"] == ["cuda:0"]
        assert got["checksum"] == checksum(named)  # the bytes SGLang maps are the trainer's weights


def test_host_tensors_moved_to_the_engines_gpu_reach_sglang():
    """The megatron backend publishes host tensors; with the engine's devices given they are copied there
    (and synchronised) before the handles go."""
    named = _weights()
    body = tensor_update_request(named, version=4, devices=[torch.device("cuda", 0)])
    got = _sglang_reads(body["serialized_named_tensors"][0])
    assert got["devices"] == ["cuda:0"] and got["checksum"] == checksum(named)
