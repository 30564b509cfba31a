"""Snapshot / restore of a whole bus to a directory, so a checkpointed run resumes exactly.

Layout: ``manifest.json`` (format, relax-bus version, counts: readable without unpickling) and ``state.pkl``
(pickle protocol 5: numpy arrays are written as raw buffers). Written to ``<path>.tmp`` then renamed, so a
crash mid-snapshot leaves the previous snapshot intact.

What is saved is a :class:`~relax_bus.state.BusState` (``DataBus.state_dict``): config, every live sample,
each consumer's progress, the id and lease counters, the trainer version, the field schema, the staleness
histogram; leases in flight count as not delivered. It is pickled as plain data (dicts and lists, no relax-bus
class), so a snapshot does not depend on where the records live in the code. The Ray backend writes and reads
the same format (its controller fetches the data out of the object store first).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

from relax_bus._version import __version__
from relax_bus.config import BusConfig
from relax_bus.errors import BusError
from relax_bus.state import BusState, SavedConsumer, SavedSample

FORMAT = 1
_COUNTERS = ("delivered", "acked", "redelivered", "dropped_stale", "gets")


def write(path: str | Path, state: BusState) -> Path:
    """Write ``state`` to directory ``path`` (replacing what is there, atomically); returns ``path``."""
    path = Path(path)
    record = _to_record(state)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "state.pkl", "wb") as f:
        pickle.dump(record, f, protocol=5)
    manifest = {
        "format": FORMAT,
        "relax_bus_version": record["relax_bus_version"],
        "live_samples": len(state.samples),
        "next_id": state.next_id,
        "trainer_version": state.trainer_version,
        "consumers": {n: len(c.acked_ids) for n, c in state.consumers.items()},
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with open(tmp / "state.pkl", "rb") as f:
        os.fsync(f.fileno())
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def read(path: str | Path) -> BusState:
    """The state a snapshot holds; a missing, damaged or foreign one is a BusError naming the file."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise BusError(f"no bus snapshot at {path} (expected {path / 'manifest.json'})")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except ValueError as e:
        raise BusError(
            f"bus snapshot {path / 'manifest.json'} is not JSON ({e}): the snapshot is damaged"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise BusError(f"bus snapshot {path} has format {got}, this relax-bus reads {FORMAT}")
    try:
        with open(path / "state.pkl", "rb") as f:
            record = pickle.load(f)
    except Exception as e:  # noqa: BLE001 - truncated (EOFError, UnpicklingError), missing, anything else
        raise BusError(
            f"bus snapshot {path / 'state.pkl'} cannot be read ({type(e).__name__}: {e}): the snapshot is damaged"
        ) from None
    missing = [k for k in _STATE_KEYS if not isinstance(record, dict) or k not in record]
    if missing:
        raise BusError(
            f"bus snapshot {path / 'state.pkl'} is not a bus state (no {', '.join(missing)}): the snapshot is "
            "damaged, another file, or written by a relax-bus older than explicit ids (no unused_ids)"
        )
    try:  # (whole and listed in its checkpoint's manifest, yet of another shape inside: a traceback before)
        return _from_record(record)
    except Exception as e:  # noqa: BLE001 - KeyError, TypeError, ValueError, pydantic's: all say "damaged"
        what = str(e).splitlines()[0] if str(e) else ""
        raise BusError(
            f"bus snapshot {path / 'state.pkl'} is not a bus state inside ({type(e).__name__}: {what}): the "
            "snapshot is damaged; resume from an earlier checkpoint"
        ) from None


_STATE_KEYS = (
    "config",
    "samples",
    "consumers",
    "next_id",
    "unused_ids",
    "next_lease",
    "trainer_version",
    "schema",
    "counts",
    "staleness_hist",
)


def _to_record(state: BusState) -> dict[str, Any]:
    """``state`` as the plain data pickled into ``state.pkl``."""
    return {
        "format": FORMAT,
        "relax_bus_version": __version__,
        "config": state.config.model_dump(),
        "samples": [
            {
                "id": s.id,
                "partition": s.partition,
                "fields": s.fields,
                "waiting": list(s.waiting),
                "lengths": s.lengths,
                "size": s.size,
            }
            for s in state.samples
        ],
        "consumers": {
            name: {
                "available": list(c.available),
                "dropped_groups": [[g, n] for g, n in c.dropped_groups.items()],
                "acked_ids": list(c.acked_ids),
                "counters": {k: getattr(c, k) for k in _COUNTERS},
            }
            for name, c in state.consumers.items()
        },
        "next_id": state.next_id,
        "unused_ids": [list(h) for h in state.unused_ids],
        "next_lease": state.next_lease,
        "trainer_version": state.trainer_version,
        "schema": dict(state.schema),
        "counts": dict(state.counts),
        "staleness_hist": dict(state.staleness_hist),
    }


def _from_record(r: dict[str, Any]) -> BusState:
    """The :class:`BusState` of a record read from ``state.pkl``."""
    return BusState(
        config=BusConfig.model_validate(r["config"]),
        samples=[
            SavedSample(s["id"], s["partition"], s["fields"], list(s["waiting"]), s["lengths"], s["size"])
            for s in r["samples"]
        ],
        consumers={
            name: SavedConsumer(
                list(c["available"]),
                {g: n for g, n in c["dropped_groups"]},
                list(c["acked_ids"]),
                **{k: c["counters"][k] for k in _COUNTERS},
            )
            for name, c in r["consumers"].items()
        },
        next_id=r["next_id"],
        unused_ids=[list(h) for h in r["unused_ids"]],
        next_lease=r["next_lease"],
        trainer_version=r["trainer_version"],
        schema=dict(r["schema"]),
        counts=dict(r["counts"]),
        staleness_hist=dict(r["staleness_hist"]),
    )


def flatten(stats: dict[str, Any], prefix: str) -> dict[str, float]:
    """Nested stats -> flat ``{prefix + "a/b": number}`` (bools and numbers only)."""
    out: dict[str, float] = {}

    def walk(d: dict[str, Any], p: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{p}{k}/")
            elif isinstance(v, bool | int | float):
                out[f"{p}{k}"] = float(v)

    walk(stats, prefix)
    return out
