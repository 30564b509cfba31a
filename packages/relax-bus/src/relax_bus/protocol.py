"""``Bus``: the API both backends serve, the in-process :class:`~relax_bus.DataBus` and the Ray backend's
:class:`~relax_bus.RayBus`, so that roles, loaders and runners can be typed against either.

Structural (``typing.Protocol``): neither backend inherits from it. Only members both have, with the same
signatures, belong here; backend-only calls (``DataBus.state_dict``, its ``ledger``, ``RayBus.kill``, its
``link``) are reached through the concrete class.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from relax_bus.config import BusConfig
    from relax_bus.state import Batch


@runtime_checkable
class Bus(Protocol):
    """What a caller may do with any bus (see :class:`~relax_bus.DataBus` for each method's contract)."""

    @property
    def config(self) -> BusConfig:
        """The bus's validated configuration."""
        ...

    # producers
    def put(
        self,
        samples: list[dict[str, Any]],
        partition: str = "default",
        timeout: float | None = None,
        ids: list[int] | None = None,
    ) -> list[int]: ...

    def add_fields(self, ids: list[int], fields: dict[str, list[Any]]) -> None: ...

    def admit(self, step: int, timeout: float | None = None) -> int: ...

    # trainer
    def set_trainer_version(self, version: int) -> None: ...

    @property
    def trainer_version(self) -> int: ...

    # consumers
    def get(
        self,
        consumer: str,
        n: int,
        fields: list[str] | None = None,
        timeout: float | None = None,
        partial: bool = False,
        trainer_version: int | None = None,
        partition: str | None = None,
    ) -> Batch: ...

    def ack(self, consumer: str, lease_id: int) -> None: ...

    def nack(self, consumer: str, lease_id: int) -> None: ...

    def reset_consumer(self, consumer: str, done_if_written: list[str] | None = None) -> int: ...

    def leases(self, consumer: str) -> dict[int, list[int]]: ...

    # lifecycle and introspection
    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def metrics(self, prefix: str = "bus/") -> dict[str, float]: ...

    def consumed_ids(self, consumer: str) -> list[int]: ...

    def snapshot(self, path: str | Path) -> Path: ...
