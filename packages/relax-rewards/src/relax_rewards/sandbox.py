"""Run untrusted Python in a locked-down subprocess: time, memory and process limits, no network.

Why a subprocess and not ``exec``: model-written code can loop forever, allocate 100 GB, fork-bomb,
delete files or phone home. The child gets

- a fresh temporary directory as its working directory (deleted afterwards) and a clean environment
  (no inherited variables, ``HOME`` = the temp dir);
- ``python -I -S``: isolated mode, no site-packages, no user site, no ``PYTHON*`` variables;
- ``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` (a backstop to the wall-clock time-out), ``RLIMIT_FSIZE``
  (file size), ``RLIMIT_CORE`` = 0, set in the child before ``exec``;
- no network: a fresh network namespace with no interfaces (``unshare -rn``) when the kernel lets
  unprivileged users create one, and in every case an audit hook installed before the user code runs
  that refuses socket creation, subprocesses, ``fork`` / ``exec`` and ``ctypes`` loading;
- its own session, so a time-out kills the whole process group.

This is defence in depth for RL reward computation, not a boundary against a determined attacker
with a kernel exploit; run training on machines where that matters inside a VM or gVisor.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["SandboxResult", "network_namespace_available", "run_python"]

_GUARD = r"""
import sys
_BLOCKED = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
            "os.fork", "os.forkpty", "ctypes.dlopen", "os.kill", "os.killpg", "pty.spawn")
def _guard(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_guard)
del _guard
_path = sys.argv[1]
sys.argv = sys.argv[1:]
with open(_path) as _f:
    _code = compile(_f.read(), "solution.py", "exec")
del _f, _path
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run. ``returncode`` is negative for a signal (e.g. -9)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@functools.cache
def network_namespace_available() -> bool:
    """True when ``unshare -rn`` works here (unprivileged user + network namespaces)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limits(memory_mb: int, cpu_s: int, file_mb: int):
    def apply() -> None:  # runs in the child between fork and exec
        import resource

        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(
    code: str,
    stdin: str = "",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_chars: int = 100_000,
    use_namespace: bool | None = None,
) -> SandboxResult:
    """Run ``code`` as a script in the sandbox, feeding ``stdin``; never raises for bad code.

    >>> run_python("print(input()[::-1])", "abc").stdout
    'cba\\n'
    >>> run_python("import socket; socket.socket()").returncode
    1
    >>> run_python("while True: pass", timeout_s=0.3).timed_out
    True
    """
    if use_namespace is None:
        use_namespace = network_namespace_available()
    with tempfile.TemporaryDirectory(prefix="relax-sandbox-") as tmp:
        with open(os.path.join(tmp, "solution.py"), "w") as f:
            f.write(code)
        guard = os.path.join(tmp, "_guard.py")
        with open(guard, "w") as f:
            f.write(_GUARD)
        cmd = [sys.executable, "-I", "-S", "-B", guard, os.path.join(tmp, "solution.py")]
        if use_namespace:
            cmd = [shutil.which("unshare") or "unshare", "-rn", *cmd]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp,
            env=env,
            start_new_session=True,
            preexec_fn=_limits(memory_mb, max(1, int(timeout_s) + 1), 16),
            text=True,
            errors="replace",
        )
        timed_out = False
        try:
            out, err = proc.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        return SandboxResult(
            proc.returncode,
            out[:max_output_chars],
            err[-max_output_chars:],
            timed_out,
            time.monotonic() - start,
        )
