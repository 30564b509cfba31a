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
from dataclasses import dataclass
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


class RayLink:
    """How a :class:`RayBus` reaches its actors: the controller, the storage units and, on the controller's
    node, the fast path (a Unix socket and shared-memory files). Picklable: the fast-path client is made
    again in each process that uses it."""

    def __init__(
        self,
        controller: Any,
        units: list[Any],
        inline_bytes: int = INLINE_BYTES,
        payload_owner: str = "unit",
        local_info: dict[str, Any] | None = None,
    ) -> None:
        if payload_owner not in ("unit", "producer"):
            raise ValueError(f"payload_owner must be 'unit' or 'producer' (got {payload_owner!r})")
        self.controller = controller
        """The controller actor's handle: its process holds every sample's metadata, so killing it is how a
        fault test takes the bus down (``ray.kill(bus.link.controller)``)."""
        self.units = units
        self.inline_bytes = inline_bytes
        self.payload_owner = payload_owner
        self.local_info = local_info
        self._rr = itertools.count()
        self._local_pid: int | None = None
        self._local_client: LocalClient | None = None

    def __reduce__(self) -> tuple[type[RayLink], tuple[Any, ...]]:
        return (
            RayLink,
            (self.controller, self.units, self.inline_bytes, self.payload_owner, self.local_info),
        )

    @property
    def local(self) -> LocalClient | None:
        """This process's fast-path client (``local.py``), or None off the controller's node. Cached per process."""
        from relax_bus import local

        if self._local_pid != os.getpid():
            self._local_client, self._local_pid = local.client_for(self.local_info), os.getpid()
        return self._local_client

    @property
    def shm_dir(self) -> str | None:
        """The controller node's directory for payload files; None without the fast path or without tmpfs."""
        return self.local_info["shm_dir"] if self.local_info else None

    @property
    def transport(self) -> str:
        """``"local"`` (socket + shared memory) in a process on the controller's node, else ``"ray"``."""
        return "local" if self.local is not None else "ray"

    def wait(self, ref: Any) -> Any:
        """``ref``'s result; a failure in the controller or a unit re-raised as itself (not Ray's wrapper)."""
        ray = _ray()
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    def call(self, method: Callable[Concatenate[DataBus, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run DataBus ``method`` in the controller (typed against DataBus; only its name travels)."""
        if self.local is not None:
            result = self.local.call("call", method.__name__, *args, **kwargs)
        else:
            result = self.wait(self.controller.call.remote(method.__name__, *args, **kwargs))
        return cast(R, result)  # the controller's DataBus ran ``method``: its result is an R

    def ship(
        self,
        rows: list[Row],
        head: tuple[Any, ...],
        unit_method: str,
        controller_method: str,
        tail: tuple[Any, ...],
    ) -> Any:
        """Send prepared rows (and their block, if large) by the configured route; returns the result."""
        from relax_bus.blocks import pack

        fast = self.local
        block, rows, where = pack(rows, self.inline_bytes, concat=fast is None)
        if block is None:
            if fast is not None:
                return fast.call(controller_method, *head, rows, where, None, *tail)
            return self.wait(
                getattr(self.controller, controller_method).remote(*head, rows, where, None, *tail)
            )
        shm = self.shm_dir
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
            ref = getattr(self.controller, controller_method).remote(*head, rows, where, refs, *tail)
        else:
            unit = self.units[next(self._rr) % len(self.units)]
            ref = getattr(unit, unit_method).remote(*head, rows, where, block, *tail)
        return self.wait(ref)

    def load_snapshot(self, path: str | Path) -> None:
        """Fill this bus, fresh from ``create`` (no put or get yet), with a snapshot's state. The controller
        reads ``path`` itself (a directory on its node), so payloads never pass through this process."""
        self.wait(self.controller.load.remote(str(Path(path).resolve()), self.inline_bytes))

    def advance_clock(self, seconds: float) -> None:
        """Tests only: move lease deadlines (bus created with ``manual_clock=True``)."""
        self.wait(self.controller.advance_clock.remote(seconds))


@dataclass(eq=False)
class RayBus:
    """Same methods as :class:`~relax_bus.DataBus`, backed by Ray actors (reached through :attr:`link`).
    Picklable. Made by :meth:`create`, :meth:`from_name` or :meth:`restore`."""

    link: RayLink
    """The controller, the storage units and the fast path (and tests' ``link.advance_clock``)."""
    config: BusConfig

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
        return cls(RayLink(controller, units, inline_bytes, payload_owner, local_info), cfg)

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
        link = RayLink(controller, units, payload_owner=payload_owner, local_info=local_info)
        return cls(link, BusConfig.model_validate(config))

    @classmethod
    def restore(cls, path: str | Path, name: str | None = None, **create_options: Any) -> RayBus:
        """A new Ray bus with the state saved by ``snapshot`` (of either backend): ``create`` with the
        snapshot's config, then :meth:`load_snapshot`."""
        from relax_bus import snapshot as _snapshot

        bus = cls.create(_snapshot.read(path).config, name=name, **create_options)
        bus.link.load_snapshot(path)
        return bus

    # ------------------------------------------------------------------ the DataBus API
    def put(
        self,
        samples: list[dict[str, Any]],
        partition: str = "default",
        timeout: float | None = None,
        ids: list[int] | None = None,
    ) -> list[int]:
        rows = prepare_samples(self.config, samples)
        put_ids: list[int] = self.link.ship(rows, (), "put", "put_block", (partition, timeout, ids))
        return put_ids

    def add_fields(self, ids: list[int], fields: dict[str, list[Any]]) -> None:
        ids = list(ids)
        self.link.ship(prepare_fields(ids, fields), (ids,), "add", "add_block", ())

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
        if (
            self.link.local is not None and self.link.shm_dir
        ):  # (without tmpfs the controller has no files to give)
            from relax_bus.local import read_block

            paths: dict[int, str]
            batch, where, paths = self.link.local.call("get_local", consumer, n, **kwargs)
            from_wire(batch.data, where, {bid: read_block(p) for bid, p in paths.items()})
            return batch
        batch, where, refs = self.link.wait(self.link.controller.get.remote(consumer, n, **kwargs))
        from_wire(batch.data, where, fetch(refs))
        return batch

    def ack(self, consumer: str, lease_id: int) -> None:
        return self.link.call(DataBus.ack, consumer, lease_id)

    def nack(self, consumer: str, lease_id: int) -> None:
        return self.link.call(DataBus.nack, consumer, lease_id)

    def reset_consumer(self, consumer: str, done_if_written: list[str] | None = None) -> int:
        return self.link.call(DataBus.reset_consumer, consumer, done_if_written)

    def leases(self, consumer: str) -> dict[int, list[int]]:
        return self.link.call(DataBus.leases, consumer)

    def set_trainer_version(self, version: int) -> None:
        return self.link.call(DataBus.set_trainer_version, version)

    @property
    def trainer_version(self) -> int:
        version: int
        if self.link.local is not None:
            version = self.link.local.call("trainer_version")
        else:
            version = self.link.wait(self.link.controller.trainer_version.remote())
        return version

    def admit(self, step: int, timeout: float | None = None) -> int:
        return self.link.call(DataBus.admit, step, timeout=timeout)

    def close(self) -> None:
        return self.link.call(DataBus.close)

    @property
    def closed(self) -> bool:
        closed: bool = self.link.call(DataBus.stats)["closed"]
        return closed

    def stats(self) -> dict[str, Any]:
        return self.link.call(DataBus.stats)

    def metrics(self, prefix: str = "bus/") -> dict[str, float]:
        return self.link.call(DataBus.metrics, prefix)

    def consumed_ids(self, consumer: str) -> list[int]:
        return self.link.call(DataBus.consumed_ids, consumer)

    def snapshot(self, path: str | Path) -> Path:
        """Write the bus state to ``path`` (a directory on the controller's node; same format as DataBus)."""
        return Path(self.link.wait(self.link.controller.snapshot.remote(str(Path(path).resolve()))))

    def kill(self) -> None:
        """Stop the controller and storage units (frees every payload; from the controller's node, also
        removes the bus's shared-memory files and socket)."""
        from relax_bus import local

        ray = _ray()
        for a in [self.link.controller, *self.link.units]:
            ray.kill(a)
        if self.link.local is not None and self.link.local_info is not None:
            local.remove_dir(self.link.local_info["shm_dir"])
            local.unlink(self.link.local_info["address"])
