"""SGLang's weight-update group: weights broadcast from one process to SGLang servers, without a disk.

Why: SGLang receives weights over a torch.distributed group it joins on ``/init_weights_update_group``;
on each ``/update_weights_from_distributed`` it allocates the tensors the request names and takes them from
a ``broadcast(src=0)`` on that group. Both ends must build the group the same way and agree on the bytes,
so both are here: the sender (:class:`~relax_rollout.engines.sglang.weights.SGLangWeights` with
``weight_update="distributed"``) and the receiver of our engine server (``relax_rollout.server``), which
stands in for SGLang on CPU. What we follow, read in sgl-project/sglang (``srt/utils`` ``init_custom_process_group``,
``model_executor/model_runner.py`` ``update_weights_from_distributed``, ``weight_sync/tensor_bucket.py``):

- **The group.** A ``TCPStore`` rendezvous on ``tcp://master_address:master_port`` (rank 0, the sender,
  hosts it), wrapped in a ``PrefixStore`` named by the request's ``group_name`` (SGLang 0.5.23's
  ``init_custom_process_group``: ``PrefixStore(group_name, store)``), then torch's own process-group
  constructor with that name. Store keys therefore match SGLang's exactly (the same torch builds both);
  a prefix of anything else and the two sides wait for each other's keys until both time out. The group
  never touches the default process group, so it lives beside Megatron's or SGLang's.
- **The bytes.** ``load_format="flattened_bucket"``: every tensor of the request flattened to bytes and
  concatenated in request order, one broadcast of the whole buffer (SGLang's ``FlattenedTensorBucket``).
  Without it: one broadcast per tensor, in request order. Our buckets hold one dtype each: SGLang views a
  byte slice as the tensor's dtype, which needs the slice aligned to it.

torch is imported inside functions only (``relax_rollout.engines`` imports without torch).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, cast

FLATTENED = "flattened_bucket"


def new_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float = 300.0
) -> Any:
    """Join (rank 0: host) the weight-update group ``group_name`` as SGLang builds it; a rendezvous: every
    rank must call it concurrently."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl' (got {backend!r})")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)  # SGLang's prefix: the group name, not the URL
    # torch renamed pg_options to backend_options (2.6); SGLang passes whichever its torch has
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options: dict[str, Any] = {"backend_options" if "backend_options" in params else "pg_options": None}
    from relax_core.dcs_transport import parse_tcp
    from relax_core.net import gloo_bound_to_route

    with gloo_bound_to_route(parse_tcp(init_method)[0]):  # (across nodes: not where the hostname resolves)
        pg, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            backend,
            store,
            group_name=cast("c10d.GroupName", group_name),
            timeout=timeout,
            **options,
        )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # src=0 means this group's rank 0
    return pg


def destroy_group(pg: Any) -> None:
    """Leave a group made by :func:`new_group` (a member that died leaves nothing to wait for)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001 — already gone with a dead peer; nothing else to release
        pass


def _dtype(name: Any) -> Any:
    import torch

    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: give a torch dtype name such as 'bfloat16'")
    return dt


def _nbytes(dtype: Any, shape: list[int]) -> int:
    import torch

    return torch.Size(shape).numel() * _dtype(dtype).itemsize


def buckets(named: Iterable[tuple[str, Any]], bucket_bytes: int) -> list[list[tuple[str, Any]]]:
    """``named`` split into runs of one dtype of at most ``bucket_bytes`` each (a tensor larger than that
    gets a bucket of its own), in order within each dtype."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be ≥ 1 (got {bucket_bytes})")
    by_dtype: dict[Any, list[tuple[str, Any]]] = {}
    for name, t in named:
        by_dtype.setdefault(t.dtype, []).append((name, t))
    out: list[list[tuple[str, Any]]] = []
    for items in by_dtype.values():
        cur: list[tuple[str, Any]] = []
        size = 0
        for name, t in items:
            n = t.numel() * t.element_size()
            if cur and size + n > bucket_bytes:
                out.append(cur)
                cur, size = [], 0
            cur.append((name, t))
            size += n
        if cur:
            out.append(cur)
    return out


def flatten(bucket: list[tuple[str, Any]], device: Any = None) -> Any:
    """One uint8 tensor: every tensor's bytes, in order (SGLang's ``FlattenedTensorBucket``)."""
    import torch

    if not bucket:
        raise ValueError("an empty bucket has nothing to send")
    return torch.cat([t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def unflatten(
    flat: Any, names: list[str], dtypes: list[Any], shapes: list[list[int]]
) -> list[tuple[str, Any]]:
    """The tensors a flattened buffer holds, as views of it (the inverse of :func:`flatten`)."""
    out, at = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        n = _nbytes(dt, shape)
        if at + n > flat.numel():
            raise ValueError(f"{name}: the buffer ends at byte {flat.numel()}, the tensor needs {at + n}")
        out.append((name, flat[at : at + n].view(_dtype(dt)).reshape(shape)))
        at += n
    if at != flat.numel():
        raise ValueError(f"the buffer holds {flat.numel()} bytes, the tensors named take {at}")
    return out


def send(pg: Any, bucket: list[tuple[str, Any]], load_format: str | None, device: Any = None) -> None:
    """Rank 0's side of one ``/update_weights_from_distributed``: broadcast ``bucket`` as the receivers
    expect it for ``load_format``."""
    import torch.distributed as dist

    if load_format == FLATTENED:
        dist.broadcast(flatten(bucket, device), src=0, group=pg)
        return
    works = [
        dist.broadcast(t.detach().to(device).contiguous(), src=0, group=pg, async_op=True) for _, t in bucket
    ]
    for w in works:
        assert w is not None, "async_op=True returns a Work"
        w.wait()


def receive(
    pg: Any,
    names: list[str],
    dtypes: list[Any],
    shapes: list[list[int]],
    load_format: str | None,
    device: Any = "cpu",
) -> list[tuple[str, Any]]:
    """A receiver's side: the tensors ``names`` / ``dtypes`` / ``shapes`` describe, taken from rank 0."""
    import torch
    import torch.distributed as dist

    if load_format == FLATTENED:
        total = sum(_nbytes(d, s) for d, s in zip(dtypes, shapes))
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=pg)
        return unflatten(flat, names, dtypes, shapes)
    out = [(n, torch.empty(s, dtype=_dtype(d), device=device)) for n, d, s in zip(names, dtypes, shapes)]
    works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in out]
    for w in works:
        assert w is not None, "async_op=True returns a Work"
        w.wait()
    return out
