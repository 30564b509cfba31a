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

import os
from typing import Any, TypeAlias

import numpy as np

from relax_bus.prepare import Row

Block: TypeAlias = dict[str, tuple[Any, ...]]
"""field -> ``("cat", data, starts)`` (row k is ``data[starts[k]:starts[k+1]]``) or ``("list", values)``."""

Wire: TypeAlias = dict[str, tuple[list[int], list[int], list[int]]]
"""Where a get's block values are: field -> (indices in the batch, their block ids, their rows there)."""


RESERVED = ("group_id", "policy_version", "group_size")


def is_payload(value: Any) -> bool:
    """Values that travel in a block; scalars and short strings stay inline with the metadata."""
    if isinstance(value, np.ndarray | bytes | dict | list | tuple):
        return True
    return isinstance(value, str) and len(value) > 256


def pack(
    rows: list[Row], inline_bytes: int, concat: bool = True
) -> tuple[Block | None, list[Row], dict[str, list[int]]]:
    """Split prepared rows into (block or None if small, rows without block values, field -> rows in block).

    The block's values are taken out of the rows' field dicts in place (those dicts belong to the rows).

    ``concat=False`` leaves a ``"cat"`` column's data as the list of row arrays, for a writer that lays them
    out back to back itself (``local.write_block``: one copy instead of two).
    """
    if sum(r.size for r in rows) <= inline_bytes:
        return None, rows, {}
    where: dict[str, list[int]] = {}
    moved: list[list[str]] = []  # per row: its fields that go into the block
    by_sigs: dict[int, list[str]] = {}  # rows sharing one signature dict (prepare_*) move the same fields
    for k, r in enumerate(rows):
        mine = by_sigs.get(id(r.sigs))
        if mine is None:
            mine = [f for f, v in r.fields.items() if is_payload(v) and f not in RESERVED]
            if not any(sig[0] == "str" for sig in r.sigs.values()):  # str: by length, per value
                by_sigs[id(r.sigs)] = mine
        moved.append(mine)  # (RESERVED: the controller reads those, e.g. a tuple group_id)
        for f in mine:
            where.setdefault(f, []).append(k)
    if not where:
        return None, rows, {}
    block: Block = {}
    n = len(rows)
    for f, ks in where.items():
        vals = [rows[k].fields[f] for k in ks]
        sig = rows[ks[0]].sigs[f]
        if len(ks) == n and sig[0] == "array" and sig[2] >= 1 and all(r.sigs[f] == sig for r in rows):
            starts = np.zeros(n + 1, dtype=np.int64)
            np.cumsum([r.lengths[f] for r in rows], out=starts[1:])
            keep = concat or sig[1].endswith("O")  # object arrays are pickled, never laid out raw
            block[f] = ("cat", np.concatenate(vals) if keep else vals, starts)
        else:
            col: list[Any] = [None] * n
            for k, v in zip(ks, vals):
                col[k] = v
            block[f] = ("list", col)
    for r, mine in zip(rows, moved):  # the rows' field dicts are the caller's own (made by prepare_*)
        for f in mine:
            del r.fields[f]
    return block, rows, where


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
    """Keeps one block alive: its ObjectRef, or its shared-memory file (``local.py``), or both. The object is
    freed, and the file unlinked, when the last Loc pointing here is gone."""

    __slots__ = ("id", "ref", "path")

    def __init__(self, block_id: int, ref: Any = None, path: str | None = None) -> None:
        self.id, self.ref, self.path = block_id, ref, path

    def __del__(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except (FileNotFoundError, TypeError):  # TypeError: interpreter shutdown
                pass


def to_wire(data: dict[str, list[Any]]) -> tuple[dict[str, list[Any]], Wire, dict[int, Holder]]:
    """Controller side of a get: (data with Locs as None, field -> (indices, block ids, rows), holders)."""
    where: Wire = {}
    holders: dict[int, Holder] = {}
    out = {}
    for f, vals in data.items():
        ks: list[int] = []
        bids: list[int] = []
        rows: list[int] = []
        col = vals
        for k, v in enumerate(vals):
            if isinstance(v, Loc):
                if not ks:
                    col = list(vals)
                ks.append(k)
                bids.append(v.holder.id)
                rows.append(v.row)
                holders[v.holder.id] = v.holder
                col[k] = None
        out[f] = col
        if ks:
            where[f] = (ks, bids, rows)
    return out, where, holders


def from_wire(data: dict[str, list[Any]], where: Wire, blocks: dict[int, Block]) -> None:
    """Client side of a get: fill the values that live in blocks (fetched already), in place."""
    for f, (ks, bids, rows) in where.items():
        col = data[f]
        for k, b, r in zip(ks, bids, rows):
            col[k] = value(blocks[b], f, r)
