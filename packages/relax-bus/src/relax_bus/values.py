"""What a sample field may hold, how big it is, and the per-field schema a bus enforces.

The bus stores values as given (no copy, no serialisation) so an in-process bus costs nothing per field; the
flip side is that values are shared between consumers and must be treated as read-only. Only plain, picklable
types are accepted so the same samples can cross a Ray boundary or go into a snapshot. torch tensors are
converted to numpy, but only when the user already imported torch: the bus itself never imports it.

Schema: the first write of a field fixes its *signature* (kind; for arrays dtype, rank and trailing shape — the
first dimension may vary, e.g. token sequences). Later writes must match or are refused with an error naming
the field and the sample, before anything is written. ``None`` matches every signature.
"""

from __future__ import annotations

import sys
from typing import Any, TypeAlias

import numpy as np

from relax_bus.errors import BusError

PLAIN_TYPES = (np.ndarray, np.generic, bool, int, float, str, bytes, dict, list, tuple, type(None))

Sig: TypeAlias = tuple[Any, ...]
"""``("array", dtype, ndim, trailing_shape)``, ``("number",)``, ``("bool",)``, ``("str",)``, ``("bytes",)``,
``("json",)``, ``("scalar", dtype)`` or ``("none",)``."""


def to_value(value: Any, field: str, where: str) -> Any:
    """Return ``value`` as stored on the bus, or raise BusError naming ``field`` and ``where`` it came from."""
    if isinstance(value, PLAIN_TYPES):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        try:
            return value.detach().cpu().numpy()
        except TypeError as e:  # e.g. bfloat16 has no numpy dtype
            raise BusError(
                f"field {field!r} of {where}: cannot convert torch tensor of dtype {value.dtype} to numpy "
                f"({e}); cast it first, e.g. tensor.float()"
            ) from None
    raise BusError(
        f"field {field!r} of {where}: unsupported type {type(value).__name__}; use a numpy array, "
        "a python scalar, str, bytes, dict or list"
    )


def nbytes(value: Any) -> int:
    """Payload size for stats and limits: numpy nbytes, len of bytes/str, 0 for anything else."""
    if isinstance(value, np.ndarray | np.generic):
        return int(value.nbytes)
    if isinstance(value, bytes | str):
        return len(value)
    return 0


def signature(value: Any) -> Sig:
    """The schema signature of one stored value."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.ndim, tuple(value.shape[1:]))
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str)
    if isinstance(value, bool):
        return ("bool",)
    if isinstance(value, int | float):
        return ("number",)
    if isinstance(value, str):
        return ("str",)
    if isinstance(value, bytes):
        return ("bytes",)
    if value is None:
        return ("none",)
    return ("json",)


def describe(sig: Sig) -> str:
    if sig[0] == "array":
        trail = "".join(f"[{d}]" for d in sig[3])
        return f"array {np.dtype(sig[1]).name}[...]{trail} (ndim {sig[2]})"
    if sig[0] == "scalar":
        return f"numpy scalar {np.dtype(sig[1]).name}"
    kind: str = sig[0]
    return kind


def length_of(value: Any) -> int | None:
    """Length used by token-budget / balanced samplers: first dim of an array, len of a sequence, an int's value."""
    if isinstance(value, np.ndarray):
        return int(value.shape[0]) if value.ndim else 1
    if isinstance(value, bytes | str | list | tuple):
        return len(value)
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return int(value)
    return None


class Schema:
    """Field name -> signature, fixed by the first write; optionally a closed set of allowed names."""

    def __init__(self, allowed: list[str] | None = None, reserved: tuple[str, ...] = ()) -> None:
        self.sigs: dict[str, Sig] = {}
        self.allowed = None if allowed is None else set(allowed) | set(reserved)

    def check(self, name: str, sig: Sig, where: str, pending: dict[str, Sig] | None = None) -> None:
        """Raise BusError if ``sig`` conflicts with the field's signature (or with ``pending`` writes)."""
        if self.allowed is not None and name not in self.allowed:
            raise BusError(
                f"unknown field {name!r} on {where}; BusConfig.fields allows {sorted(self.allowed)}"
            )
        if sig == ("none",):
            return
        known = self.sigs.get(name) or (pending or {}).get(name)
        if known is None or known == sig:
            return
        if known[0] == "array" and sig[0] == "array":
            what = "dtype" if known[1] != sig[1] else "shape"
            raise BusError(
                f"field {name!r} of {where}: {what} mismatch, got {describe(sig)} but earlier samples have "
                f"{describe(known)}"
            )
        raise BusError(
            f"field {name!r} of {where}: got {describe(sig)} but earlier samples have {describe(known)}"
        )

    def check_rows(
        self, rows: list[dict[str, Sig]], where: str, labels: list[Any] | None = None
    ) -> dict[str, Sig]:
        """Check a whole put/add_fields against the schema and itself; returns the new signatures.

        Errors name ``where.format(labels[k])`` (``labels`` default: row indices). Rows with the same
        signatures are checked once (a put's rows usually share them).
        """
        pending: dict[str, Sig] = {}
        seen: set[tuple[tuple[str, Sig], ...]] = set()
        for k, sigs in enumerate(rows):
            key = tuple(sigs.items())
            if key in seen:
                continue
            seen.add(key)
            label = where.format(k if labels is None else labels[k])
            for name, sig in sigs.items():
                self.check(name, sig, label, pending)
                if sig != ("none",) and name not in self.sigs:
                    pending.setdefault(name, sig)
        return pending

    def commit(self, new: dict[str, Sig]) -> None:
        for name, sig in new.items():
            self.sigs.setdefault(name, sig)
