"""The ``sglang`` engine's lifecycle: its servers launched, added to the pool, watched and restarted.

Why apart from :mod:`relax_rollout.engines.sglang.engine`: what keeps the servers running — start-up, the
supervisor thread, bounded restarts and when a restarted engine may serve again — changes for other reasons
than the requests the engine sends them (generation, control, weights), and reads best in one place.
:class:`SGLangLifecycle` is that part, one object per engine (``engine.lifecycle``), as
:class:`~relax_rollout.engines.sglang.weights.SGLangWeights` is its weight updates; both act on the engine's
:class:`~relax_rollout.engines.sglang.state.SGLangServers`. The processes themselves are
:mod:`relax_rollout.engines.processes`.

A restarted engine rejoins the pool only with the current weights: loaded from the directory of the last
update from disk, or (``weight_update="distributed"``) at the next broadcast, waiting out of the pool until
then. Weights that came as tensors or from a caller's broadcast cannot be given to it: it is left failed,
saying so. Serving LoRA adapters, the engine keeps them in host memory and a restarted engine loads them
before it joins (``restore``, :meth:`~relax_rollout.engines.sglang.lora.SGLangAdapters.restore`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from relax_rollout.engines.pool_members import Member, PoolError
from relax_rollout.engines.processes import EngineProcess, EngineStartError, Launcher, stop_processes
from relax_rollout.engines.sglang.state import SGLangServers
from relax_rollout.engines.wire import pause_request

logger = logging.getLogger(__name__)


def log_pool_failure(member: Member) -> None:
    """The pool's ``on_failure``: the supervisor takes a failed member up at its next poll."""
    logger.warning("engine %s (%s) failed in the pool: %s", member.id, member.url, member.error)


class SGLangLifecycle:
    """Start-up and supervision of ``servers`` (see the module docstring), launched by ``launcher``.
    ``startup_timeout_s``: how long an engine may take to serve; ``poll_interval_s``: how often the
    supervisor looks; ``max_restarts``: restarts per engine; ``shutdown_grace_s``: SIGTERM to SIGKILL."""

    def __init__(
        self,
        servers: SGLangServers,
        launcher: Launcher,
        *,
        startup_timeout_s: float,
        poll_interval_s: float,
        max_restarts: int,
        shutdown_grace_s: float,
        restore: Callable[[EngineProcess, Callable[[EngineProcess], None]], None] | None = None,
    ) -> None:
        self.servers, self.launcher = servers, launcher
        self.restore = restore
        """``restore(slot, join)``: give a restarted engine what it must serve, then ``join`` it (LoRA
        adapters); None: the current weights from the last update's directory."""
        self.startup_timeout_s, self.poll_interval_s = startup_timeout_s, poll_interval_s
        self.max_restarts, self.shutdown_grace_s = max_restarts, shutdown_grace_s
        self.initial_version: int | None = None
        """The weight version a freshly started engine reports (known after :meth:`start`)."""
        self._thread: threading.Thread | None = None

    # -- start-up ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Launch every engine, wait until all serve (raising, naming each one that did not), add them to
        the pool, then supervise them from a thread. On an error the caller closes the engine."""
        s = self.servers
        for slot in s.slots:
            self.launcher.launch(slot)
        ready = self.launcher.wait_ready
        futs = [s.executor.submit(ready, slot, self.startup_timeout_s) for slot in s.slots]
        errors = []
        for slot, f in zip(s.slots, futs):
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 — reported all together below
                errors.append(f"engine {slot.index}: {e}")
        if errors:
            raise EngineStartError("SGLang engines failed to start:\n" + "\n".join(errors))
        for slot in s.slots:
            self.join(slot)
        self.initial_version = s.pool.weight_version  # what a fresh engine reports
        self._thread = threading.Thread(target=self._supervise, name="relax-sglang-supervisor", daemon=True)
        self._thread.start()

    def join(self, slot: EngineProcess) -> None:
        """Add a ready engine to the pool, paused when the others are."""
        s = self.servers
        assert slot.url is not None
        member = s.pool.membership.add(slot.url, kind="startup", handle=slot.index, protected=True)
        with s.lock:
            # the others are paused: so is a newcomer. Paused under the lock, before it shows as running: a
            # resume() racing this join either lands first (nothing to pause) or after (it continues the
            # newcomer too); sent after the lock, the pause could arrive after a resume's continue and hold
            # the newcomer's requests forever (seen under load in CI: the reissued half never returned)
            if s.paused is not None:
                s.call(slot.url, "/pause_generation", pause_request(s.paused), timeout_s=30.0)
            slot.member_id, slot.state = member.id, "running"  # error: why it last failed, if ever

    # -- supervision ------------------------------------------------------------------------------
    def _supervise(self) -> None:
        while not self.servers.stop.wait(self.poll_interval_s):
            for slot in self.servers.slots:
                try:
                    self.check(slot)
                except Exception:  # noqa: BLE001 — the supervisor must keep running
                    logger.exception("engine %d: supervision failed", slot.index)

    def check(self, slot: EngineProcess) -> None:
        """Restart ``slot`` (from a thread) when its process exited or the pool marked it failed."""
        s = self.servers
        with s.lock:
            if s.closed or slot.state != "running" or slot.proc is None:
                return
            rc = slot.proc.poll()
            member = s.pool.membership.get(slot.member_id) if slot.member_id else None
            if rc is not None:
                reason = f"process {slot.proc.pid} exited with code {rc}"
            elif member is not None and member.state == "failed":
                reason = f"unhealthy ({member.error})"
            else:
                return
            slot.state, slot.error = "restarting", reason
        logger.warning(
            "engine %d: %s; the end of %s:\n%s",
            slot.index,
            reason,
            slot.log_path,
            self.launcher.tail(slot, 10),
        )
        if member is not None:
            s.pool.membership.mark_failed(member.id, reason)
        threading.Thread(
            target=self.restart, args=(slot, member), name=f"relax-sglang-restart-{slot.index}", daemon=True
        ).start()

    def restart(self, slot: EngineProcess, old: Member | None) -> None:
        """Stop ``slot``'s processes and launch it again, within ``max_restarts``; it replaces ``old`` in
        the pool once it holds the current weights."""
        s = self.servers
        while True:
            if slot.proc is not None:
                stop_processes([slot.proc], self.shutdown_grace_s)  # the rest of its process group too
            with s.lock:
                if s.closed:
                    slot.state = "stopped"
                    return
                if slot.restarts >= self.max_restarts:
                    slot.state = "failed"
                    slot.error = f"{slot.error}; not restarted again (max_restarts={self.max_restarts})"
                    logger.error("engine %d failed for good: %s", slot.index, slot.error)
                    return
                slot.restarts += 1
            try:
                self.launcher.launch(slot)
                self.launcher.wait_ready(slot, self.startup_timeout_s)
                if self.restore is not None:  # the base weights never change: only the adapters
                    self.restore(slot, self.join)
                elif s.pool.weights_path is None and s.pool.weight_version != self.initial_version:
                    if s.weight_update in ("distributed", "delta"):  # the next update takes it in
                        with s.lock:
                            slot.state = "waiting"
                        if old is not None:
                            try:
                                s.pool.membership.retire(old.id)
                            except PoolError:
                                pass
                        logger.info(
                            "engine %d restarted (%d/%d) at %s; it serves after the next weight update",
                            slot.index,
                            slot.restarts,
                            self.max_restarts,
                            slot.url,
                        )
                        return
                    raise PoolError(
                        f"the current weights (version {s.pool.weight_version}) came over NCCL or as tensors "
                        "and cannot be given to a restarted engine; it rejoins after the next update from disk "
                        "(update_weights with weight_update='disk', or update_weights_from_disk)"
                    )
                else:
                    self.join(slot)
            except Exception as e:  # noqa: BLE001 — try again within the bound
                with s.lock:
                    slot.error = f"restart {slot.restarts} failed: {e}"
                    closed = s.closed
                logger.warning("engine %d: %s", slot.index, slot.error)
                if closed or isinstance(e, PoolError) and "cannot be given" in str(e):
                    if slot.proc is not None:
                        stop_processes([slot.proc], self.shutdown_grace_s)
                    with s.lock:
                        slot.state = "stopped" if closed else "failed"
                    return
                continue
            if old is not None:
                try:
                    s.pool.membership.retire(old.id, replaced_by=slot.member_id)
                except PoolError:
                    pass
            logger.info(
                "engine %d restarted (%d/%d) at %s", slot.index, slot.restarts, self.max_restarts, slot.url
            )
            return

    def restart_later(self, slot: EngineProcess, reason: str) -> None:
        """Restart an engine that is not in the pool (it was waiting for weights) from a thread."""
        with self.servers.lock:
            slot.state, slot.error = "restarting", reason
        threading.Thread(
            target=self.restart, args=(slot, None), daemon=True, name=f"relax-sglang-restart-{slot.index}"
        ).start()

    def wait_stopped(self) -> None:
        """Once the servers' stop event is set: wait for the supervisor thread (unless this is it)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.poll_interval_s + 5)
