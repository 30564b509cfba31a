"""RayBus: the DataBus API over a controller actor and storage units (design: ``ray_actors.py``).

A RayBus is a small picklable handle: pass it to any Ray task or actor, or attach by name from any process
of the cluster with :meth:`RayBus.from_name`. Validation runs in the calling process (errors are raised
before anything is shipped); payloads above ``inline_bytes`` per call are packed into one columnar block that
goes through the object store (owned by a storage unit, or by the producer: ``payload_owner``), smaller ones
ride inline with the metadata straight to the controller (one hop).

Ray is an optional extra and imported only inside functions.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

import numpy as np

from relax_bus.config import BusConfig
from relax_bus.core import DataBus
from relax_bus.prepare import Row, prepare_fields, prepare_samples
from relax_bus.state import Batch

if TYPE_CHECKING:
    from relax_bus.blocks import Wire
    from relax_bus.local import LocalClient

P = ParamSpec("P")
R = TypeVar("R")

_INSTALL = "the Ray backend needs ray: pip install 'relax-bus[ray]'"
_CLASSES: dict[str, Any] = {}
INLINE_BYTES = 64 * 1024


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise ImportError(_INSTALL) from e
    return ray


def _actor(kind: str) -> Any:
    if kind not in _CLASSES:
        from relax_bus import ray_actors

        ray = _ray()
        _CLASSES["controller"] = ray.remote(max_concurrency=256)(ray_actors.Controller)
        _CLASSES["unit"] = ray.remote(max_concurrency=64)(ray_actors.StorageUnit)
    return _CLASSES[kind]


class RayBus:
    """Same methods as :class:`~relax_bus.DataBus`, backed by Ray actors. Picklable."""

    def __init__(
        self,
        controller: Any,
        units: list[Any],
        config: dict[str, Any],
        inline_bytes: int = INLINE_BYTES,
        payload_owner: str = "unit",
        local_info: dict[str, Any] | None = None,
    ) -> None:
        if payload_owner not in ("unit", "producer"):
            raise ValueError(f"payload_owner must be 'unit' or 'producer' (got {payload_owner!r})")
        self._controller = controller
        self._units = units
        self._config_dict = config
        self.config = BusConfig.model_validate(config)
        self.inline_bytes = inline_bytes
        self.payload_owner = payload_owner
        self._local_info = local_info
        self._rr = itertools.count()

    def __reduce__(self) -> tuple[type[RayBus], tuple[Any, ...]]:
        args = (self._controller, self._units, self._config_dict, self.inline_bytes, self.payload_owner)
        return (RayBus, (*args, self._local_info))

    @property
    def _local(self) -> LocalClient | None:
        """This process's fast-path client (``local.py``), or None off the controller's node. Cached per process."""
        from relax_bus import local

        pid = getattr(self, "_local_pid", None)
        if pid != os.getpid():
            self._local_client, self._local_pid = local.client_for(self._local_info), os.getpid()
        return self._local_client

    @property
    def _shm_dir(self) -> str | None:
        """The controller node's directory for payload files; None without the fast path or without tmpfs."""
        return self._local_info["shm_dir"] if self._local_info else None

    @property
    def transport(self) -> str:
        """``"local"`` (socket + shared memory) in a process on the controller's node, else ``"ray"``."""
        return "local" if self._local is not None else "ray"

    @classmethod
    def create(
        cls,
        config: BusConfig | dict[str, Any],
        name: str | None = None,
        num_storage_units: int = 2,
        inline_bytes: int = INLINE_BYTES,
        manual_clock: bool = False,
        namespace: str | None = None,
        payload_owner: str = "unit",
        fast_local: bool = True,
        **actor_options: Any,
    ) -> RayBus:
        """Start the controller and ``num_storage_units`` storage units (call ``ray.init`` first).

        ``name`` makes the bus findable with :meth:`from_name`; ``actor_options`` go to the controller,
        ``lifetime`` and ``scheduling_strategy`` to the storage units too (e.g. ``lifetime="detached"``, or
        a node affinity that keeps the whole bus on one node). ``payload_owner="unit"`` (default): payloads are owned by a storage
        unit and survive the producer's process; ``"producer"``: the producer owns them (one actor hop and
        one copy fewer per put, but a producer that dies takes its not-yet-evicted payloads with it).
        ``fast_local`` (default on): processes on the controller's node talk to it over a Unix socket and
        pass payloads as shared-memory files (``local.py``); off, every process uses actor calls and the
        object store. ``payload_owner`` applies to the object-store path. ``manual_clock`` is for tests.
        """
        cfg = config if isinstance(config, BusConfig) else BusConfig.model_validate(config)
        if num_storage_units < 1:
            raise ValueError(f"num_storage_units must be >= 1 (got {num_storage_units})")
        unit_opts = {"num_cpus": 0, **({"namespace": namespace} if namespace else {})}
        for key in ("lifetime", "scheduling_strategy"):  # (the units live where the controller does)
            if key in actor_options:
                unit_opts[key] = actor_options[key]
        units = [_actor("unit").options(**unit_opts).remote() for _ in range(num_storage_units)]
        options = {"num_cpus": 0, **actor_options}
        if name is not None:
            options["name"] = name
        if namespace is not None:
            options["namespace"] = namespace
        controller = (
            _actor("controller").options(**options).remote(cfg.model_dump(), units, manual_clock, fast_local)
        )
        _ray().get([u.attach.remote(controller) for u in units])
        local_info = _ray().get(controller.handles.remote())[2]
        return cls(controller, units, cfg.model_dump(), inline_bytes, payload_owner, local_info)

    @classmethod
    def from_name(
        cls, name: str, namespace: str | None = None, payload_owner: str = "unit", fast_local: bool = True
    ) -> RayBus:
        """Attach to a bus started with ``create(..., name=name)`` from any process of the cluster
        (``fast_local=False``: this handle uses actor calls and the object store even on the same node)."""
        ray = _ray()
        controller = ray.get_actor(name, namespace=namespace)
        config, units, local_info = ray.get(controller.handles.remote())
        local_info = local_info if fast_local else None
        return cls(controller, units, config, payload_owner=payload_owner, local_info=local_info)

    @classmethod
    def restore(cls, path: str | Path, name: str | None = None, **create_options: Any) -> RayBus:
        """A new Ray bus with the state saved by ``snapshot`` (of either backend): ``create`` with the
        snapshot's config, then :meth:`load_snapshot`."""
        from relax_bus import snapshot as _snapshot

        bus = cls.create(_snapshot.read(path).config, name=name, **create_options)
        bus.load_snapshot(path)
        return bus

    def load_snapshot(self, path: str | Path) -> None:
        """Fill this bus, fresh from ``create`` (no put or get yet), with a snapshot's state. The controller
        reads ``path`` itself (a directory on its node), so payloads never pass through this process."""
        self._wait(self._controller.load.remote(str(Path(path).resolve()), self.inline_bytes))

    @property
    def controller_actor(self) -> Any:
        """The controller actor's handle: its process holds every sample's metadata, so killing it is how a
        fault test takes the bus down (``ray.kill(bus.controller_actor)``)."""
        return self._controller

    # ------------------------------------------------------------------ plumbing
    def _wait(self, ref: Any) -> Any:
        ray = _ray()
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    def _call(self, method: Callable[Concatenate[DataBus, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run DataBus ``method`` in the controller (typed against DataBus; only its name travels)."""
        if self._local is not None:
            result = self._local.call("call", method.__name__, *args, **kwargs)
        else:
            result = self._wait(self._controller.call.remote(method.__name__, *args, **kwargs))
        return cast(R, result)  # the controller's DataBus ran ``method``: its result is an R

    def _ship(
        self,
        rows: list[Row],
        head: tuple[Any, ...],
        unit_method: str,
        controller_method: str,
        tail: tuple[Any, ...],
    ) -> Any:
        """Send prepared rows (and their block, if large) by the configured route; returns the result."""
        from relax_bus.blocks import pack

        fast = self._local
        block, rows, where = pack(rows, self.inline_bytes, concat=fast is None)
        if block is None:
            if fast is not None:
                return fast.call(controller_method, *head, rows, where, None, *tail)
            return self._wait(
                getattr(self._controller, controller_method).remote(*head, rows, where, None, *tail)
            )
        shm = self._shm_dir
        if fast is not None and shm:
            from relax_bus.local import write_block

            # From here the controller owns the file: it unlinks it when the samples go, or at once if the
            # call fails (the rows pointing at it are dropped); a file orphaned by a broken connection goes
            # with the bus's directory at kill().
            path = write_block(shm, block)
            return fast.call(controller_method, *head, rows, where, path, *tail)
        if fast is not None:  # no tmpfs on this node: the block takes the object store
            block = {f: ("cat", np.concatenate(c[1]), c[2]) if c[0] == "cat" else c for f, c in block.items()}
        if self.payload_owner == "producer":
            refs = [_ray().put(block)]
            ref = getattr(self._controller, controller_method).remote(*head, rows, where, refs, *tail)
        else:
            unit = self._units[next(self._rr) % len(self._units)]
            ref = getattr(unit, unit_method).remote(*head, rows, where, block, *tail)
        return self._wait(ref)

    # ------------------------------------------------------------------ the DataBus API
    def put(
        self,
        samples: list[dict[str, Any]],
        partition: str = "default",
        timeout: float | None = None,
        ids: list[int] | None = None,
    ) -> list[int]:
        rows = prepare_samples(self.config, samples)
        put_ids: list[int] = self._ship(rows, (), "put", "put_block", (partition, timeout, ids))
        return put_ids

    def add_fields(self, ids: list[int], fields: dict[str, list[Any]]) -> None:
        ids = list(ids)
        self._ship(prepare_fields(ids, fields), (ids,), "add", "add_block", ())

    def get(
        self,
        consumer: str,
        n: int,
        fields: list[str] | None = None,
        timeout: float | None = None,
        partial: bool = False,
        trainer_version: int | None = None,
        partition: str | None = None,
    ) -> Batch:
        from relax_bus.blocks import from_wire
        from relax_bus.ray_actors import fetch

        kwargs = {
            "fields": fields,
            "timeout": timeout,
            "partial": partial,
            "trainer_version": trainer_version,
            "partition": partition,
        }
        batch: Batch
        where: Wire
        if self._local is not None and self._shm_dir:  # (without tmpfs the controller has no files to give)
            from relax_bus.local import read_block

            paths: dict[int, str]
            batch, where, paths = self._local.call("get_local", consumer, n, **kwargs)
            from_wire(batch.data, where, {bid: read_block(p) for bid, p in paths.items()})
            return batch
        batch, where, refs = self._wait(self._controller.get.remote(consumer, n, **kwargs))
        from_wire(batch.data, where, fetch(refs))
        return batch

    def ack(self, consumer: str, lease_id: int) -> None:
        return self._call(DataBus.ack, consumer, lease_id)

    def nack(self, consumer: str, lease_id: int) -> None:
        return self._call(DataBus.nack, consumer, lease_id)

    def reset_consumer(self, consumer: str, done_if_written: list[str] | None = None) -> int:
        return self._call(DataBus.reset_consumer, consumer, done_if_written)

    def leases(self, consumer: str) -> dict[int, list[int]]:
        return self._call(DataBus.leases, consumer)

    def set_trainer_version(self, version: int) -> None:
        return self._call(DataBus.set_trainer_version, version)

    @property
    def trainer_version(self) -> int:
        version: int
        if self._local is not None:
            version = self._local.call("trainer_version")
        else:
            version = self._wait(self._controller.trainer_version.remote())
        return version

    def admit(self, step: int, timeout: float | None = None) -> int:
        return self._call(DataBus.admit, step, timeout=timeout)

    def close(self) -> None:
        return self._call(DataBus.close)

    @property
    def closed(self) -> bool:
        closed: bool = self._call(DataBus.stats)["closed"]
        return closed

    def stats(self) -> dict[str, Any]:
        return self._call(DataBus.stats)

    def metrics(self, prefix: str = "bus/") -> dict[str, float]:
        return self._call(DataBus.metrics, prefix)

    def consumed_ids(self, consumer: str) -> list[int]:
        return self._call(DataBus.consumed_ids, consumer)

    def snapshot(self, path: str | Path) -> Path:
        """Write the bus state to ``path`` (a directory on the controller's node; same format as DataBus)."""
        return Path(self._wait(self._controller.snapshot.remote(str(Path(path).resolve()))))

    def advance_clock(self, seconds: float) -> None:
        """Tests only: move lease deadlines (bus created with ``manual_clock=True``)."""
        self._wait(self._controller.advance_clock.remote(seconds))

    def kill(self) -> None:
        """Stop the controller and storage units (frees every payload; from the controller's node, also
        removes the bus's shared-memory files and socket)."""
        from relax_bus import local

        ray = _ray()
        for a in [self._controller, *self._units]:
            ray.kill(a)
        if self._local is not None and self._local_info is not None:
            local.remove_dir(self._local_info["shm_dir"])
            local.unlink(self._local_info["address"])
