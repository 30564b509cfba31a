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
import threading
from pathlib import Path
from typing import Any

from relax_bus import snapshot as _snapshot
from relax_bus.blocks import Holder, Loc, from_wire, pack, to_wire
from relax_bus.config import BusConfig
from relax_bus.core import DataBus
from relax_bus.prepare import Row
from relax_bus.state import ManualClock


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
        self.controller = None

    def attach(self, controller: Any) -> bool:
        self.controller = controller
        return True

    def hold(self, block: dict) -> list[Any]:
        import ray

        return [ray.put(block)]

    def put(
        self, rows: list[Row], where: dict, block: dict, partition: str, timeout: Any, ids: Any
    ) -> list[int]:
        return _unwrap(
            self.controller.put_block.remote(rows, where, self.hold(block), partition, timeout, ids)
        )

    def add(self, ids: list[int], rows: list[Row], where: dict, block: dict) -> None:
        return _unwrap(self.controller.add_block.remote(ids, rows, where, self.hold(block)))


class Controller:
    """Metadata of one bus. Every public DataBus method is reached through :meth:`call`."""

    def __init__(self, config: dict[str, Any], units: list[Any], manual_clock: bool = False) -> None:
        self.clock = ManualClock() if manual_clock else None
        self.bus = DataBus(BusConfig.model_validate(config), clock=self.clock)
        self.units = units
        self._block_ids = itertools.count()
        self._ids_lock = threading.Lock()

    def handles(self) -> tuple[dict[str, Any], list[Any]]:
        return self.bus.config.model_dump(), self.units

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method.startswith("_") or method in ("restore", "put_rows", "add_rows", "get"):
            raise AttributeError(f"RayBus has no method {method!r}")
        return getattr(self.bus, method)(*args, **kwargs)

    def _located(self, rows: list[Row], where: dict[str, list[int]], refs: list[Any] | None) -> list[Row]:
        if not where:
            return rows
        with self._ids_lock:
            holder = Holder(next(self._block_ids), refs[0])
        for f, ks in where.items():
            for k in ks:
                rows[k].fields[f] = Loc(holder, k)
        return rows

    def put_block(self, rows: list[Row], where: dict, refs: list | None, partition: str, timeout: Any,
                  ids: Any) -> list[int]:  # fmt: skip
        """put_rows whose payload values sit in one block (``where``: field -> rows); refs = [block ref]."""
        return self.bus.put_rows(self._located(rows, where, refs), partition, timeout, ids)

    def add_block(self, ids: list[int], rows: list[Row], where: dict, refs: list | None) -> None:
        return self.bus.add_rows(ids, self._located(rows, where, refs))

    def get(self, consumer: str, n: int, **kwargs: Any) -> tuple[Any, dict, dict]:
        """A batch whose block values are replaced by locations, plus the refs of those blocks."""
        batch = self.bus.get(consumer, n, **kwargs)
        batch.data, where, refs = to_wire(batch.data)
        return batch, where, refs

    def trainer_version(self) -> int:
        return self.bus.trainer_version

    def advance_clock(self, seconds: float) -> None:
        """Tests only (``create(..., manual_clock=True)``): move lease deadlines forward."""
        self.clock.advance(seconds)
        with self.bus._cond:
            self.bus._cond.notify_all()

    def snapshot(self, path: str) -> str:
        """Same format as DataBus.snapshot; payloads are fetched out of the object store first."""
        with self.bus._cond:
            state = _snapshot.export_state(self.bus)
        names = list(dict.fromkeys(f for s in state["samples"] for f in s["fields"]))
        cols = {f: [s["fields"].get(f) for s in state["samples"]] for f in names}
        cols, where, refs = to_wire(cols)
        from_wire(cols, where, fetch(refs))
        for k, s in enumerate(state["samples"]):
            s["fields"] = {f: cols[f][k] for f in s["fields"]}
        return str(_snapshot.write(path, state))

    def load(self, path: str, inline_bytes: int) -> None:
        import ray

        state = _snapshot.read(Path(path))
        chunk = 256
        for start in range(0, len(state["samples"]), chunk):
            part = state["samples"][start : start + chunk]
            rows = [Row(dict(s["fields"]), {}, {}, s["size"]) for s in part]
            block, rows, where = pack(rows, inline_bytes)
            if block is not None:
                unit = self.units[(start // chunk) % len(self.units)]
                rows = self._located(rows, where, ray.get(unit.hold.remote(block)))
            for s, r in zip(part, rows):
                s["fields"] = r.fields
        with self.bus._cond:
            _snapshot.import_state(self.bus, state)
