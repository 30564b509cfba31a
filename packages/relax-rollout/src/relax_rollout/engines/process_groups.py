"""Engine processes as process groups: start one in a session of its own (its log written with its token
as ``***``), tell whether any of a group is left, stop groups (SIGTERM, then SIGKILL) and reap what they
leave. Split from :mod:`relax_rollout.engines.processes`, which decides what runs where; this module only
knows processes.

Why the reaping: an engine such as SGLang forks children (its scheduler, its detokenizer) that outlive a
killed leader. Orphans go to PID 1, and where PID 1 does not reap (a container without an init, as on the
machine that found this) they stay zombies that keep the process group "alive" and slow every close by the
whole grace time. The process that starts engines adopts them instead (``PR_SET_CHILD_SUBREAPER``) and
reaps them when it stops their group.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol, cast


class StoppedByItsNode(Protocol):
    """A process on another node (``processes.RemoteProcess``, which imports this module): its node's
    launcher stops it."""

    remote: bool

    def stop(self, grace_s: float) -> None: ...


logger = logging.getLogger(__name__)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: the group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` is left."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_processes(procs: Sequence[subprocess.Popen | StoppedByItsNode], grace_s: float) -> None:
    """SIGTERM every process group, wait up to ``grace_s`` for the leaders to exit and their groups to
    empty, SIGKILL what is left, and reap the leaders. Processes on other nodes (:class:`RemoteProcess`)
    are stopped the same way by their node's launcher."""
    for p in procs:
        if getattr(p, "remote", False):
            cast(StoppedByItsNode, p).stop(grace_s)
    local = [cast(subprocess.Popen, p) for p in procs if not getattr(p, "remote", False)]
    live = [p for p in local if p.poll() is None or group_alive(p.pid)]
    for p in live:
        signal_group(p, signal.SIGTERM)

    def left() -> bool:
        reap_orphans({p.pid for p in live})
        return any(p.poll() is None or group_alive(p.pid) for p in live)

    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and left():
        time.sleep(0.05)
    for p in live:
        if p.poll() is None or group_alive(p.pid):
            signal_group(p, signal.SIGKILL)
    for p in live:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("engine process %d did not exit after SIGKILL", p.pid)
    deadline = time.monotonic() + 5.0  # (SIGKILLed members: gone, or zombies of ours to reap)
    while time.monotonic() < deadline and left():
        time.sleep(0.05)


def become_subreaper() -> None:
    """Adopt the orphans of the engines this process starts (Linux ``PR_SET_CHILD_SUBREAPER``), so that
    :func:`reap_orphans` can reap them. Without it an engine's children (SGLang's scheduler and
    detokenizer) that outlive their leader go to PID 1, and where PID 1 does not reap, as in a container
    without an init, every engine restart leaves zombies that hold its process group. (Every orphan of this
    process's descendants comes here then; engines' are reaped when their group stops, and a rollout role
    starts no other process that leaves orphans.)"""
    global _SUBREAPER
    if _SUBREAPER or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # 36: PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # (no prctl: orphans go to PID 1 as before)
        pass
    _SUBREAPER = True


_SUBREAPER = False


def reap_orphans(pgids: Collection[int]) -> None:
    """Reap the exited members of the process groups ``pgids`` that are children of this process (orphans
    adopted by :func:`become_subreaper`), all but the leaders (their ``Popen`` reaps them)."""
    for members in group_members(pgids).values():
        for m in members:
            if m.pid not in pgids and m.state == "Z" and m.ppid == os.getpid():
                try:
                    os.waitpid(m.pid, os.WNOHANG)
                except ChildProcessError:  # (reaped meanwhile)
                    pass


class Member(NamedTuple):
    """A process of a group, as /proc/PID/stat has it."""

    pid: int
    state: str
    ppid: int
    name: str


def group_members(pgids: Collection[int]) -> dict[int, list[Member]]:
    """The processes of each process group of ``pgids`` (one pass over /proc; empty where there is none)."""
    found: dict[int, list[Member]] = {g: [] for g in pgids}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # state, ppid, pgrp, ...
        if (pgrp := int(fields[2])) in found:
            comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
            found[pgrp].append(Member(int(name), fields[0].decode(), int(fields[1]), comm))
    return found


def spawn(
    cmd: list[str], env: dict[str, str], log_path: str | Path, header: str, secret: str | None = None
) -> subprocess.Popen:
    """Start ``cmd`` with ``env`` in a session of its own (so its process group ends with it), its output
    appended to ``log_path`` after ``header``. ``secret`` (the engine's token): written ``***`` wherever the
    output has it, through a thread of this process. SGLang logs its whole ``server_args``, ``--api-key``
    among them, and an engine's log is read by anyone who reads the run's output directory."""
    become_subreaper()
    with open(log_path, "ab") as log:
        log.write(header.encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log if not secret else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    if secret:
        name = f"relax-engine-log-{proc.pid}"
        threading.Thread(target=_copy_redacted, args=(proc, log_path, secret), name=name, daemon=True).start()
    return proc


def _copy_redacted(proc: subprocess.Popen, log_path: str | Path, secret: str) -> None:
    """Copy ``proc``'s output to ``log_path`` line by line, ``secret`` replaced, until it closes."""
    token = secret.encode()
    assert proc.stdout is not None, "spawn pipes the output of a process whose log holds a secret"
    with proc.stdout, open(log_path, "ab") as log:
        for line in iter(proc.stdout.readline, b""):
            log.write(line.replace(token, b"***"))
            log.flush()


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"
