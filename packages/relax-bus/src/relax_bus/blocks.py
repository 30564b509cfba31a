"""Payload blocks: how the Ray backend ships the data of one put through the object store as one object.

Why columnar: Ray serialises every numpy array of an object separately (a header, an out-of-band buffer, a
reference-counting entry), so a 64-sample put of three fields shipped as 128 arrays spends most of its time
in per-array overhead, and a get that returns an ObjectRef per value spends it again in reference counting.
Here the values of one field across the samples of a put are concatenated into a single array plus row
offsets (when dtype and trailing shape agree, the common case for token ids and log-probs): one object, a
few arrays, one memcpy each. Readers slice rows back out as zero-copy, read-only views of the object store.

The metadata that goes to the controller names a value by ``(block id, row)`` only; ObjectRefs never travel
per value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from relax_bus.prepare import Row

Block = dict[str, tuple]
"""field -> ``("cat", data, starts)`` (row k is ``data[starts[k]:starts[k+1]]``) or ``("list", values)``."""


RESERVED = ("group_id", "policy_version", "group_size")


def is_payload(value: Any) -> bool:
    """Values that travel in a block; scalars and short strings stay inline with the metadata."""
    if isinstance(value, np.ndarray | bytes | dict | list | tuple):
        return True
    return isinstance(value, str) and len(value) > 256


def pack(rows: list[Row], inline_bytes: int) -> tuple[Block | None, list[Row], dict[str, list[int]]]:
    """Split prepared rows into (block or None if small, rows without block values, field -> rows in block)."""
    if sum(r.size for r in rows) <= inline_bytes:
        return None, rows, {}
    where: dict[str, list[int]] = {}
    for k, r in enumerate(rows):
        for f, v in r.fields.items():
            if is_payload(v) and f not in RESERVED:  # the controller reads these (e.g. a tuple group_id)
                where.setdefault(f, []).append(k)
    if not where:
        return None, rows, {}
    block: Block = {}
    n = len(rows)
    for f, ks in where.items():
        vals = [rows[k].fields[f] for k in ks]
        first = vals[0]
        if (
            len(ks) == n
            and isinstance(first, np.ndarray)
            and first.ndim >= 1
            and all(
                isinstance(v, np.ndarray) and v.dtype == first.dtype and v.shape[1:] == first.shape[1:]
                for v in vals
            )
        ):
            starts = np.zeros(n + 1, dtype=np.int64)
            np.cumsum([v.shape[0] for v in vals], out=starts[1:])
            block[f] = ("cat", np.concatenate(vals), starts)
        else:
            col: list[Any] = [None] * n
            for k, v in zip(ks, vals):
                col[k] = v
            block[f] = ("list", col)
    out = []
    for r in rows:
        fields = {f: v for f, v in r.fields.items() if f not in where or not is_payload(v) or f in RESERVED}
        out.append(r._replace(fields=fields))
    return block, out, where


def value(block: Block, field: str, row: int) -> Any:
    """Row ``row`` of ``field`` in ``block`` (a zero-copy view for concatenated arrays)."""
    col = block[field]
    if col[0] == "cat":
        starts = col[2]
        return col[1][starts[row] : starts[row + 1]]
    return col[1][row]


class Loc:
    """Inside the controller: a value that lives in row ``row`` of a block held by ``holder``."""

    __slots__ = ("holder", "row")

    def __init__(self, holder: Holder, row: int) -> None:
        self.holder, self.row = holder, row


class Holder:
    """Keeps one block's ObjectRef alive: the object is freed when the last Loc pointing here is gone."""

    __slots__ = ("id", "ref")

    def __init__(self, block_id: int, ref: Any) -> None:
        self.id, self.ref = block_id, ref


def to_wire(data: dict[str, list[Any]]) -> tuple[dict[str, list[Any]], dict[str, tuple], dict[int, Any]]:
    """Controller side of a get: (data with Locs as None, field -> (indices, block ids, rows), block refs)."""
    where: dict[str, tuple] = {}
    refs: dict[int, Any] = {}
    out = {}
    for f, vals in data.items():
        ks, bids, rows = [], [], []
        col = vals
        for k, v in enumerate(vals):
            if isinstance(v, Loc):
                if not ks:
                    col = list(vals)
                ks.append(k)
                bids.append(v.holder.id)
                rows.append(v.row)
                refs[v.holder.id] = v.holder.ref
                col[k] = None
        out[f] = col
        if ks:
            where[f] = (ks, bids, rows)
    return out, where, refs


def from_wire(data: dict[str, list[Any]], where: dict[str, tuple], blocks: dict[int, Block]) -> None:
    """Client side of a get: fill the values that live in blocks (fetched already), in place."""
    for f, (ks, bids, rows) in where.items():
        col = data[f]
        for k, b, r in zip(ks, bids, rows):
            col[k] = value(blocks[b], f, r)
