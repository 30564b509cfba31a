"""How the ``sglang`` engine's servers get new weights: through disk, as CUDA tensors, over SGLang's weight
group or as deltas, then checked; an engine that does not take an update is failed and restarted.

Why apart from the engine: the paths share one contract (every serving engine holds the new version, or is
failed; a restarted engine gets weights known to be whole) and their mechanics (sessions, failures,
collectives that must not wait for a peer that refused). :class:`SGLangWeights` is that contract, one per
engine (``engine.weights``), acting on its :class:`~relax_rollout.engines.sglang.state.SGLangServers`.

- **Disk** (default): the pool writes safetensors once, every engine loads them with
  ``/update_weights_from_disk``; the directory is kept so a restarted engine loads it before serving.
  ``from_disk(path, version)`` loads a checkpoint directory of the caller's.
- **Distributed**: over SGLang's weight group, no disk: this process is rank 0 of a group with every
  engine (``/init_weights_update_group``, formed at the first update and again whenever the engines
  changed) and broadcasts ``bucket_bytes`` buckets, each announced by ``/update_weights_from_distributed``
  (``load_format="flattened_bucket"``; NCCL from CUDA tensors, gloo from host memory;
  :mod:`relax_rollout.engines.weight_group`), inside a weight-update session (``/begin_weight_update`` …
  ``/end_weight_update``, which SGLang 0.5.23 requires) with generation paused in ``retract`` mode, so no
  request decodes on half-updated weights. A restarted engine then waits, out of the pool, for the next
  update, which re-forms the group with it; an engine failing mid-broadcast is marked failed and the update
  retried once on the others.
- **Tensor** (colocated trainer): ``/update_weights_from_tensor`` with SGLang's ``serialized_named_tensors``,
  one base64 ``ForkingPickler`` payload per TP rank, CUDA tensors travelling as IPC handles.
- **Delta** (``weight_update="delta"``, #53): each version as its difference from the one the engines hold,
  by ``/update_weights_from_tensor`` to SGLang's custom loader (:mod:`relax_rollout.engines.sglang.delta`),
  in the same paused session, restarted engines waiting for it as with distributed.
- **A caller that broadcasts itself**: ``connect_dcs`` (engine ``k`` joins ``/init_weights_update_group``
  as ranks ``rank + k*tp ...``), then ``from_distributed`` (names, dtypes, shapes) while it broadcasts: a
  trainer's DCS ``WeightSender`` (a store header, then buckets: not SGLang's protocol) reaches SGLang through
  the rollout role, which broadcasts on; our engine server can join DCS itself (``protocol="relax_dcs"``).

After every update each engine's ``/model_info`` ``weight_version`` must equal the new version, else
:class:`WeightVersionMismatch` names the engines. Weights that came as tensors, or from a caller's
broadcast, cannot be given to a restarted engine: an engine that dies after such an update is left failed,
saying so. An engine that does not carry out an update — HTTP 400 included, SGLang's answer to every failed
load, after which its weights may be half-loaded — is failed and restarted; the update goes on with the
others, and raises :class:`WeightUpdateFailed` when none took it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from relax_core.net import free_port
from relax_rollout.engines.expert_names import unfuse_experts
from relax_rollout.engines.pool_members import PoolError
from relax_rollout.engines.processes import EngineProcess
from relax_rollout.engines.sglang.delta import SGLangDeltas
from relax_rollout.engines.sglang.state import SGLangServers
from relax_rollout.engines.wire import ServerError, model_info, pause_request, retry_flush_refused
from relax_rollout.engines.wire_weights import (
    disk_update_request,
    distributed_update_request,
    init_group_request,
    tensor_metadata,
    tensor_update_request,
)

logger = logging.getLogger(__name__)


class WeightVersionMismatch(RuntimeError):
    """After a weight update, some engines report another ``weight_version`` than the one pushed."""


class WeightUpdateFailed(PoolError):
    """No engine took a weight update (each one's error is in the message); they are restarted with the
    last weights that loaded everywhere, and the engine's version stays the previous one."""


@dataclass
class _WeightGroup:
    """The group ``weight_update="distributed"`` broadcasts on: this process is rank 0, engine ``i`` of
    ``urls`` ranks ``1 + i*tp_size ...``."""

    pg: Any
    name: str
    urls: tuple[str, ...]
    backend: str


class _GroupBroken(RuntimeError):
    """A weight-group rendezvous or broadcast failed (an engine died or refused): re-form and retry."""


def _failures(futs: list[tuple[Any, Any]]) -> list[tuple[Any, Exception]]:
    """The engines that did not carry out a weight request sent to several, ``(key, future)`` each, with
    their errors. SGLang answers a weight update it could not finish with HTTP 400 ``{"success": false}``
    after it may have loaded part of it (a broadcast that stopped midway; a disk load whose roll-back
    re-reads the new directory), so a refusal is that engine's failure like a 5xx, a reset connection or a
    time-out: it must not serve until it is restarted with weights known to be whole."""
    failed: list[tuple[Any, Exception]] = []
    for key, f in futs:
        try:
            f.result()
        except (ServerError, OSError) as e:
            failed.append((key, e))
    return failed


def _each(body: Any) -> Callable[[int], Any]:
    """The same request ``body`` for every engine of a group (``SGLangWeights._on_group``'s ``body``)."""
    return lambda _i: body


def _in_thread(fn: Callable[[], Any], name: str) -> Future:
    """``fn()`` in a daemon thread of its own, as a future: a collective stuck for want of a peer can be
    left behind (it ends at its group's time-out) without holding up a pool's worker."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 — handed to the caller through the future
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def _until_done_or_refused(local: Future, requests: list[Future]) -> bool:
    """Wait for ``local`` (this process's part of a collective) unless one of the engines' ``requests``
    fails first: an engine that refused never joins, and the collective would wait for it until the
    group's time-out. True when ``local`` was left waiting."""
    while not local.done():
        pending = [f for f in requests if not f.done()]
        wait([local, *pending], return_when=FIRST_COMPLETED)
        if not local.done() and _failures([(None, f) for f in requests if f.done()]):
            return True
    return False


def _abort_collectives(pg: Any) -> None:
    """Release a collective left waiting on ``pg``: NCCL's kernels would hold the GPU until the time-out
    (torch's abort is NCCL-only; a gloo collective ends at its time-out in the thread left behind)."""
    if pg is None:
        return
    try:
        import torch.distributed.distributed_c10d as c10d

        if "nccl" in str(c10d.get_backend(pg)).lower():
            c10d._abort_process_group(pg)
    except Exception as e:  # noqa: BLE001 — best effort: the group is dropped either way
        logger.debug("aborting the weight group's collectives: %s", e)


def _gpu_shared(device: Any, slots: Iterable[Any]) -> bool:
    """Whether CUDA ``device`` of this process is one an engine of ``slots`` on this node runs on (colocated)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    gpu = visible[index] if index < len(visible) else str(index)
    return any(gpu in slot.gpus for slot in slots if slot.node is None)


def served_names(named: Iterable[tuple[str, Any]], prefix: str) -> list[tuple[str, Any]]:
    """The trainer's tensors as the served checkpoint names them: MoE experts one per expert
    (:mod:`relax_rollout.engines.expert_names`), under ``prefix`` (``thinker.`` for a whole Qwen3-Omni)."""
    return [(n if n.startswith(prefix) else prefix + n, t) for n, t in unfuse_experts(named)]


def rank_devices(slots: Iterable[Any], tp_size: int, url: str) -> list[Any] | int:
    """The CUDA device, in this process's numbering, of each TP rank of the engine at ``url``: its slot's
    GPUs (physical ids) looked up in ``CUDA_VISIBLE_DEVICES``. ``tp_size`` (tensors left where they are) for
    an engine that is not one of ``slots`` (added from outside) or without CUDA."""
    import torch

    slot = next((s for s in slots if s.url == url), None)
    if slot is None or not torch.cuda.is_available():
        return tp_size
    visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return [torch.device("cuda", visible.index(g) if g in visible else int(g)) for g in slot.gpus]


class SGLangWeights:
    """The weight updates of ``servers`` (see the module docstring): their pool, slots, ``weight_update``
    and pause state are read when it acts, and every request goes through ``servers.call``. ``prefix``: put
    before every weight name (:func:`served_names`); ``bucket_bytes``: at most this many bytes a broadcast;
    ``rejoin(slot)`` / ``restart_later(slot, reason)``: the lifecycle's, for a restarted engine that waited
    for the weights of a broadcast."""

    def __init__(
        self,
        servers: SGLangServers,
        *,
        prefix: str,
        bucket_bytes: int,
        rejoin: Callable[[EngineProcess], None],
        restart_later: Callable[[EngineProcess, str], None],
    ) -> None:
        self.servers, self.prefix, self.bucket_bytes = servers, prefix, bucket_bytes
        self._rejoin, self._restart_later = rejoin, restart_later
        self.trainer_group: str | None = None
        """The caller's weight group the engines joined (:meth:`connect_dcs`)."""
        self.group: _WeightGroup | None = None
        """``weight_update="distributed"``: the group this process broadcasts on, formed lazily."""
        self._lock = threading.Lock()
        self.deltas = SGLangDeltas(bucket_bytes) if servers.weight_update == "delta" else None
        """``weight_update="delta"``: the codec of the versions the engines hold."""

    def update(self, tensors: dict[str, Any], version: int) -> None:
        """Push ``tensors`` as ``version`` by the engine's ``weight_update`` and check the engines."""
        mode, pool = self.servers.weight_update, self.servers.pool
        if mode == "tensor":
            self.from_tensor(list(tensors.items()), version)
            return
        if mode in ("distributed", "delta"):
            self._update_distributed(self.served_names(tensors.items()), version)
            return
        pool.update_weights(
            dict(self.served_names(tensors.items())), version, flush_cache=self.servers.may_flush
        )
        self.check_version(version)

    def served_names(self, named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return served_names(named, self.prefix)

    def check_version(self, version: int, skip: Iterable[str] = ()) -> None:
        """Every serving engine's ``/model_info`` must report ``weight_version`` == ``version`` (``skip``: those
        that refused a delta and serve their last complete version)."""
        s = self.servers
        wrong = []
        members = [m for m in s.pool.membership.active() if m.url not in set(skip)]
        if not members:
            raise PoolError(f"no active SGLang engine to check weight version {version}: {s.describe()}")
        futs = [(m, s.executor.submit(model_info, m.url, s.token, s.request_timeout_s)) for m in members]
        for m, f in futs:
            got = f.result().get("weight_version")
            if str(got) != str(version):
                wrong.append(f"{m.id} ({m.url}) holds {got!r}")
        if wrong:
            raise WeightVersionMismatch(
                f"weight version {version} expected after the update, but " + "; ".join(wrong)
            )

    # -- every engine, or none ----------------------------------------------------------------------------
    def _update_all(
        self, path: str, body: Any, urls: list[str] | None = None, send: Callable[..., Any] | None = None
    ) -> None:
        """A weight update on every engine (or on ``urls``): one that fails it (refused, 5xx, died, timed
        out; see :func:`_failures`) is marked failed, the supervisor restarts it, and the others go on;
        :class:`WeightUpdateFailed` when none took it. ``send(call)``: how each engine's call is made
        (default: once)."""
        pool = self.servers.pool
        urls = [m.url for m in pool.membership.active()] if urls is None else urls
        failed = self._each(urls, path, body, send)
        if urls and len(failed) == len(urls):
            raise WeightUpdateFailed(f"{path}: no engine took the update ({'; '.join(failed.values())})")
        if not pool.membership.active():
            raise PoolError(f"{path}: no engine left serving: {self.servers.describe()}")

    def _each(
        self, urls: Iterable[str], path: str, body: Any, send: Callable[..., Any] | None = None
    ) -> dict[str, str]:
        """``path`` on each of ``urls`` concurrently (``body``: the same for all, or a function of the url;
        ``send(call)``: how a call is made, default once); those that fail it are marked failed (restarted
        by the supervisor): ``{url: why}``."""
        s = self.servers
        send = send or (lambda call: call())
        futs = [
            (
                url,
                s.executor.submit(
                    send, functools.partial(s.call, url, path, body(url) if callable(body) else body)
                ),
            )
            for url in urls
        ]
        failed = {url: f"{path} failed: {type(x).__name__}: {x}" for url, x in _failures(futs)}
        for url, why in failed.items():
            self._engine_failed(url, why)
        return failed

    def _engine_failed(self, url: str, reason: str) -> None:
        s = self.servers
        m = s.pool.membership.find(url)
        if m is not None and m.state == "active":
            s.pool.membership.mark_failed(m.id, reason)  # the supervisor restarts it
            return
        for slot in s.slots:  # a restarted engine that was waiting for weights: restart it again
            if slot.url == url and slot.state == "waiting":
                self._restart_later(slot, reason)

    @contextlib.contextmanager
    def _session(self, urls: list[str], pause: bool, version: int | None = None) -> Iterator[list[str]]:
        """A weight-update session on every engine of ``urls``; yields those that opened it.

        SGLang (0.5.23) loads ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` only
        between ``/begin_weight_update`` and ``/end_weight_update`` (HTTP 400 otherwise). With ``pause``,
        generation is first paused in ``retract`` mode (running requests go back to the queue, their KV
        cache freed, and go on with the new weights after ``/continue_generation``), unless the caller
        paused already: SGLang releases its update lock between two requests, so a bucketed update would
        otherwise let requests decode on half-updated weights under the old version label, and its cache
        flush fails while requests run. The time from the pause to the continue is the engines' pause for
        ``version`` (the pool's ``pauses``)."""
        paused = pause and self.servers.paused is None
        failed: dict[str, str] = {}
        t0 = time.perf_counter()
        try:
            if paused:
                failed |= self._each(urls, "/pause_generation", pause_request("retract"))
            opened = [u for u in urls if u not in failed]
            failed |= self._each(opened, "/begin_weight_update", {})
            opened = [u for u in opened if u not in failed]
            try:
                yield opened
            finally:
                self._each(opened, "/end_weight_update", {})
        finally:
            if paused:
                self._each([u for u in urls if u not in failed], "/continue_generation", {})
                if version is not None:
                    self.servers.pool.pauses.add(version, time.perf_counter() - t0)

    def _updated(self, version: int, path: str | None) -> None:
        self.check_version(version)
        self.servers.pool.adopt_weights(version, path)

    # -- disk and tensors ---------------------------------------------------------------------------------
    def from_disk(self, model_path: str, version: int, abort_all_requests: bool = False) -> None:
        """Every engine loads the checkpoint directory ``model_path`` (readable by them) as ``version``; a
        restarted engine loads it too (the directory is the caller's and is never deleted)."""
        body = disk_update_request(
            model_path, version, abort_all_requests, flush_cache=self.servers.may_flush
        )
        self._update_all("/update_weights_from_disk", body, send=retry_flush_refused)
        self._updated(version, model_path)

    def from_tensor(
        self,
        named_tensors: list[tuple[str, Any]],
        version: int,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> None:
        """Colocated: ``/update_weights_from_tensor`` with ``named_tensors`` (CUDA IPC handles; MoE experts one
        per expert, see :mod:`relax_rollout.engines.expert_names`)."""
        s = self.servers
        named = self.served_names(named_tensors)
        bodies: dict[tuple[Any, ...], dict[str, Any]] = {}  # engines on the same GPUs share one payload

        def body(url: str) -> dict[str, Any]:
            devices = rank_devices(s.slots, s.tp_size, url)
            key = tuple(devices) if isinstance(devices, list) else (devices,)
            if key not in bodies:
                bodies[key] = tensor_update_request(
                    named, version, devices, flush_cache, load_format=load_format
                )
            return bodies[key]

        with self._session([m.url for m in s.pool.membership.active()], pause=False) as opened:
            self._update_all("/update_weights_from_tensor", body, opened)
        self._updated(version, None)

    # -- a caller's broadcast -----------------------------------------------------------------------------
    def connect_dcs(
        self,
        init_method: str,
        world_size: int,
        rank: int = 1,
        backend: str = "nccl",
        group_name: str = "relax_dcs",
        protocol: str = "sglang",
    ) -> None:
        """Engine ``i`` (in order) joins the caller's weight group as ranks ``rank + i*tp_size ...``
        (``/init_weights_update_group``); returns after the rendezvous, so call it concurrently with the
        sender's (:func:`relax_rollout.engines.weight_group.new_group` at rank 0). ``protocol="relax_dcs"``:
        our engine servers join a relax DCS ``WeightSender`` instead (``group_name`` must be the sender's)."""
        s = self.servers
        u = urlparse(init_method)
        host, port = u.hostname, u.port
        if not host or not port:
            raise ValueError(f"init_method must look like 'tcp://HOST:PORT' (got {init_method!r})")
        n = len(s.pool.membership.active())
        if rank < 1 or rank + n * s.tp_size > world_size:
            raise ValueError(
                f"{n} engines × {s.tp_size} ranks from rank {rank} do not fit a group of {world_size}"
            )
        s.call_all(
            "/init_weights_update_group",
            lambda i, m: init_group_request(
                host, port, rank + i * s.tp_size, world_size, group_name, backend, protocol
            ),
        )
        self.trainer_group = group_name

    def from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        """``/update_weights_from_distributed`` on every engine while the caller broadcasts (call it
        concurrently with the broadcast), then the version check."""
        if self.trainer_group is None:
            raise PoolError("no weight update group: call connect_dcs first")
        body = distributed_update_request(
            names, dtypes, shapes, version, self.trainer_group, flush_cache, abort_all_requests, load_format
        )
        with self._session([m.url for m in self.servers.pool.membership.active()], pause=False) as opened:
            self._update_all("/update_weights_from_distributed", body, opened)
        self._updated(version, None)

    def leave_trainer_group(self) -> None:
        """Leave the caller's weight group (``/destroy_weights_update_group``)."""
        if self.trainer_group is None:
            return
        self.servers.call_all("/destroy_weights_update_group", {"group_name": self.trainer_group})
        self.trainer_group = None

    # -- our broadcast (weight_update="distributed", or "delta") ----------------------------------------------
    def _update_distributed(self, named: list[tuple[str, Any]], version: int) -> None:
        """Broadcast ``named`` to every serving engine (and every restarted one waiting for weights) on the
        weight group in ``flattened_bucket`` buckets (the version with the last), re-formed when the engines
        changed; an engine failing meanwhile is marked failed and the update retried once on the others.
        With ``deltas``: to the same engines through the loader instead (:meth:`SGLangDeltas.send`)."""
        from relax_rollout.engines import weight_group as wg

        s = self.servers
        if not named:
            raise ValueError("a weight update needs at least one tensor")
        device = named[0][1].device
        if device.type == "cuda" and _gpu_shared(device, self.servers.slots):
            device = type(device)("cpu")  # NCCL refuses two ranks on one GPU: send from host memory over gloo
        backend = "nccl" if device.type == "cuda" else "gloo"
        parts = wg.buckets(named, self.bucket_bytes)
        refused: dict[str, str] = {}
        with self._lock:
            for attempt in (1, 2):
                members = {m.url: m for m in s.pool.membership.active()}
                waiting = [slot for slot in s.slots if slot.state == "waiting" and slot.url not in members]
                urls = (*members, *(slot.url for slot in waiting if slot.url is not None))
                if not urls:
                    raise PoolError(f"no engine to update: {s.describe()}")
                if self.deltas is not None and s.weight_update == "delta":  # (the loader, not a group)
                    paused = functools.partial(self._session, pause=True, version=version)
                    refused = self.deltas.send(named, version, [*urls], s, paused, self._update_all, waiting)
                    break
                try:
                    group = self._form_group(urls, backend)
                    flush = self.servers.may_flush
                    with self._session(list(group.urls), pause=True, version=version) as opened:
                        if len(opened) < len(group.urls):  # one left: the broadcast would wait for it
                            self._drop_group()
                            raise _GroupBroken("an engine did not open the weight-update session")
                        for i, bucket in enumerate(parts):
                            last = i == len(parts) - 1
                            body = distributed_update_request(
                                *tensor_metadata(bucket),
                                version if last else None,
                                group.name,
                                flush_cache=last and flush,
                                load_format=wg.FLATTENED,
                            )
                            self._on_group(
                                group,
                                "/update_weights_from_distributed",
                                _each(body),
                                functools.partial(wg.send, group.pg, bucket, wg.FLATTENED, device),
                            )
                    break
                except _GroupBroken as x:
                    if attempt == 2 or not s.pool.membership.active():
                        raise PoolError(f"weight version {version} could not be broadcast: {x}") from None
                    logger.warning("weight version %d: %s; re-forming the group without it", version, x)
        # the pool takes the version first (restarted engines are admitted at it), the check covers them too:
        # when a refusal had failed every engine, only restarted ones hold the new weights
        s.pool.adopt_weights(version, None)
        for slot in [w for w in waiting if w.url not in refused]:  # restarted ones hold it now: they serve
            try:
                self._rejoin(slot)
            except Exception as x:  # noqa: BLE001 — restarted again, within max_restarts
                logger.warning("engine %d did not rejoin after the update: %s", slot.index, x)
                self._restart_later(slot, f"rejoin after weight version {version} failed: {x}")
        self.check_version(version, skip=refused)

    def _form_group(self, urls: tuple[str, ...], backend: str) -> _WeightGroup:
        """The current group if it holds exactly ``urls``; else a new one (the old one destroyed)."""
        from relax_rollout.engines import weight_group as wg

        s = self.servers
        if self.group is not None and self.group.urls == urls and self.group.backend == backend:
            return self.group
        self._drop_group()
        if all(slot.node is None for slot in s.slots):
            master = "127.0.0.1"
        else:  # engines on other nodes reach this one's address
            import ray

            master = ray.util.get_node_ip_address()
        port = free_port(master)
        name = f"relax_weights_{uuid.uuid4().hex[:8]}"
        world = 1 + len(urls) * s.tp_size
        group = _WeightGroup(None, name, urls, backend)
        timeout = min(s.request_timeout_s, 300.0)

        def join(i: int) -> dict[str, Any]:
            return init_group_request(master, port, 1 + i * s.tp_size, world, name, backend)

        def host() -> None:
            group.pg = wg.new_group(backend, f"tcp://{master}:{port}", world, 0, name, timeout)

        self._on_group(group, "/init_weights_update_group", join, host)
        self.group = group
        logger.info(
            "weight group %s formed with %d engines (%s, world size %d)", name, len(urls), backend, world
        )
        return group

    def _on_group(
        self, group: _WeightGroup, path: str, body: Callable[[int], Any], local: Callable[[], None]
    ) -> None:
        """``path`` on every engine of ``group`` while this process does its part (``local``: a rendezvous
        or a broadcast). An engine that fails it (refused, died, 5xx; see :func:`_failures`) is marked
        failed and :class:`_GroupBroken` raised, naming it."""
        s = self.servers
        futs = [(url, s.executor.submit(s.call, url, path, body(i))) for i, url in enumerate(group.urls)]
        mine = _in_thread(local, "relax-weight-group")
        stuck = _until_done_or_refused(mine, [f for _, f in futs])
        local_error = (
            mine.exception()
            if not stuck
            else TimeoutError("abandoned: an engine refused, so the collective can never complete")
        )
        if stuck:  # every member must join a collective: one that refused leaves the others waiting in it
            done = [(u, f) for u, f in futs if f.done()]
            failed = _failures(done)
            failed += [
                (u, TimeoutError(f"left waiting in {path} after a peer refused"))
                for u, f in futs
                if not f.done()
            ]
            _abort_collectives(group.pg)
        else:
            failed = _failures(futs)
        for url, x in failed:
            self._engine_failed(url, f"{path} failed: {type(x).__name__}: {x}")
        if not failed and local_error is None:
            return
        if group is self.group:  # its members' state is unknown now: a fresh group next time
            self._drop_group()
        elif group.pg is not None:
            from relax_rollout.engines.weight_group import destroy_group

            destroy_group(group.pg)
        why = "; ".join(f"{u}: {x}" for u, x in failed) or f"{type(local_error).__name__}: {local_error}"
        raise _GroupBroken(f"{path} on the weight group failed ({why})")

    def _drop_group(self) -> None:
        """Leave the weight group: engines still serving destroy their side, this process its own."""
        from relax_rollout.engines import weight_group as wg

        s = self.servers
        group, self.group = self.group, None
        if group is None:
            return
        live = {m.url for m in s.pool.membership.active()} | {
            slot.url for slot in s.slots if slot.state == "waiting"
        }
        futs = [
            s.executor.submit(s.call, url, "/destroy_weights_update_group", {"group_name": group.name}, 30.0)
            for url in group.urls
            if url in live
        ]
        for f in futs:
            try:
                f.result()
            except Exception as x:  # noqa: BLE001 — a fresh group is formed either way
                logger.warning("leaving weight group %s: %s", group.name, x)
        if group.pg is not None:
            wg.destroy_group(group.pg)

    def close(self) -> None:
        """The engines are gone: only this process's side of the group is left to destroy."""
        group, self.group = self.group, None
        if group is not None and group.pg is not None:
            from relax_rollout.engines.weight_group import destroy_group

            destroy_group(group.pg)
