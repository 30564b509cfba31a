"""Snapshot / restore of a whole bus to a directory, so a checkpointed run resumes exactly.

Layout: ``manifest.json`` (format, relax-bus version, counts: readable without unpickling) and ``state.pkl``
(pickle protocol 5: numpy arrays are written as raw buffers). Written to ``<path>.tmp`` then renamed, so a
crash mid-snapshot leaves the previous snapshot intact.

What is saved: config, every live sample (fields, partition, id), which consumers still wait for it, each
consumer's not-yet-taken set and acked ids and counters, the id and lease counters, the trainer version, the
field schema, the staleness histogram. Leases in flight are saved as *not delivered* (their ids go back to
the consumer's available set): the consumer that held them is gone after a restart, and its work was not
acknowledged, so delivering them again is what makes "nothing lost, nothing repeated" hold. The Ray backend
writes and reads the same format (it fetches the data out of the object store first).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

from relax_bus.errors import BusError
from relax_bus.state import Sample

FORMAT = 1


def export_state(bus: Any) -> dict[str, Any]:
    """Plain-data state of ``bus`` (lock held by the caller)."""
    from relax_bus._version import __version__

    consumers = {}
    for name, st in bus._consumers.items():
        available = set(st.available)
        for ls in bus._leases.values():
            if ls.consumer == name:
                available.update(ls.ids)  # in flight = not delivered
        consumers[name] = {
            "available": sorted(available),
            "dropped_groups": [[g, n] for g, n in st.dropped_groups.items()],
            "acked_ids": list(st.acked_ids),
            "counters": {
                k: getattr(st, k) for k in ("delivered", "acked", "redelivered", "dropped_stale", "gets")
            },
        }
    samples = [
        {
            "id": s.id,
            "partition": s.partition,
            "fields": dict(s.fields),
            "waiting": sorted(s.waiting),
            "lengths": dict(s.lengths),
            "size": s.size,
        }
        for s in sorted(bus._samples.values(), key=lambda s: s.id)
    ]
    return {
        "format": FORMAT,
        "relax_bus_version": __version__,
        "config": bus.config.model_dump(),
        "samples": samples,
        "consumers": consumers,
        "next_id": bus._next_id,
        "unused_ids": [list(h) for h in bus._holes],
        "next_lease": bus._next_lease,
        "trainer_version": bus._trainer_version,
        "schema": dict(bus._schema.sigs),
        "counts": dict(bus._counts),
        "staleness_hist": dict(bus._staleness_hist),
    }


def import_state(bus: Any, state: dict[str, Any]) -> None:
    """Load ``state`` into a freshly built ``bus`` (same config)."""
    for d in state["samples"]:
        f = d["fields"]
        s = Sample(
            d["id"],
            d["partition"],
            f,
            set(d["waiting"]),
            f.get("group_id"),
            f.get("group_size"),
            f.get("policy_version"),
            d["lengths"],
            d["size"],
        )
        bus._samples[s.id] = s
        bus._depth[s.partition] = bus._depth.get(s.partition, 0) + 1
        if bus._grouped:
            bus._groups.setdefault(s.group_id, []).append(s.id)
    for name, c in state["consumers"].items():
        st = bus._consumers[name]
        st.available = set(c["available"])
        # (pairs; a snapshot of bus 0.4.1 or older lists ids: their members still to come are unknown)
        st.dropped_groups = {g[0]: g[1] for g in c["dropped_groups"] if isinstance(g, list)}
        st.acked_ids = list(c["acked_ids"])
        for k, v in c["counters"].items():
            setattr(st, k, v)
    bus._next_id = state["next_id"]
    bus._holes = [list(h) for h in state.get("unused_ids", [])]  # (snapshots before 0.5: none)
    bus._next_lease = state["next_lease"]
    bus._trainer_version = state["trainer_version"]
    bus._schema.sigs.update(state["schema"])
    bus._counts.update(state["counts"])
    bus._staleness_hist.update(state["staleness_hist"])


def write(path: str | Path, state: dict[str, Any]) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "state.pkl", "wb") as f:
        pickle.dump(state, f, protocol=5)
    manifest = {
        "format": FORMAT,
        "relax_bus_version": state["relax_bus_version"],
        "live_samples": len(state["samples"]),
        "next_id": state["next_id"],
        "trainer_version": state["trainer_version"],
        "consumers": {n: len(c["acked_ids"]) for n, c in state["consumers"].items()},
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    with open(tmp / "state.pkl", "rb") as f:
        os.fsync(f.fileno())
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def read(path: str | Path, rename: dict[str, str] | None = None) -> dict[str, Any]:
    """The state a snapshot holds. ``rename``: consumers renamed since it was written (old -> new name), so
    a snapshot written under the old names restores into a bus configured with the new ones."""
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
            state = pickle.load(f)
    except Exception as e:  # noqa: BLE001 - truncated (EOFError, UnpicklingError), missing, anything else
        raise BusError(
            f"bus snapshot {path / 'state.pkl'} cannot be read ({type(e).__name__}: {e}): the snapshot is damaged"
        ) from None
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise BusError(
            f"bus snapshot {path / 'state.pkl'} is not a bus state (no {', '.join(missing)}): the snapshot is "
            "damaged or another file"
        )
    return rename_consumers(state, rename) if rename else state


_STATE_KEYS = (
    "config",
    "samples",
    "consumers",
    "next_id",
    "next_lease",
    "trainer_version",
    "schema",
    "counts",
    "staleness_hist",
)


def rename_consumers(state: dict[str, Any], rename: dict[str, str]) -> dict[str, Any]:
    """``state`` with each consumer ``old`` of ``rename`` called ``new``: in the config, the consumers'
    progress and every sample's set of consumers still waiting for it."""

    def new(name: str) -> str:
        return rename.get(name, name)

    state["config"]["consumers"] = {new(n): c for n, c in state["config"]["consumers"].items()}
    state["consumers"] = {new(n): c for n, c in state["consumers"].items()}
    for s in state["samples"]:
        s["waiting"] = sorted(new(n) for n in s["waiting"])
    return state


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
