"""How megatron-core lays out one tensor: the per-query-group QKV interleave, the ``[gate; up]`` fc1 and its
per-rank halves, column / row sharding and vocab padding. Apart so these layout rules, each checked against
megatron-core (see :mod:`~relax_train.backends.megatron.convert`), read on their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from relax_train.backends.megatron.layout import MegatronLayout
from relax_train.backends.megatron.specs import Split


def interleave_qkv(q: Tensor, k: Tensor, v: Tensor, layout: MegatronLayout) -> Tensor:
    g, hd, h = layout.num_query_groups, layout.head_dim, q.shape[-1]
    groups = [q.reshape(g, layout.heads_per_group * hd, h), k.reshape(g, hd, h), v.reshape(g, hd, h)]
    return torch.cat(groups, dim=1).reshape(-1, h)


def split_qkv(qkv: Tensor, layout: MegatronLayout) -> tuple[Tensor, Tensor, Tensor]:
    g, hd, h = layout.num_query_groups, layout.head_dim, qkv.shape[-1]
    per_group = qkv.reshape(g, (layout.heads_per_group + 2) * hd, h)
    q, k, v = torch.split(per_group, [layout.heads_per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def rows_padded_to(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def first_rows(t: Tensor, n: int) -> Tensor:
    return t if t.shape[0] == n else t[:n]


def owned(t: Tensor) -> Tensor:
    """A contiguous tensor that is not a view (safe to save with safetensors next to its siblings)."""
    return (
        t.clone(memory_format=torch.contiguous_format) if t._base is not None or not t.is_contiguous() else t
    )


def tp_shard(t: Tensor, split: Split, rank: int, size: int) -> Tensor:
    if split == "rep" or size == 1:
        return t
    if split == "col":
        return t.chunk(size, dim=0)[rank]
    if split == "row":
        return t.chunk(size, dim=1)[rank]
    gate, up = t.chunk(2, dim=0)
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)


def unshard(parts: Sequence[Tensor], split: Split) -> Tensor:
    if split == "rep" or len(parts) == 1:
        return parts[0]
    if split == "col":
        return torch.cat(list(parts), dim=0)
    if split == "row":
        return torch.cat(list(parts), dim=1)
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
