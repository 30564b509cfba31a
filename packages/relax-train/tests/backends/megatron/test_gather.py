"""relax_train.backends.megatron.gather: stages' weights to rank 0 in buckets, over a real gloo group of separate
processes (what a pipeline of three stages does at each weight sync)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from relax_train.backends.megatron.gather import plan_buckets

WORKER = Path(__file__).with_name("_gather_worker.py")
sys.path.insert(0, str(WORKER.parent))
from _gather_worker import stage_items  # noqa: E402


def _ranks(case: str, world: int, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), case, str(out)],
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            },
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_buckets_hold_at_most_the_limit_and_a_larger_tensor_alone():
    shapes = [(4,), (4,), (10,), (2,), (2,), (1,)]  # float32: 16, 16, 40, 8, 8, 4 bytes
    assert plan_buckets(shapes, 4, 32) == [[0, 1], [2], [3, 4, 5]]
    assert plan_buckets([], 4, 32) == []
    assert plan_buckets(shapes, 4, 1 << 20) == [[0, 1, 2, 3, 4, 5]]


def test_every_stage_reaches_rank_0_in_the_rollout_dtype_and_bucket_by_bucket(tmp_path):
    world = 3
    result = _ranks("gather", world, tmp_path)
    # only rank 0 holds the model; the others took part and keep nothing
    assert result[1]["items"] == [] and result[2]["items"] == []
    got = dict(result[0]["items"])
    assert list(got) == [k for r in range(world) for k, _ in stage_items(r)]  # own first, then by rank
    for r in range(world):
        for key, value in stage_items(r):
            assert got[key].dtype == torch.bfloat16 and got[key].device.type == "cpu", key
            torch.testing.assert_close(got[key], value.to(torch.bfloat16), rtol=0, atol=0, msg=str(key))
    # per sender: w (128 B) + b (6 B) in one bucket of ≤ 300 bytes, then the 2 KiB tensor alone
    assert result[0]["recv_bytes"] == [134, 2048, 134, 2048]


def test_a_group_without_rank_0_is_refused(tmp_path):
    result = _ranks("outside", 2, tmp_path)
    assert "does not contain rank 0" in result[1]["error"]
