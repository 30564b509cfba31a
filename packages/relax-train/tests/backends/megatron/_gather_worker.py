"""One rank of test_gather.py, run as its own process: ``python _gather_worker.py CASE OUT_DIR`` with
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set. Writes what this rank saw to OUT_DIR/rank{N}.pt."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from relax_train.backends.megatron.gather import gather_to_rank0


def stage_items(rank: int) -> list:
    g = torch.Generator().manual_seed(rank)
    # float32 master weights, as megatron keeps them; keys are arbitrary picklable values
    return [
        ((rank, "w"), torch.randn(8, 8, generator=g)),
        ((rank, None, "b"), torch.randn(3, generator=g)),
        (("big", rank), torch.randn(64, 16, generator=g)),
    ]


def main(case: str, out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    out: dict = {}
    try:
        if case == "gather":
            sizes: list[int] = []
            recv = dist.recv

            def counting_recv(tensor, src=None, **kw):
                sizes.append(tensor.numel())
                return recv(tensor, src=src, **kw)

            dist.recv = counting_recv
            got = gather_to_rank0(stage_items(rank), dist.group.WORLD, torch.bfloat16, bucket_bytes=300)
            out = {"items": got, "recv_bytes": sizes}
        elif case == "outside":
            group = dist.new_group([1])
            if rank == 1:
                try:
                    gather_to_rank0([], group, torch.float32)
                except ValueError as e:
                    out["error"] = str(e)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
