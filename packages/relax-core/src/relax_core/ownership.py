"""A run owns its directories and knows its data: the lock on ``--output-dir`` / ``--save``, the run's id,
and the fingerprint of the prompt file it trains on.

Why: a second run on the same directories interleaved its metrics with the first (steps 1-6 twice in one
``metrics.jsonl``), a fresh run into a ``--save`` holding another run's checkpoints kept them and its restarts
resumed the other run, and a prompt file rewritten mid-run was read by a restarted rollout without a word.
So a run takes an exclusive lock on each directory it writes (``flock``: released by the kernel when the
process ends, however it ends; the holder's pid, host and start time are in the lock file for the message),
every checkpoint records the run's id and the data's fingerprint (``run_state.json``), the in-run restarts
take only their own run's checkpoints, and the data is compared with its fingerprint whenever it is read
again: at ``--load`` and when a rollout role restarts. ``<output_dir>/run.json`` holds the id and the
fingerprints for the roles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relax_core.health import Unfixable

logger = logging.getLogger(__name__)

LOCK = ".relax.lock"
RUN_FILE = "run.json"


class DirectoryInUse(RuntimeError):
    """Another live run holds the lock on a directory this run would write."""


class DataChanged(Unfixable):
    """The prompt file is not the one the run (or the checkpoint it resumes) trained on."""


class SettingsChanged(Unfixable):
    """A setting that gives the checkpoint's weights their meaning differs from the checkpoint's."""


class RunLocks(contextlib.ExitStack):
    """Exclusive locks on the directories a run writes, held until the context ends."""

    def __init__(self, directories: list[tuple[str, str | None]]) -> None:
        super().__init__()
        self.directories = [(flag, d) for flag, d in directories if d]

    def __enter__(self) -> RunLocks:
        super().__enter__()
        try:  # (one lock per directory: --save equal to --output-dir would otherwise lock itself out)
            seen: set[str] = set()
            for flag, d in self.directories:
                if os.path.realpath(d) not in seen:
                    seen.add(os.path.realpath(d))
                    self.enter_context(_lock(flag, Path(d)))
        except BaseException:
            self.close()
            raise
        return self


_held: set[int] = set()
"""The file descriptors of the locks this process holds."""


def _close_held_in_child() -> None:
    """In a forked child: close the copies of the parent's lock descriptors. A flock belongs to the open
    file, which a fork shares: a child that outlives its parent (a reward worker of a run killed with -9)
    held the run's lock for ever. (Exec'd children never get them: Python opens them close-on-exec.)"""
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


@contextlib.contextmanager
def _lock(flag: str, directory: Path) -> Iterator[None]:
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    _held.add(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "{}"
            try:
                h = json.loads(holder)
                who = f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}"
            except ValueError:
                who = "another process"
            raise DirectoryInUse(
                f"{flag} {directory}: another run is using it ({who}); wait for it to end, stop it, or give "
                f"this run another {flag}"
            ) from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        _held.discard(fd)
        os.close(fd)  # (releases the lock)


def _steps(save: str, after: int | None = None) -> list[Path]:
    """The ``step_*`` checkpoint directories in ``save`` (those numbered over ``after`` where given), in order."""
    steps = [p for p in Path(save).glob("step_*") if p.is_dir()]
    if after is not None:
        steps = [p for p in steps if p.name[5:].isdigit() and int(p.name[5:]) > after]
    return sorted(steps)


def _claim(save: str, steps: list[Path], overwrite: bool, refusal: str, whose: str) -> None:
    """``steps`` (``whose`` checkpoints in ``save``) refused with ``refusal`` (``DirectoryInUse``), or with
    ``overwrite`` deleted."""
    import shutil

    if not steps:
        return
    if not overwrite:
        raise DirectoryInUse(refusal)
    for p in steps:
        shutil.rmtree(p)
    logger.warning("--overwrite: deleted %d checkpoint(s) %s from %s", len(steps), whose, save)


def claim_save_dir(save: str, overwrite: bool) -> None:
    """A fresh run (no --load) writes into ``save``: checkpoints there belong to another run. Refused
    (``DirectoryInUse``), or with ``overwrite`` deleted first."""
    old = _steps(save)
    refusal = (
        f"--save {save} holds {len(old)} checkpoint(s) of another run ({old[0].name} .. {old[-1].name}): "
        f"resume that run with --load {save}, give this one another --save, or pass --overwrite to delete them"
        if old
        else ""
    )
    _claim(save, old, overwrite, refusal, "of another run")


def claim_branch(save: str, loaded: str, overwrite: bool) -> None:
    """``--load`` of a checkpoint with later ones of its run in ``--save`` (``--load S/step_3 --save S``):
    a branch. Its steps would land beside the old run's (a save keeps a whole checkpoint already at its
    step, so the branch's were dropped, and a restart took the old run's newest). Refused
    (``DirectoryInUse``) naming them, or with ``overwrite`` the later ones deleted first."""
    try:
        at = int(json.loads((Path(loaded) / "meta.json").read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # (the loader says what is wrong with it)
    later = _steps(save, at)
    refusal = (
        f"--save {save} holds {len(later)} checkpoint(s) after the one loaded ({Path(loaded).name}): "
        f"{later[0].name} .. {later[-1].name}; a branch from it would mix its steps with those. Give this run "
        "another --save, or pass --overwrite to delete them"
        if later
        else ""
    )
    _claim(save, later, overwrite, refusal, "after the branch point")


def fingerprint(path: str | Path) -> dict[str, Any]:
    """Size, modification time and SHA-256 of a data file (of every file under a data folder, in order)."""
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    size = 0
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
    mtime = max((f.stat().st_mtime for f in files), default=0.0)
    return {"path": str(p), "bytes": size, "mtime": round(mtime, 3), "sha256": h.hexdigest()}


def difference(was: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What changed between two fingerprints of the same data, in words (None: the same content)."""
    if was.get("sha256") == now.get("sha256"):
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now.get("mtime", 0)))
    return (
        f"{now.get('path')} changed: {was.get('bytes')} -> {now.get('bytes')} bytes, modified {when}, "
        f"content hash {str(was.get('sha256'))[:12]} -> {str(now.get('sha256'))[:12]}"
    )


def check_data(was: dict[str, Any] | None, now: dict[str, Any], where: str, allow_change: bool) -> None:
    """Refuse (``DataChanged``) data that is not what ``was`` fingerprinted, naming ``where`` it was recorded
    and the difference; with ``allow_change`` log it and go on."""
    diff = difference(was, now) if was else None
    if diff is None:
        return
    if allow_change:
        logger.warning("%s: %s (--allow-data-change: going on with the new content)", where, diff)
        return
    raise DataChanged(
        f"{where} trained on other data: {diff}. Restore the file, or pass --allow-data-change to train on "
        "the new content (the prompts drawn from here on will not be the uninterrupted run's)"
    )


DATA_SETTINGS = {
    "seed": ("train", "seed"),
    "rollout_batch_size": ("rollout", "rollout_batch_size"),
    "n_samples_per_prompt": ("rollout", "n_samples_per_prompt"),
    "rollout_shuffle": ("data", "rollout_shuffle"),
    "input_key": ("data", "input_key"),
    "label_key": ("data", "label_key"),
    "metadata_key": ("data", "metadata_key"),
}
"""The settings that decide which prompts each step draws (beside the file itself): a resume that changes
one trains other prompts than the run it continues."""


def data_settings(cfg: Any) -> dict[str, Any]:
    """This run's values of :data:`DATA_SETTINGS`."""
    return {name: getattr(getattr(cfg, at[0]), at[1]) for name, at in DATA_SETTINGS.items()}


APPLIED, REFUSED = "applied", "refused"
TRAIN_SETTINGS: dict[str, tuple[str, str, str]] = {
    # the optimizer's: put into the loaded optimizer's parameter groups (its moments are kept)
    "lr": ("train", "lr", APPLIED),
    "adam_beta1": ("train", "adam_beta1", APPLIED),
    "adam_beta2": ("train", "adam_beta2", APPLIED),
    "weight_decay": ("train", "weight_decay", APPLIED),
    "critic_lr": ("critic", "critic_lr", APPLIED),
    # the loss's: read at every step
    "policy_loss": ("algo", "policy_loss", APPLIED),
    "loss_agg_mode": ("algo", "loss_agg_mode", APPLIED),
    "eps_clip": ("algo", "eps_clip", APPLIED),
    "eps_clip_high": ("algo", "eps_clip_high", APPLIED),
    "kl_coef": ("algo", "kl_coef", APPLIED),
    "entropy_coef": ("algo", "entropy_coef", APPLIED),
    # the adapter's: they give its saved weights their meaning (its shape, what it adapts, its scale)
    "lora_rank": ("lora", "lora_rank", REFUSED),
    "lora_alpha": ("lora", "lora_alpha", REFUSED),
    "lora_target_modules": ("lora", "lora_target_modules", REFUSED),
    "lora_target_parameters": ("lora", "lora_target_parameters", REFUSED),
    "lora_dropout": ("lora", "lora_dropout", APPLIED),
}
"""What ``--load`` does with a setting that changes the optimisation and differs from the checkpoint's: the
one rule. ``applied``: the settings given win from the first step (before, ``--lr`` with ``--load`` was
ignored: the optimizer's saved parameter groups won while ``config.json`` said otherwise). ``refused``: the
run stops before any model loads, naming the difference (before, another ``--lora-alpha`` rescaled the
adapter without a word)."""


def train_settings(cfg: Any) -> dict[str, Any]:
    """This run's values of :data:`TRAIN_SETTINGS`."""
    return {name: getattr(getattr(cfg, at[0]), at[1]) for name, at in TRAIN_SETTINGS.items()}


def check_train_settings(was: dict[str, Any] | None, now: dict[str, Any], where: str) -> list[str]:
    """:data:`TRAIN_SETTINGS`' rule against the checkpoint's recorded values ``was`` (None: a checkpoint
    from before they were recorded, nothing to compare): ``SettingsChanged`` for a refused difference, else
    the applied differences in words."""
    diff = {k: (was[k], v) for k, v in now.items() if was and k in was and was[k] != v}
    flag = {k: "--" + k.replace("_", "-") for k in diff}
    refused = [f"{flag[k]} {a!r} -> {b!r}" for k, (a, b) in diff.items() if TRAIN_SETTINGS[k][2] == REFUSED]
    if refused:
        raise SettingsChanged(
            f"{where} was trained with other adapter settings: {', '.join(refused)}. Resume with the "
            "checkpoint's, or start a new run from its weights (--hf-checkpoint of its model_merged/ or an export)"
        )
    return [f"{flag[k]} {a!r} -> {b!r}" for k, (a, b) in diff.items()]


def start_record(
    output_dir: str,
    prompt_path: str,
    loaded: dict[str, Any] | None,
    allow_change: bool,
    settings: dict[str, Any] | None = None,
    model_path: str | None = None,
    training: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """At the start of a run: its id (the loaded checkpoint's when resuming: one run, resumed), the data's
    fingerprint and the settings that decide the prompts drawn (:func:`data_settings`), both checked against
    the checkpoint's; written to ``<output_dir>/run.json`` for the roles. ``model_path`` (the model the run
    trains from) and the output directory go in too: every checkpoint carries them, so ``relax export`` and
    ``relax eval`` find a checkpoint's tokenizer and its run's settings."""
    now = fingerprint(prompt_path) if os.path.exists(prompt_path) else None  # (else the roles name it)
    where = f"the checkpoint loaded ({(loaded or {}).get('path')})"
    if loaded and now is not None:
        check_data(loaded.get("data_fingerprint"), now, where, allow_change)
    was = (loaded or {}).get("data_settings") or {}
    changed = [
        f"--{k.replace('_', '-')} {was[k]!r} -> {v!r}"
        for k, v in (settings or {}).items()
        if k in was and was[k] != v
    ]
    if changed and not allow_change:
        raise DataChanged(
            f"{where} drew its prompts with other settings: {', '.join(changed)}. Resume with the checkpoint's, "
            "or pass --allow-data-change (the prompts drawn from here on will not be the uninterrupted run's)"
        )
    if changed:
        logger.warning("%s: %s (--allow-data-change: going on)", where, ", ".join(changed))
    if applied := check_train_settings((loaded or {}).get("train_settings"), training or {}, where):
        logger.warning(
            "%s: %s: the settings given apply from this run's first step", where, ", ".join(applied)
        )
    record = {
        "run_id": (loaded or {}).get("run_id") or uuid.uuid4().hex,
        "data_fingerprint": now,
        "data_settings": settings,
        "train_settings": training,
        "model_path": model_path,
        "output_dir": str(Path(output_dir).resolve()),
    }
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / RUN_FILE, json.dumps(record, indent=1))
    return record


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` whole or not at all (written beside it, then renamed over it): what a reader
    opens meanwhile is the old file or the new, never a part. Safe from several threads at once."""
    tmp = path.with_name(f".{path.name}.writing-{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def reward_breadcrumb(output_dir: str | Path) -> Path:
    """The file a rollout's thread-isolated scorer keeps while it scores (``relax_rewards.Scorer``'s
    ``breadcrumb``): left behind, it names the reward a crashed rollout process was running."""
    return Path(output_dir) / ".reward_in_flight.json"


def crashed_in_reward(output_dir: str | Path) -> str | None:
    """When a process that scored rewards in ``output_dir`` died while a thread-isolated reward ran (a
    segfault, a kill): what to tell the user; None otherwise. Its breadcrumbs (one per scoring thread,
    ``<breadcrumb>.<pid>-<thread>``) are removed once read."""
    base = reward_breadcrumb(output_dir)
    for f in sorted(base.parent.glob(base.name + ".*")):
        try:
            crumb = json.loads(f.read_text())
            pid = int(crumb["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if process_alive(pid):
            continue  # (still scoring)
        for g in base.parent.glob(f"{base.name}.{pid}-*"):
            g.unlink(missing_ok=True)
        return (
            f"its process (pid {pid}) died while the reward {crumb.get('reward')!r} was running in thread "
            "isolation: a reward that crashes (a segfault, a kill) takes the rollout with it; run it with "
            "--reward-isolation process, where such a call is counted as 'crashed'"
        )
    return None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie — dead, not yet reaped by its parent — does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_record(output_dir: str | Path) -> dict[str, Any]:
    """What :func:`start_record` wrote ({} where no run recorded itself: a role used on its own)."""
    f = Path(output_dir) / RUN_FILE
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except ValueError:
        return {}
