"""Ray backend: one DataBus hosted in a threaded Ray actor, driven through a picklable handle.

Why an actor with ``max_concurrency=64``: the hosted DataBus blocks on a ``threading.Condition``; a threaded
actor runs each call on its own thread, so a consumer blocked in ``get`` never blocks a producer's ``put``
(up to 64 concurrent calls). This is the first Ray backend; a later version adds storage units so sample data
travels through the object store instead of the controller actor.

Ray is an optional extra and imported only inside functions.
"""

from __future__ import annotations

from typing import Any

from relax_bus.config import BusConfig
from relax_bus.core import DataBus
from relax_bus.state import Batch

_INSTALL = "the Ray backend needs ray: pip install 'relax-bus[ray]'"
_ACTOR_CLS = None


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError(_INSTALL) from e
    return ray


class _BusActor:
    """Hosts a DataBus; each public method runs on an actor thread."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._bus = DataBus(BusConfig.model_validate(config))

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._bus, method)(*args, **kwargs)

    def trainer_version(self) -> int:
        return self._bus.trainer_version


def _actor_cls():
    global _ACTOR_CLS
    if _ACTOR_CLS is None:
        _ACTOR_CLS = _ray().remote(max_concurrency=64)(_BusActor)
    return _ACTOR_CLS


class RayBus:
    """Same methods as :class:`~relax_bus.DataBus`, forwarded to a Ray actor. Pass it to other actors/tasks."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @classmethod
    def create(
        cls, config: BusConfig | dict[str, Any], name: str | None = None, **actor_options: Any
    ) -> RayBus:
        """Start the bus actor (call ``ray.init`` first). ``name`` makes it findable with :meth:`from_name`."""
        cfg = config if isinstance(config, BusConfig) else BusConfig.model_validate(config)
        options = {"num_cpus": 0, **actor_options}
        if name is not None:
            options["name"] = name
        return cls(_actor_cls().options(**options).remote(cfg.model_dump()))

    @classmethod
    def from_name(cls, name: str, namespace: str | None = None) -> RayBus:
        """Attach to a bus actor started with ``create(..., name=name)``."""
        return cls(_ray().get_actor(name, namespace=namespace))

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        ray = _ray()
        try:
            return ray.get(self._handle.call.remote(method, *args, **kwargs))
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    def put(
        self, samples: list[dict[str, Any]], partition: str = "default", timeout: float | None = None
    ) -> list[int]:
        return self._call("put", samples, partition=partition, timeout=timeout)

    def add_fields(self, ids: list[int], fields: dict[str, list[Any]]) -> None:
        return self._call("add_fields", ids, fields)

    def get(
        self,
        consumer: str,
        n: int,
        fields: list[str] | None = None,
        timeout: float | None = None,
        partial: bool = False,
        trainer_version: int | None = None,
    ) -> Batch:
        return self._call(
            "get",
            consumer,
            n,
            fields=fields,
            timeout=timeout,
            partial=partial,
            trainer_version=trainer_version,
        )

    def ack(self, consumer: str, lease_id: int) -> None:
        return self._call("ack", consumer, lease_id)

    def nack(self, consumer: str, lease_id: int) -> None:
        return self._call("nack", consumer, lease_id)

    def set_trainer_version(self, version: int) -> None:
        return self._call("set_trainer_version", version)

    @property
    def trainer_version(self) -> int:
        return _ray().get(self._handle.trainer_version.remote())

    def admit(self, step: int, timeout: float | None = None) -> int:
        return self._call("admit", step, timeout=timeout)

    def close(self) -> None:
        return self._call("close")

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def consumed_ids(self, consumer: str) -> list[int]:
        return self._call("consumed_ids", consumer)
