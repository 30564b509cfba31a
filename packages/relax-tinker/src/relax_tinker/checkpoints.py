"""Checkpoint paths of the Tinker API (``tinker://<training run>/<kind>/<name>``) as directories under the
server's root, and the errors a request gets when it cannot be done as asked."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCHEME = "tinker://"
KINDS = {"weights": "training", "sampler_weights": "sampler"}
"""A checkpoint's kind in its path → its ``checkpoint_type`` in listings."""


class UserError(ValueError):
    """A request this server will not do, as asked (the API's ``category: user``)."""


def parse_path(path: str) -> tuple[str, str, str]:
    """``tinker://<model_id>/<kind>/<name>`` → its three parts; anything else is refused naming it."""
    parts = path[len(SCHEME) :].split("/") if path.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in KINDS:
        raise UserError(
            f"{path!r} is not a checkpoint path (tinker://<training run>/weights|sampler_weights/<name>)"
        )
    return parts[0], parts[1], parts[2]


def checkpoint_dir(root: Path, path: str) -> Path:
    """Where the checkpoint ``path`` is on disk; refused when nothing was saved there."""
    run_id, kind, name = parse_path(path)
    d = root / run_id / kind / name
    if not (d / "adapter_model.safetensors").is_file():
        raise UserError(f"no checkpoint at {path}")
    return d


def list_checkpoints(root: Path, model_id: str) -> list[dict[str, Any]]:
    """The API's ``Checkpoint`` records of a training run, oldest name first."""
    out = []
    for kind, ctype in KINDS.items():
        for d in sorted((root / model_id / kind).glob("*")):
            out.append(
                {
                    "checkpoint_id": f"{kind}/{d.name}",
                    "checkpoint_type": ctype,
                    "time": datetime.fromtimestamp(d.stat().st_mtime, UTC).isoformat(),
                    "tinker_path": f"{SCHEME}{model_id}/{kind}/{d.name}",
                    "size_bytes": sum(f.stat().st_size for f in d.iterdir()),
                    "public": False,
                }
            )
    return out
