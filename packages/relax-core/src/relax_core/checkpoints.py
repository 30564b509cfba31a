"""Checkpoint directories that are whole or absent, and the newest whole one to resume from.

Why: a run killed while it writes a checkpoint (the end-of-run save, a SIGKILL, a full disk) must not leave
something ``--load`` trusts. So a checkpoint is written under a temporary name beside its final one and
renamed into place only once complete (a rename is atomic on one file system), with ``manifest.json``
listing every file's size, and its SHA-256 where the file is small enough to hash cheaply (64 MiB). Loading checks
the manifest first; from a directory of ``step_*`` checkpoints the newest that checks out is used, and each
newer one passed over is named with what is wrong with it. A checkpoint without a manifest (written before
manifests existed, or copied in part) is used only with ``--trust-unverified``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_core.hf_files import share_as_new_files
from relax_core.ownership import process_alive

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
HASH_LIMIT = 64 << 20
"""Files up to this size (64 MiB: configs, metadata, optimizer and RNG states of small models, small
models' weights) are hashed; larger ones (a big model's shards) are checked by size, which catches
truncated and missing writes without reading back a checkpoint of hundreds of GB at every save and load."""


class CheckpointNotFound(FileNotFoundError):
    """No checkpoint to load where one was named (none there, or none whole): says which and why."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a read-only or vanished directory, a file-size
    limit): names the checkpoint, the cause and the space left; the previous checkpoints are untouched."""


def check_writable(flag: str, directory: str | Path, need_bytes: int = 0) -> None:
    """Before the first step: ``directory`` can be created and written, and (``need_bytes`` > 0) its disk has
    room for one checkpoint. ``ValueError`` naming the flag, the directory and what to do (a read-only
    --save failed at the first save, after the training it was meant to keep)."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".relax-write-probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"{flag} {d}: cannot write there ({e.strerror or e}); give a directory this user can write"
        ) from None
    free = shutil.disk_usage(d).free
    if need_bytes and free < need_bytes:
        raise ValueError(
            f"{flag} {d}: {free / 2**20:.0f} MiB free, one checkpoint needs about {need_bytes / 2**20:.0f} MiB "
            "(the weights and AdamW's two moments); free space or point it at another disk"
        )


def checkpoint_bytes(model_dir: str | Path) -> int:
    """About what one checkpoint of the model at ``model_dir`` takes: its weight files three times (the
    weights, AdamW's two moments; float32 state is counted at the files' own precision, a lower bound)."""
    files = [p for p in Path(model_dir).glob("*") if p.suffix in (".safetensors", ".bin", ".pt")]
    return 3 * sum(p.stat().st_size for p in files)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: str | Path) -> dict[str, Any]:
    """List every file under ``directory`` (size, and SHA-256 up to :data:`HASH_LIMIT`) in its manifest."""
    root = Path(directory)
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            entry: dict[str, Any] = {"bytes": p.stat().st_size}
            if entry["bytes"] <= HASH_LIMIT:
                entry["sha256"] = _digest(p)
            files[p.relative_to(root).as_posix()] = entry
    manifest = {"files": files}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def extend_manifest(directory: str | Path, parts: list[str]) -> None:
    """Add ``parts`` (files or folders, relative to ``directory``) written after the checkpoint was renamed into
    place to its manifest, replaced atomically: a kill before this leaves them out of the manifest, and a part
    outside the manifest is never trusted (:func:`listed`)."""
    root = Path(directory)
    manifest = json.loads((root / MANIFEST).read_text())
    for part in parts:
        p = root / part
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                entry: dict[str, Any] = {"bytes": f.stat().st_size}
                if entry["bytes"] <= HASH_LIMIT:
                    entry["sha256"] = _digest(f)
                manifest["files"][f.relative_to(root).as_posix()] = entry
    tmp = root / f".{MANIFEST}.writing-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, root / MANIFEST)


def listed(directory: str | Path, part: str) -> bool:
    """Whether the manifest of the checkpoint at ``directory`` lists ``part`` (a file, or any file under a
    folder). A checkpoint without a manifest (written before manifests existed) lists everything."""
    root = Path(directory)
    if not (root / MANIFEST).is_file():
        return True
    try:
        files = json.loads((root / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return False
    return part in files or any(name.startswith(part.rstrip("/") + "/") for name in files)


def remove_stale_writes(parent: str | Path) -> list[Path]:
    """Remove the temporary directories of saves killed mid-write (``.step_N.writing-PID`` whose process is
    gone) under ``parent``; returns what was removed. They are never loaded, but a killed run left them for
    ever (each a whole model's size)."""
    removed = []
    for p in Path(parent).glob(".*.writing-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed


UNVERIFIED = (
    f"{MANIFEST} is missing, so nothing says its files are whole (written before relax-core 0.6, or copied in "
    "part); pass --trust-unverified to use it as it is"
)


def problem(directory: str | Path, trust_unverified: bool = False) -> str | None:
    """What is wrong with the checkpoint at ``directory`` (None: it is whole): the one verifier every reader
    goes through (``--load``, a run's own restarts, ``relax eval`` / ``export``, an engine's disk load). A
    checkpoint is what its manifest says or nothing: without one it is refused (before, it was trusted
    with damaged weights) unless ``trust_unverified``; a manifest of another shape is a problem, not a
    traceback."""
    root = Path(directory)
    if not (root / "meta.json").is_file():
        return "meta.json is missing"
    if not (root / MANIFEST).is_file():
        return None if trust_unverified else UNVERIFIED
    try:
        files = json.loads((root / MANIFEST).read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    shape = isinstance(files, dict) and all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256", ""), str)
        for e in files.values()
    )
    if not shape or "meta.json" not in files:
        return f"{MANIFEST} is not a manifest of this checkpoint (expected files: {{name: {{bytes, sha256}}}} listing meta.json)"
    for name, entry in files.items():
        p = root / name
        if not p.is_file() or root.resolve() not in p.resolve().parents:
            return f"{name} is missing"
        size = p.stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']}"
        if "sha256" in entry and _digest(p) != entry["sha256"]:
            return f"{name} does not match its checksum (damaged after it was written)"
    return None


def enclosing_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint that ``path`` (a checkpoint's ``model/``, a file in it) lies in, or None."""
    for d in [Path(path), *Path(path).resolve().parents]:
        if (d / "meta.json").is_file() and d.name.startswith("step_"):
            return d
    return None


def other_run(step: Path, run_id: str | None) -> str | None:
    """Why ``step`` is not ``run_id``'s checkpoint (None: it is, or no run id was asked for)."""
    if run_id is None:
        return None
    try:  # (run_state.json: relax_core.resume.CheckpointDir's file, read here without importing it)
        theirs = json.loads((step / "run_state.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        theirs = None
    return None if theirs == run_id else f"written by another run ({theirs or 'no run id'})"


def save_atomically(target: str | Path, write: Callable[[Path], None]) -> Path:
    """Have ``write(directory)`` fill a temporary directory beside ``target``, add the manifest, and rename
    it to ``target``. An existing whole checkpoint at ``target`` is kept as it is: a checkpoint of the same
    step holds the same state (the end-of-run save after a step's save), and rewriting it in place was
    what a kill during the last save destroyed. A damaged one is replaced."""
    target = Path(target)
    if target.is_dir() and problem(target) is None:
        return target
    for stale in remove_stale_writes(target.parent):
        logger.info("removed %s, left by a save that was killed", stale)
    tmp = target.with_name(f".{target.name}.writing-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # (the directory too: made before this block, a read-only --save was a traceback)
        tmp.mkdir(parents=True)
        write(tmp)
        share_as_new_files(tmp)  # (safetensors writes its files 0600)
        write_manifest(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # (a kill leaves it: its dot-name is never loaded)
        if not isinstance(e, Exception):
            raise
        # torch's writer says "RuntimeError: unexpected pos ..." for a full disk: say what failed, and where
        free = shutil.disk_usage(target.parent).free if target.parent.is_dir() else 0
        raise CheckpointWriteError(
            f"writing checkpoint {target} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
            f"{free / 2**20:.0f} MiB free there); the previous checkpoints are kept: free space or point --save "
            "elsewhere, then resume with --load"
        ) from e
    if target.exists():  # a damaged leftover of this step
        old = target.with_name(f".{target.name}.damaged-{os.getpid()}")
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, target)
    return target


def latest_checkpoint(path: str | Path, run_id: str | None = None, trust_unverified: bool = False) -> str:
    """The checkpoint ``--load PATH`` resumes from: PATH itself when it is one (it must be whole), else
    the newest whole ``step_*`` under it; newer ones that are not whole are passed over, each named with
    its problem in a warning. ``run_id`` (a run's own restarts): only that run's checkpoints count, another
    run's are passed over like damaged ones. ``trust_unverified``: one without a manifest counts as whole.
    Raises ``CheckpointNotFound`` when there is none to use."""
    p = Path(path)
    if (p / "meta.json").is_file():
        wrong = problem(p, trust_unverified)
        if wrong:
            raise CheckpointNotFound(f"--load {p}: the checkpoint is damaged: {wrong}; load another one")
        return str(p)
    passed_over: list[tuple[Path, str]] = []
    for step in sorted((d for d in p.glob("step_*") if d.is_dir()), reverse=True):
        wrong = problem(step, trust_unverified) or other_run(step, run_id)
        if wrong is None:
            for name, why in passed_over:
                logger.warning("checkpoint %s is not whole (%s): resuming from %s instead", name, why, step)
            return str(step)
        passed_over.append((step, wrong))
    detail = "; ".join(f"{name.name}: {why}" for name, why in passed_over)
    raise CheckpointNotFound(
        f"--load {path}: no whole checkpoint found (expected meta.json or step_*/meta.json"
        + (f"; {detail}" if detail else "")
        + ")"
    )
