"""What a sample field may hold, and how big it is.

The bus stores values as given (no copy, no serialisation) so an in-process bus costs nothing per field; the
flip side is that values are shared between consumers and must be treated as read-only. Only plain, picklable
types are accepted so the same samples can cross a Ray boundary. torch tensors are converted to numpy, but
only when the user already imported torch: the bus itself never imports it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from relax_bus.errors import BusError

PLAIN_TYPES = (np.ndarray, np.generic, bool, int, float, str, bytes, dict, list, tuple, type(None))


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
    """Payload size for stats: numpy nbytes, len of bytes/str, 0 for anything else."""
    if isinstance(value, np.ndarray | np.generic):
        return int(value.nbytes)
    if isinstance(value, bytes | str):
        return len(value)
    return 0
