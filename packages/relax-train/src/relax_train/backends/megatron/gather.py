"""Weights of every pipeline stage to rank 0, bucket by bucket, in the dtype the rollout serves.

Why: with pipeline parallelism each stage holds its own layers, and the rollout engines (or ActorFwd) need
the whole model from one sender, rank 0. Exchanging whole stages as pickled objects
(``all_gather_object``) puts a full float32 copy of the model on every rank, in host memory and, on
NCCL, in one device buffer per stage at once: tens of GB per rank at the first sync of the Omni recipe
(PP 2). Here only rank 0 receives, each other stage sends its tensors packed into flat buffers of at most
``bucket_bytes`` (one tensor larger than that gets a buffer of its own), point to point, and every tensor
is cast to the rollout's dtype before it moves (bf16 on GPUs: half the bytes of the float32 master
weights).

The names and shapes go first (a small ``gather_object``), so rank 0 sizes each receive buffer from them;
both sides cut the buckets with :func:`plan_buckets` from the same list, so they agree without a second
message.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20
"""Default size of one transfer between stages (the peak extra device memory of a sending stage)."""


def plan_buckets(shapes: list[tuple[int, ...]], itemsize: int, bucket_bytes: int) -> list[list[int]]:
    """Indices of ``shapes`` grouped into consecutive buckets of at most ``bucket_bytes`` each (a tensor
    larger than that is a bucket on its own)."""
    buckets: list[list[int]] = []
    size = 0
    for i, shape in enumerate(shapes):
        n = _numel(shape) * itemsize
        if not buckets or (size + n > bucket_bytes and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def gather_to_rank0(
    items: list[tuple[Any, torch.Tensor]],
    group: Any,
    dtype: torch.dtype,
    bucket_bytes: int = BUCKET_BYTES,
) -> list[tuple[Any, torch.Tensor]]:
    """Every member of ``group`` (which must contain global rank 0) calls this with its own ``items``
    (key, tensor on its device); rank 0 returns every member's items, its own first and then by rank,
    as host tensors of ``dtype``; the other members return ``[]``.

    Keys are any picklable values (they travel in the small name exchange). A sender's peak extra memory
    is one bucket; rank 0's is one bucket on its device plus the result in host memory."""
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group)
    if 0 not in ranks:
        raise ValueError(f"gather_to_rank0: the group {ranks} does not contain rank 0, which receives")
    meta = [(key, tuple(t.shape)) for key, t in items]
    metas: list[Any] | None = [None] * len(ranks) if me == 0 else None
    dist.gather_object(meta, metas, dst=0, group=group)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if me != 0:
        for bucket in plan_buckets([s for _, s in meta], itemsize, bucket_bytes):
            flat = torch.cat([items[i][1].detach().reshape(-1).to(dtype) for i in bucket])
            dist.send(flat.view(torch.uint8), dst=0)  # as bytes: gloo's p2p lacks some dtypes
            del flat
        return []
    out = [(key, t.detach().to(dtype).cpu()) for key, t in items]
    device = items[0][1].device if items else torch.device("cpu")
    assert metas is not None
    for src, their in zip(ranks, metas):
        if src == 0:
            continue
        shapes = [s for _, s in their]
        for bucket in plan_buckets(shapes, itemsize, bucket_bytes):
            flat = torch.empty(sum(_numel(shapes[i]) for i in bucket), dtype=dtype, device=device)
            dist.recv(flat.view(torch.uint8), src=src)
            host = flat.cpu()
            offset = 0
            for i in bucket:
                n = _numel(shapes[i])
                out.append((their[i][0], host[offset : offset + n].view(shapes[i])))
                offset += n
    return out
