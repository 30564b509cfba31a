"""asyncio API: ``AsyncBus(bus)`` wraps a DataBus or RayBus with the same methods as coroutines.

Why threads: both backends block on a condition (in-process, or in the controller actor), and a thread per
pending call keeps the event loop free. A blocking ``get`` waits in short slices so that cancelling the
awaiting task takes effect within ``slice_s``; a batch taken by a slice whose task was cancelled meanwhile
is given back (``nack``), so cancellation never loses a sample.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from relax_bus.errors import BusTimeout
from relax_bus.state import Batch

if TYPE_CHECKING:
    from relax_bus.protocol import Bus

P = ParamSpec("P")
R = TypeVar("R")


class AsyncBus:
    """``await bus.put(...)``, ``await bus.get(...)``, ... over any bus; ``async for`` via ``stream``."""

    def __init__(self, bus: Bus, slice_s: float = 0.25) -> None:
        self.bus = bus
        self.slice_s = slice_s

    async def _run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))

    async def put(
        self,
        samples: list[dict[str, Any]],
        partition: str = "default",
        timeout: float | None = None,
        ids: list[int] | None = None,
    ) -> list[int]:
        return await self._run(self.bus.put, samples, partition, timeout, ids)

    async def add_fields(self, ids: list[int], fields: dict[str, list[Any]]) -> None:
        return await self._run(self.bus.add_fields, ids, fields)

    async def get(
        self,
        consumer: str,
        n: int,
        fields: list[str] | None = None,
        timeout: float | None = None,
        partial: bool = False,
        trainer_version: int | None = None,
        partition: str | None = None,
    ) -> Batch:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            wait = self.slice_s if left is None else min(self.slice_s, left)
            fut = asyncio.get_running_loop().run_in_executor(
                None,
                functools.partial(
                    self.bus.get, consumer, n, fields, wait, partial, trainer_version, partition
                ),
            )
            try:
                return await asyncio.shield(fut)
            except BusTimeout:
                if left is not None and left <= wait:
                    raise
            except asyncio.CancelledError:
                fut.add_done_callback(functools.partial(_give_back, self.bus, consumer))
                raise

    async def ack(self, consumer: str, lease_id: int) -> None:
        return await self._run(self.bus.ack, consumer, lease_id)

    async def nack(self, consumer: str, lease_id: int) -> None:
        return await self._run(self.bus.nack, consumer, lease_id)

    async def admit(self, step: int, timeout: float | None = None) -> int:
        return await self._run(self.bus.admit, step, timeout)

    async def set_trainer_version(self, version: int) -> None:
        return await self._run(self.bus.set_trainer_version, version)

    async def reset_consumer(self, consumer: str, done_if_written: list[str] | None = None) -> int:
        return await self._run(self.bus.reset_consumer, consumer, done_if_written)

    async def stats(self) -> dict[str, Any]:
        return await self._run(self.bus.stats)

    async def close(self) -> None:
        return await self._run(self.bus.close)

    async def snapshot(self, path: str | Path) -> Path:
        return await self._run(self.bus.snapshot, path)


def _give_back(bus: Bus, consumer: str, fut: asyncio.Future[Batch]) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    try:
        bus.nack(consumer, fut.result().lease_id)
    except Exception:  # noqa: BLE001 - bus closed meanwhile: nothing to give back to
        pass


AsyncDataBus = AsyncBus
