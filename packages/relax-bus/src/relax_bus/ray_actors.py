"""The actors behind :class:`~relax_bus.RayBus`: one controller for metadata, storage units that own data.

Data path of a put above ``inline_bytes``: the producer validates its samples locally and packs their payload
(arrays, bytes, JSON) into one columnar block (``blocks.py``). With ``payload_owner="unit"`` (default) it
sends the block to a storage unit (round robin), which ``ray.put``\\ s it — so the object is owned by the
unit and survives the producer process — and registers the metadata plus one ObjectRef with the controller.
With ``payload_owner="producer"`` the producer ``ray.put``\\ s the block itself and registers it with the
controller in one call: one actor hop and one copy fewer, but the object dies with the producer process
(Ray >= 2.56 has no ``ray.put(_owner=...)``, and a borrowed ref held by the controller does not keep an
object alive once its owner is gone). A consumer gets metadata, ``(block, row)`` locations and the few block
refs of its batch from the controller and ``ray.get``\\ s the blocks straight from the object store
(zero-copy numpy on the same node). The controller never touches payload bytes; an object is freed when
the controller evicts the last sample that points into it. Small puts ride inline with the metadata.

The controller is a threaded actor hosting a :class:`~relax_bus.DataBus` whose values are :class:`Loc`\\ s:
its blocking calls wait on a ``threading.Condition`` on their own actor thread, so a consumer blocked in
``get`` never stalls a producer's ``put``, an ``ack`` or another consumer (up to ``max_concurrency`` calls).
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Any

from relax_bus import local
from relax_bus import snapshot as _snapshot
from relax_bus.blocks import Block, Holder, Loc, Wire, from_wire, pack, to_wire
from relax_bus.config import BusConfig
from relax_bus.core import DataBus
from relax_bus.prepare import Row, make_row
from relax_bus.state import Batch, ManualClock, SavedSample


def fetch(refs: dict[int, Any]) -> dict[int, Any]:
    """Block id -> block, with one ``ray.get``."""
    import ray

    if not refs:
        return {}
    return dict(zip(refs, ray.get(list(refs.values()))))


def _unwrap(ref: Any) -> Any:
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:  # re-raise the bus's own error type to the caller
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


class StorageUnit:
    """Owns payload objects (it ``ray.put``\\ s them); their bytes sit in the object store. Threaded."""

    def __init__(self) -> None:
        self.controller: Any = None  # the controller actor's handle, from attach

    def attach(self, controller: Any) -> bool:
        self.controller = controller
        return True

    def hold(self, block: Block) -> list[Any]:
        import ray

        return [ray.put(block)]

    def put(
        self,
        rows: list[Row],
        where: dict[str, list[int]],
        block: Block,
        partition: str,
        timeout: float | None,
        ids: list[int] | None,
    ) -> list[int]:
        put_ids: list[int] = _unwrap(
            self.controller.put_block.remote(rows, where, self.hold(block), partition, timeout, ids)
        )
        return put_ids

    def add(self, ids: list[int], rows: list[Row], where: dict[str, list[int]], block: Block) -> None:
        _unwrap(self.controller.add_block.remote(ids, rows, where, self.hold(block)))


# DataBus methods a RayBus reaches another way (get and the puts: payloads travel as blocks; restore) or
# not at all (a state holds payload locations, meaningless outside the controller: snapshot() fetches them)
_NOT_CALLABLE = frozenset({"restore", "ledger", "get", "state_dict", "load_state_dict"})


class Controller:
    """Metadata of one bus. Every public DataBus method is reached through :meth:`call`; processes on this
    node may also reach the same methods over the fast path's socket (``local.py``)."""

    LOCAL_METHODS = frozenset({"call", "put_block", "add_block", "get_local", "trainer_version"})

    def __init__(
        self, config: dict[str, Any], units: list[Any], manual_clock: bool = False, fast_local: bool = True
    ) -> None:
        import ray

        self.clock = ManualClock() if manual_clock else None
        self.bus = DataBus(BusConfig.model_validate(config), clock=self.clock)
        self.units = units
        self._block_ids = itertools.count()
        self._ids_lock = threading.Lock()
        self.local: dict[str, Any] | None = None
        if fast_local and hasattr(os, "pwritev"):  # no Unix sockets / pwritev (Windows): actor calls only
            local.remove_leftovers()
            self.server = local.Server(self, self.LOCAL_METHODS)
            shm = local.make_shm_dir()
            self.local = {
                "address": self.server.address,
                "authkey": self.server.authkey,
                "node_id": ray.get_runtime_context().get_node_id(),
                "shm_dir": shm and str(shm),
            }

    def handles(self) -> tuple[dict[str, Any], list[Any], dict[str, Any] | None]:
        return self.bus.config.model_dump(), self.units, self.local

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method.startswith("_") or method in _NOT_CALLABLE:
            raise AttributeError(f"RayBus has no method {method!r}")
        return getattr(self.bus, method)(*args, **kwargs)

    def _located(
        self, rows: list[Row], where: dict[str, list[int]], payload: list[Any] | str | None
    ) -> list[Row]:
        """Point the block values of ``rows`` at one block: ``payload`` is ``[ObjectRef]`` or a file path."""
        if not where:
            return rows
        assert payload is not None, "rows with block values come with their block"
        with self._ids_lock:
            bid = next(self._block_ids)
        holder = Holder(bid, path=payload) if isinstance(payload, str) else Holder(bid, ref=payload[0])
        for f, ks in where.items():
            for k in ks:
                rows[k].fields[f] = Loc(holder, k)
        return rows

    def put_block(
        self,
        rows: list[Row],
        where: dict[str, list[int]],
        payload: list[Any] | str | None,
        partition: str,
        timeout: float | None,
        ids: list[int] | None,
    ) -> list[int]:
        """``ledger.put_rows`` whose payload values sit in one block (``where``: field -> rows)."""
        return self.bus.ledger.put_rows(self._located(rows, where, payload), partition, timeout, ids)

    def add_block(
        self, ids: list[int], rows: list[Row], where: dict[str, list[int]], payload: list[Any] | str | None
    ) -> None:
        return self.bus.ledger.add_rows(ids, self._located(rows, where, payload))

    def get(self, consumer: str, n: int, **kwargs: Any) -> tuple[Batch, Wire, dict[int, Any]]:
        """A batch whose block values are replaced by locations, plus the ObjectRefs of those blocks."""
        batch = self.bus.get(consumer, n, **kwargs)
        batch.data, where, holders = to_wire(batch.data)
        return batch, where, {bid: self._ref(h) for bid, h in holders.items()}

    def get_local(self, consumer: str, n: int, **kwargs: Any) -> tuple[Batch, Wire, dict[int, str]]:
        """Fast-path get: like :meth:`get`, with block file paths instead of ObjectRefs."""
        batch = self.bus.get(consumer, n, **kwargs)
        batch.data, where, holders = to_wire(batch.data)
        return batch, where, {bid: self._path(h) for bid, h in holders.items()}

    def _ref(self, h: Holder) -> Any:
        """The block as an object (a block that came by the fast path is put in the store on first demand)."""
        import ray

        if h.ref is None:
            assert h.path is not None, "a holder keeps its block as an object or a file"
            h.ref = ray.put(local.read_block(h.path))
        return h.ref

    def _path(self, h: Holder) -> str:
        """The block as a file (a block that came through the object store is written out on first demand)."""
        import ray

        if h.path is None:
            shm = self.local and self.local["shm_dir"]
            assert shm, "get_local needs this node's payload directory (RayBus.get checks it has one)"
            h.path = local.write_block(shm, ray.get(h.ref))
        return h.path

    def _blocks(self, holders: dict[int, Holder]) -> dict[int, Any]:
        files = {bid: local.read_block(h.path) for bid, h in holders.items() if h.path}
        return {**fetch({bid: h.ref for bid, h in holders.items() if not h.path}), **files}

    def trainer_version(self) -> int:
        return self.bus.trainer_version

    def advance_clock(self, seconds: float) -> None:
        """Tests only (``create(..., manual_clock=True)``): move lease deadlines forward."""
        assert self.clock is not None, "advance_clock needs a bus created with manual_clock=True"
        self.clock.advance(seconds)  # (the bus watches its clock: its waiters re-check)

    def snapshot(self, path: str) -> str:
        """Same format as DataBus.snapshot; payloads are fetched out of the object store first."""
        state = self.bus.state_dict()
        names = list(dict.fromkeys(f for s in state.samples for f in s.fields))
        cols = {f: [s.fields.get(f) for s in state.samples] for f in names}
        cols, where, holders = to_wire(cols)
        from_wire(cols, where, self._blocks(holders))
        for k, s in enumerate(state.samples):
            s.fields = {f: cols[f][k] for f in s.fields}
        return str(_snapshot.write(path, state))

    def load(self, path: str, inline_bytes: int) -> None:
        """Fill this (fresh) bus from the snapshot at ``path``: payloads go back into blocks, as a put's."""
        import ray

        state = _snapshot.read(Path(path))
        chunk = 256
        for start in range(0, len(state.samples), chunk):
            part = state.samples[start : start + chunk]
            rows = [_saved_row(s) for s in part]
            block, rows, where = pack(rows, inline_bytes)
            if block is not None and self.local and self.local["shm_dir"]:
                rows = self._located(rows, where, local.write_block(self.local["shm_dir"], block))
            elif block is not None:
                unit = self.units[(start // chunk) % len(self.units)]
                rows = self._located(rows, where, ray.get(unit.hold.remote(block)))
            for s, r in zip(part, rows):
                s.fields = r.fields
        self.bus.load_state_dict(state)


def _saved_row(s: SavedSample) -> Row:
    """A saved sample as a prepared row, its size as saved (that of its values when first put)."""
    row = make_row(dict(s.fields), "", None)
    return Row(row.fields, row.sigs, row.lengths, s.size)
