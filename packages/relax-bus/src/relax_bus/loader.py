"""StreamingDataLoader: micro-batches for a training loop as soon as they are ready on the bus.

The trainer starts on the first micro-batch while rollout is still writing the rest. Each micro-batch is
acknowledged when the loop asks for the next one (or on ``close``/``ack_pending``), so a crash mid-step
leaves it leased and it is delivered again. Collation: ``"pad"`` stacks each variable-length array field
into ``[B, max_len, ...]`` padded with ``pad_value`` plus ``<field>_lengths``; ``"pack"`` concatenates them
into ``[total, ...]`` plus ``<field>_cu_seqlens``; ``None`` yields the Batch as is. Arrays become torch
tensors when torch is installed (``to_torch=None`` = auto), numpy otherwise; other fields stay lists.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from relax_bus.errors import BusClosed
from relax_bus.state import Batch

if TYPE_CHECKING:
    from relax_bus.protocol import Bus


def pad(values: list[Any], pad_value: float = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """``[B, max_len, ...]`` and lengths for a list of arrays with equal trailing dims; None if not arrays."""
    if not values or not all(isinstance(v, np.ndarray) and v.ndim >= 1 for v in values):
        return None
    lengths = np.array([v.shape[0] for v in values], dtype=np.int64)
    out = np.full((len(values), int(lengths.max()), *values[0].shape[1:]), pad_value, dtype=values[0].dtype)
    for i, v in enumerate(values):
        out[i, : v.shape[0]] = v
    return out, lengths


def pack(values: list[Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """``[sum(len), ...]`` and cumulative offsets ``[0, l0, l0+l1, ...]``; None if not arrays."""
    if not values or not all(isinstance(v, np.ndarray) and v.ndim >= 1 for v in values):
        return None
    cu = np.zeros(len(values) + 1, dtype=np.int64)
    cu[1:] = np.cumsum([v.shape[0] for v in values])
    return np.concatenate(values), cu


def collate(
    batch: Batch, mode: Literal["pad", "pack"] = "pad", pad_value: float = 0, to_torch: bool | None = None
) -> dict[str, Any]:
    """A Batch's columns as arrays (see module docstring); ``ids`` and ``lease_id`` are included."""
    if to_torch is None:
        to_torch = importlib.util.find_spec("torch") is not None
    out: dict[str, Any] = {"ids": list(batch.ids), "lease_id": batch.lease_id}
    for name, values in batch.data.items():
        done = pad(values, pad_value) if mode == "pad" else pack(values)
        if done is not None:
            out[name] = done[0]
            out[f"{name}_{'lengths' if mode == 'pad' else 'cu_seqlens'}"] = done[1]
        elif values and all(
            isinstance(v, int | float | np.generic) and not isinstance(v, bool) for v in values
        ):
            out[name] = np.asarray(values)
        else:
            out[name] = values
    if to_torch:
        import torch

        out = {
            k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
            for k, v in out.items()
        }
    return out


class StreamingDataLoader:
    """``for mb in StreamingDataLoader(bus, "actor", micro_batch_size=8, total=64): ...``

    Yields up to ``total`` samples (None = until the bus closes) in micro-batches of ``micro_batch_size``
    (partial ones as soon as anything is ready when ``partial=True``). ``timeout`` bounds each wait.
    """

    def __init__(
        self,
        bus: Bus,
        consumer: str,
        micro_batch_size: int,
        total: int | None = None,
        fields: list[str] | None = None,
        collate_mode: Literal["pad", "pack"] | None = "pad",
        pad_value: float = 0,
        partial: bool = False,
        timeout: float | None = None,
        trainer_version: int | None = None,
        to_torch: bool | None = None,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 (got {micro_batch_size})")
        self.bus, self.consumer, self.mbs, self.total = bus, consumer, micro_batch_size, total
        self.fields, self.mode, self.pad_value, self.partial = fields, collate_mode, pad_value, partial
        self.timeout, self.trainer_version, self.to_torch = timeout, trainer_version, to_torch
        self.seen = 0
        self._pending: int | None = None

    def ack_pending(self) -> None:
        """Acknowledge the last yielded micro-batch now (done automatically on the next one)."""
        if self._pending is not None:
            lease, self._pending = self._pending, None
            self.bus.ack(self.consumer, lease)

    def __iter__(self) -> Iterator[Any]:
        while self.total is None or self.seen < self.total:
            n = self.mbs if self.total is None else min(self.mbs, self.total - self.seen)
            self.ack_pending()
            try:
                batch = self.bus.get(
                    self.consumer,
                    n,
                    fields=self.fields,
                    timeout=self.timeout,
                    partial=self.partial,
                    trainer_version=self.trainer_version,
                )
            except BusClosed:
                return
            self._pending = batch.lease_id
            self.seen += len(batch)
            yield batch if self.mode is None else collate(batch, self.mode, self.pad_value, self.to_torch)
        self.ack_pending()
