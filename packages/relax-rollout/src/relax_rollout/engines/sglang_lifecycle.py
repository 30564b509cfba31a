"""The ``sglang`` engine's lifecycle: its servers launched, added to the pool, watched and restarted.

Why apart from :mod:`relax_rollout.engines.sglang`: what keeps the servers running — start-up, the
supervisor thread, bounded restarts and when a restarted engine may serve again — changes for other reasons
than the requests the engine sends them (generation, control, weights), and reads best in one place.
:class:`SGLangLifecycle` is that part, one object per engine (``engine.lifecycle``), as
:class:`~relax_rollout.engines.sglang_weights.SGLangWeights` is its weight updates; the processes themselves
are :mod:`relax_rollout.engines.processes`.

A restarted engine rejoins the pool only with the current weights: loaded from the directory of the last
update from disk, or (``weight_update="distributed"``) at the next broadcast, waiting out of the pool until
then. Weights that came as tensors or from a caller's broadcast cannot be given to it: it is left failed,
saying so.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

from relax_rollout.engines.pool import Member, PoolError
from relax_rollout.engines.processes import (
    EngineProcess,
    EngineStartError,
    fill_template,
    launch_command,
    stop_processes,
)
from relax_rollout.engines.wire import pause_request

if TYPE_CHECKING:
    from relax_rollout.engines.sglang import SGLangEngine

logger = logging.getLogger(__name__)


class SGLangLifecycle:
    """Start-up and supervision of ``engine``'s servers (see the module docstring). It reads the engine's
    slots, launcher, pool, lock, pause state and bounds when it acts, and calls the engines through
    ``engine._call``."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine
        self.initial_version: int | None = None
        """The weight version a freshly started engine reports (known after :meth:`start`)."""
        self._thread: threading.Thread | None = None

    # -- start-up ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Launch every engine, wait until all serve (or close the engine, naming each one that did not),
        add them to the pool, then supervise them from a thread."""
        eng = self.engine
        try:
            for slot in eng.slots:
                eng.launcher.launch(slot)
            ready = eng.launcher.wait_ready
            futs = [eng._exec.submit(ready, slot, eng.startup_timeout_s) for slot in eng.slots]
            errors = []
            for slot, f in zip(eng.slots, futs):
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 — reported all together below
                    errors.append(f"engine {slot.index}: {e}")
            if errors:
                raise EngineStartError("SGLang engines failed to start:\n" + "\n".join(errors))
            for slot in eng.slots:
                self.join(slot)
        except BaseException:
            eng.close()
            raise
        self.initial_version = eng.pool.weight_version  # what a fresh engine reports
        self._thread = threading.Thread(target=self._supervise, name="relax-sglang-supervisor", daemon=True)
        self._thread.start()

    def command(self, slot: EngineProcess, port: int, host: str) -> list[str]:
        """The command line of ``slot``'s engine: ``launch_cmd`` filled in, else SGLang's own."""
        eng = self.engine
        if eng.launch_cmd is not None:
            return fill_template(
                eng.launch_cmd,
                port=port,
                host=host,
                model_path=eng.model_path,
                tp_size=eng.tp_size,
                dtype=eng.dtype,
                engine_index=slot.index,
                token=eng.token or "",
            )
        return launch_command(
            eng.model_path,
            host,
            port,
            eng.tp_size,
            eng.dtype,
            eng.mem_fraction_static,
            eng.server_args,
            eng.routing is not None,
            eng.python,
        )

    def shared_paths(self) -> list[str]:
        """What an engine on another node must see at the same path: the weights directory, the model."""
        eng = self.engine
        return ([str(eng.pool.weights_root)] if eng.weight_update == "disk" else []) + (
            [eng.model_path] if os.path.exists(eng.model_path) else []
        )

    def join(self, slot: EngineProcess) -> None:
        """Add a ready engine to the pool, paused when the others are."""
        eng = self.engine
        assert slot.url is not None
        member = eng.pool.add(slot.url, kind="startup", handle=slot.index, protected=True)
        with eng._lock:
            slot.member_id, slot.state = member.id, "running"  # error: why it last failed, if ever
            paused = eng._paused
        if paused is not None:  # the others are paused: so is a newcomer
            eng._call(slot.url, "/pause_generation", pause_request(paused))

    # -- supervision ------------------------------------------------------------------------------
    def on_pool_failure(self, member: Member) -> None:
        logger.warning("engine %s (%s) failed in the pool: %s", member.id, member.url, member.error)

    def _supervise(self) -> None:
        eng = self.engine
        while not eng._stop.wait(eng.poll_interval_s):
            for slot in eng.slots:
                try:
                    self.check(slot)
                except Exception:  # noqa: BLE001 — the supervisor must keep running
                    logger.exception("engine %d: supervision failed", slot.index)

    def check(self, slot: EngineProcess) -> None:
        """Restart ``slot`` (from a thread) when its process exited or the pool marked it failed."""
        eng = self.engine
        with eng._lock:
            if eng._closed or slot.state != "running" or slot.proc is None:
                return
            rc = slot.proc.poll()
            member = eng.pool.get(slot.member_id) if slot.member_id else None
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
            eng.launcher.tail(slot, 10),
        )
        if member is not None:
            eng.pool.mark_failed(member.id, reason)
        threading.Thread(
            target=self.restart, args=(slot, member), name=f"relax-sglang-restart-{slot.index}", daemon=True
        ).start()

    def restart(self, slot: EngineProcess, old: Member | None) -> None:
        """Stop ``slot``'s processes and launch it again, within ``max_restarts``; it replaces ``old`` in
        the pool once it holds the current weights."""
        eng = self.engine
        while True:
            if slot.proc is not None:
                stop_processes([slot.proc], eng.shutdown_grace_s)  # the rest of its process group too
            with eng._lock:
                if eng._closed:
                    slot.state = "stopped"
                    return
                if slot.restarts >= eng.max_restarts:
                    slot.state = "failed"
                    slot.error = f"{slot.error}; not restarted again (max_restarts={eng.max_restarts})"
                    logger.error("engine %d failed for good: %s", slot.index, slot.error)
                    return
                slot.restarts += 1
            try:
                eng.launcher.launch(slot)
                eng.launcher.wait_ready(slot, eng.startup_timeout_s)
                if eng.pool.weights_path is None and eng.pool.weight_version != self.initial_version:
                    if eng.weight_update == "distributed":  # the next update re-forms the group with it
                        with eng._lock:
                            slot.state = "waiting"
                        if old is not None:
                            try:
                                eng.pool.retire(old.id)
                            except PoolError:
                                pass
                        logger.info(
                            "engine %d restarted (%d/%d) at %s; it serves after the next weight update",
                            slot.index,
                            slot.restarts,
                            eng.max_restarts,
                            slot.url,
                        )
                        return
                    raise PoolError(
                        f"the current weights (version {eng.pool.weight_version}) came over NCCL or as tensors "
                        "and cannot be given to a restarted engine; it rejoins after the next update from disk "
                        "(update_weights with weight_update='disk', or update_weights_from_disk)"
                    )
                self.join(slot)
            except Exception as e:  # noqa: BLE001 — try again within the bound
                with eng._lock:
                    slot.error = f"restart {slot.restarts} failed: {e}"
                    closed = eng._closed
                logger.warning("engine %d: %s", slot.index, slot.error)
                if closed or isinstance(e, PoolError) and "cannot be given" in str(e):
                    if slot.proc is not None:
                        stop_processes([slot.proc], eng.shutdown_grace_s)
                    with eng._lock:
                        slot.state = "stopped" if closed else "failed"
                    return
                continue
            if old is not None:
                try:
                    eng.pool.retire(old.id, replaced_by=slot.member_id)
                except PoolError:
                    pass
            logger.info(
                "engine %d restarted (%d/%d) at %s", slot.index, slot.restarts, eng.max_restarts, slot.url
            )
            return

    def restart_later(self, slot: EngineProcess, reason: str) -> None:
        """Restart an engine that is not in the pool (it was waiting for weights) from a thread."""
        eng = self.engine
        with eng._lock:
            slot.state, slot.error = "restarting", reason
        threading.Thread(
            target=self.restart, args=(slot, None), daemon=True, name=f"relax-sglang-restart-{slot.index}"
        ).start()

    def wait_stopped(self) -> None:
        """Once the engine's stop event is set: wait for the supervisor thread (unless this is it)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.engine.poll_interval_s + 5)
