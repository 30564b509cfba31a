"""The two ends of the trainer's weight broadcast, one class each, used by every role that sends or receives
weights.

- :class:`WeightPublisher` — the trainer's end. Each new version goes to one ``send`` callable: in colocate
  mode the run's (straight into the rollout engine in this process), in fully-async mode a DCS
  :class:`~relax_core.dcs.WeightSender`'s broadcast, from a background thread when overlapping (the next
  optimizer step waits for it: :meth:`WeightPublisher.fence`). A broadcast a dead receiver broke is counted
  under the health manager (it re-forms the group and has the weights sent again), raised without it.
- :class:`WeightSubscriber` — a receiving role's end (the rollout, ActorFwd): joins the broadcast (again
  when the health manager re-forms the group), applies every version as it arrives, and waits for a version
  a restarted role must hold before it computes.

They were written out in the trainer, the rollout and ActorFwd, each with its own copy of the reconnect
and wait logic; the roles now own one of these and say only what to do with the weights.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import wait
from typing import Any

NamedWeights = list[tuple[str, Any]]
"""One version's ``(HF name, tensor)`` pairs (a tensor is ``Any`` here, as in ``TrainBackend.named_weights``:
relax-core does not import torch)."""
Send = Callable[[NamedWeights, int], None]
"""``send(named_weights, version)``: deliver one version's ``(HF name, tensor)`` pairs."""


class WeightPublisher:
    """The trainer's end: ``weights()`` gives the current ``(named_weights, version)``; :meth:`publish` sends
    them with ``send`` (None: nowhere, until :meth:`connect_dcs`)."""

    def __init__(
        self,
        run: Any,
        weights: Callable[[], tuple[NamedWeights, int]],
        send: Send | None = None,
        on_published: Callable[[NamedWeights, int], None] | None = None,
        alive: Callable[[], None] | None = None,
    ) -> None:
        """``alive()``: called every half second while :meth:`fence` waits (the trainer's heartbeat: waiting
        for a broadcast is not a hang; a broadcast that hangs fails at --weight-sync-timeout-s)."""
        self.run, self.weights, self.send = run, weights, send
        self.on_published = on_published
        self.alive = alive
        """Called with every version published (``--verify-weight-sync``: the trainer's checksum log)."""
        self.overlap = False
        """Send from a background thread (DCS with ``overlap_weight_sync``); never in colocate mode,
        where the rollout generates with the new weights right after the step."""
        self.lock = threading.RLock()
        """Held by a training step and by a re-formed group's re-send: weights are never sent mid-update."""
        self.failures = 0
        """Broadcasts that failed because a receiver died (the health manager re-forms the group)."""
        self.fence_wait_s = 0.0
        """Seconds the optimizer waited for a background broadcast, since the step metrics last read it."""
        self.published_bytes = 0
        """Bytes of the last version published (LoRA's adapter mode sends the adapters alone: compare)."""
        self._sender: Any = None
        self._pool: Any = None  # one background thread: the broadcast overlapping the next step
        self._inflight: Any = None  # that broadcast's future, until the fence has waited for it

    def connect_dcs(self, init_method: str, world_size: int, republish: bool = False) -> None:
        """Open the DCS broadcast to ``world_size - 1`` receivers, dropping the group before it (a member
        died: no handshake); ``republish``: send the current weights at once, so a newcomer and anyone
        who missed a broadcast catch up."""
        from relax_core.dcs import WeightSender

        with self.lock:  # no training-step broadcast in between: it would race the re-send
            if self._sender is not None:
                self._sender.abandon()
                self.fence()  # (a broadcast in flight on the old group fails; counted)
            self._sender = WeightSender.for_run(self.run, init_method, world_size)
            self._sender.connect()
            self.send = self._sender.broadcast
            self.overlap = self.run.overlap_weight_sync
            if republish:
                self.publish()

    def publish(self) -> None:
        """Send the current weights: at once, or from the background thread when overlapping."""
        named, version = self.weights()
        self.published_bytes = sum(t.numel() * t.element_size() for _, t in named)
        if self.on_published is not None:
            self.on_published(named, version)
        if self.send is None:
            return
        with self.lock:
            self.fence()  # one broadcast at a time, in version order
            last = self._sender.last_version if self._sender is not None else None
            if last is not None and version <= last:
                return  # this group has these weights already (sent when it was formed)
            if self.overlap:
                from concurrent.futures import ThreadPoolExecutor

                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="relax-dcs-sender")
                # the weights are read by that thread until the fence (before the next optimizer step)
                self._inflight = self._pool.submit(self.send, named, version)
                return
            try:
                self.send(named, version)
            except RuntimeError as e:
                self._failed(e)

    def fence(self) -> float:
        """Wait for the broadcast in flight, if any (before an optimizer step writes the weights it reads).
        Returns the seconds waited."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return 0.0
        t0 = time.perf_counter()
        while not fut.done():  # (a receiver cut off holds it until the group is re-formed or it times out)
            if self.alive is not None:
                self.alive()
            wait([fut], timeout=0.5)
        try:
            fut.result()
        except RuntimeError as e:
            self._failed(e)
        waited = time.perf_counter() - t0
        self.fence_wait_s += waited
        return waited

    @property
    def last_sync(self) -> Any:
        """The last finished DCS sync's :class:`~relax_core.dcs.SyncStats` (bytes put on the wire — with
        ``--weight-sync-delta`` the deltas, next to :attr:`published_bytes`, the whole version — and the
        broadcast's seconds); None before one or without DCS."""
        return self._sender.last_stats if self._sender is not None else None

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def _failed(self, exc: RuntimeError) -> None:
        if not self.run.health:
            raise exc
        # a receiver died mid-broadcast: train on; the health manager restarts it, re-forms the group and
        # has these weights sent again
        self.failures += 1

    def close(self) -> None:
        self.fence()
        if self._pool is not None:
            self._pool.shutdown()
        if self._sender is not None:
            self._sender.close()


class WeightSubscriber:
    """A receiving role's end: ``apply(version, tensors)`` loads one version; ``held()`` is the version the
    role holds now; ``name`` says whose weights are late in a time-out."""

    def __init__(
        self, run: Any, apply: Callable[[int, dict[str, Any]], None], held: Callable[[], int], name: str
    ) -> None:
        self.run, self.apply, self.held, self.name = run, apply, held, name
        self._receiver: Any = None
        self.load_error: str | None = None
        """Why this role could not load the last version it received (its receiver stopped there). The
        role's heartbeat reports it: under the health manager a receiver that stopped is otherwise taken for
        a broken group, and the role would wait for weights forever while its loop looks alive."""

    def connect_dcs(self, init_method: str, world_size: int, rank: int) -> None:
        """Join the trainer's broadcast as ``rank``; called again when the health manager re-forms it."""
        from relax_core.dcs import WeightReceiver

        if self._receiver is not None:  # the old group lost a member: leave it
            self._receiver.close(timeout_s=5.0)
        self._receiver = WeightReceiver.for_run(self.run, init_method, world_size, rank)
        self._receiver.connect()
        self.load_error = None
        self._receiver.start_background(self._load)

    def _load(self, version: int, tensors: dict[str, Any]) -> None:
        """``apply``, keeping what failed in :attr:`load_error` (then re-raised: the receiver stops)."""
        from relax_core.health import first_line

        try:
            self.apply(version, tensors)
        except Exception as e:
            self.load_error = f"{self.name} could not load weight version {version}: {first_line(e)}"
            raise

    def check(self) -> None:
        """Raise what broke the background receiver, if anything did (without the health manager a dead
        trainer or a broken group must stop the role, not leave it waiting)."""
        if self._receiver is not None:
            self._receiver.check()

    def wait(self, version: int, timeout_s: float = 300.0) -> int:
        """Block until the role holds weights of ``version`` or newer (a restarted role must not compute
        with its start-up weights); fails naming the role after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.held() < version:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: weights of version {version} did not arrive in {timeout_s}s"
                )
            time.sleep(0.02)
        return self.held()

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
