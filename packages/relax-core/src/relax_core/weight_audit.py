"""``--verify-weight-sync``'s record on disk: every version's checksum as the trainer sent it and as each
receiving role loaded it, one JSON line per version in ``<output_dir>/weight_sync/<role>.jsonl``.

Why on disk: the roles' in-memory logs (``TrainerRecord.weight_log``, ``RolloutRecord.weight_log``) die with
a restarted role, so a run's audit covered only the versions since the last restart; a file that each
incarnation appends to covers every version of the run (#53: delta sync checked bitwise on every version,
through restarts). A version sent twice (a restarted trainer re-does the steps after its checkpoint) counts
as its last line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

AUDIT_DIR = "weight_sync"


class WeightAudit:
    """Appends ``role``'s checksum of each version to its file."""

    def __init__(self, output_dir: str | Path, role: str) -> None:
        self.path = Path(output_dir) / AUDIT_DIR / f"{role}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, version: int, checksum: str) -> None:
        line = json.dumps({"version": version, "checksum": checksum, "pid": os.getpid(), "at": time.time()})
        with open(self.path, "a") as f:
            f.write(line + "\n")


def read_audit(output_dir: str | Path) -> dict[str, dict[int, str]]:
    """Each role's last checksum of each version it logged (``{}`` where none did)."""
    out: dict[str, dict[int, str]] = {}
    for path in sorted((Path(output_dir) / AUDIT_DIR).glob("*.jsonl")):
        log = out.setdefault(path.stem, {})
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                log[int(row["version"])] = row["checksum"]
    return out
