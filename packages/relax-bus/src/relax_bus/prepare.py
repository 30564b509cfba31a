"""Input validation that needs no bus state, shared by the in-process bus and the Ray client.

Everything a put or add_fields could get wrong about one value (type, reserved-field rules, sample size) is
checked here, before any lock is taken or any byte is shipped, so that a bad call leaves the bus unchanged
and the error names the field and the sample. Checks that need bus state (schema of earlier writes, ids,
group sizes) happen in the bus, still before anything is written.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from relax_bus.config import BusConfig
from relax_bus.errors import BusError
from relax_bus.samplers import GROUPED_SAMPLERS
from relax_bus.values import Sig, length_of, nbytes, signature, to_value

RESERVED_FIELDS = ("group_id", "policy_version", "group_size")


class Row(NamedTuple):
    """One validated sample (or the new fields of one sample): values, their signatures, lengths, bytes."""

    fields: dict[str, Any]
    sigs: dict[str, Sig]
    lengths: dict[str, int]
    size: int


def grouped_consumers(cfg: BusConfig) -> list[str]:
    return [
        n
        for n, s in cfg.consumers.items()
        if s.sampler in GROUPED_SAMPLERS or s.sampler_options.get("grouped")
    ]


def versioned_consumers(cfg: BusConfig) -> list[str]:
    return [n for n, s in cfg.consumers.items() if s.enforce_staleness]


_NUMBER = ("number",)
_DTYPE_STR: dict[Any, str] = {}  # dtype -> its .str (a property that builds a new string on every access)


def make_row(
    fields: dict[str, Any], where: str, limit: int | None, base: int = 0, prev: dict[str, Sig] | None = None
) -> Row:
    sigs: dict[str, Sig] = {}
    lengths: dict[str, int] = {}
    size = base
    for name, value in fields.items():
        if type(value) is np.ndarray:  # fast path for the common case (same results as below)
            shape, dt = value.shape, value.dtype
            ds = _DTYPE_STR.get(dt) or _DTYPE_STR.setdefault(dt, dt.str)
            sigs[name] = ("array", ds, len(shape), shape[1:])
            lengths[name] = shape[0] if shape else 1
            size += value.nbytes
            continue
        if type(value) is float:
            sigs[name] = _NUMBER
            continue
        sigs[name] = signature(value)
        n = length_of(value)
        if n is not None:
            lengths[name] = n
        size += nbytes(value)
    if limit is not None and size > limit:
        big = max(fields, key=lambda f: nbytes(fields[f]))
        raise BusError(
            f"{where} would be {size} bytes, over BusConfig.max_sample_bytes={limit} (largest field {big!r}: "
            f"{nbytes(fields[big])} bytes)"
        )
    if prev is not None and sigs == prev:  # rows with equal signatures share one dict: less to pickle
        sigs = prev
    return Row(fields, sigs, lengths, size)


def _check_sample(sample: Any, index: int, grouped: list[str], versioned: list[str]) -> None:
    where = f"sample {index}"
    if not isinstance(sample, dict):
        raise BusError(f"{where}: expected a dict of field -> value, got {type(sample).__name__}")
    if grouped and "group_id" not in sample:
        raise BusError(f"{where} has no 'group_id' (required: consumer {grouped[0]!r} samples whole groups)")
    if "group_id" in sample and not isinstance(sample["group_id"], Hashable):
        raise BusError(f"{where}: 'group_id' must be hashable, got {type(sample['group_id']).__name__}")
    if versioned and sample.get("policy_version") is None:
        raise BusError(
            f"{where} has no 'policy_version' (required: consumer {versioned[0]!r} enforces staleness)"
        )
    for key in ("policy_version", "group_size"):
        v = sample.get(key)
        low = 1 if key == "group_size" else 0
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
            raise BusError(f"{where}: {key!r} must be an int >= {low}, got {v!r}")


def prepare_samples(cfg: BusConfig, samples: list[dict[str, Any]]) -> list[Row]:
    """Validate and convert the samples of a put; raise BusError naming the sample and field.

    The loop is the hot path of every put (tens of thousands of samples a second), so it only does cheap
    checks per sample and leaves the messages to :func:`_check_sample`.
    """
    if not isinstance(samples, list | tuple):
        raise BusError(f"put: expected a list of samples (dicts), got {type(samples).__name__}")
    grouped, versioned = grouped_consumers(cfg), versioned_consumers(cfg)
    limit = cfg.max_sample_bytes
    rows: list[Row] = []
    for index, sample in enumerate(samples):
        if (
            type(sample) is not dict
            or (grouped and "group_id" not in sample)
            or (versioned and "policy_version" not in sample)
            or "group_id" in sample
            or "policy_version" in sample
            or "group_size" in sample
        ):
            _check_sample(sample, index, grouped, versioned)
        fields = {}
        for name, value in sample.items():
            if type(name) is not str or not name:
                raise BusError(f"sample {index}: field names must be non-empty str, got {name!r}")
            fields[name] = value if type(value) is np.ndarray else to_value(value, name, f"sample {index}")
        where = f"sample {index}" if limit is not None else ""
        rows.append(make_row(fields, where, limit, prev=rows[-1].sigs if rows else None))
    return rows


def prepare_fields(ids: list[int], fields: dict[str, list[Any]]) -> list[Row]:
    """Validate add_fields arguments; one Row per id holding only the new fields."""
    if not isinstance(fields, dict):
        raise BusError(f"add_fields: expected a dict of field -> list of values, got {type(fields).__name__}")
    ids = list(ids)
    for sid in ids:
        if not isinstance(sid, int) or isinstance(sid, bool):
            raise BusError(f"add_fields: sample ids must be ints, got {sid!r}")
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise BusError(f"add_fields: duplicate sample id {dup} in ids")
    for name, values in fields.items():
        if not isinstance(name, str) or not name:
            raise BusError(f"add_fields: field names must be non-empty str, got {name!r}")
        if name in RESERVED_FIELDS:
            raise BusError(f"field {name!r} is reserved and can only be set by put")
        if len(values) != len(ids):
            raise BusError(f"add_fields: field {name!r} has {len(values)} values for {len(ids)} ids")
    return [
        make_row(
            {n: to_value(vals[k], n, f"sample id {sid}") for n, vals in fields.items()},
            f"sample id {sid}",
            None,
        )
        for k, sid in enumerate(ids)
    ]
