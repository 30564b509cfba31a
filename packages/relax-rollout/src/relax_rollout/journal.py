"""The rollout role's restart journal: what lets a crashed rollout process be restarted in place.

Why it exists: under the health manager (fully async with ``--health``) a rollout process that dies is
replaced without restarting the run. The replacement must go on with exactly the prompts that were not put
on the bus yet: not skip a batch, not send one twice, not draw other prompts. So every batch's start (the
data position it began from), the position after it drew its prompts, and its landing on the bus are
appended, one JSON object a line, to ``<output_dir>/rollout_journal.jsonl``:

- ``{"begin": step, "state": {...}}``: step ``step`` began at this data position;
- ``{"drawn": step, "state": {...}}``: its prompts are drawn; the next step begins here;
- ``{"put": step, "prompts": [row ids]}``: its samples are on the bus (``"restored": true``: put by the
  run a checkpoint resumed, seeded by :meth:`Journal.seed`).

:meth:`Journal.recover` reads it back into the first step not on the bus and where its prompts begin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_core.config import RelaxConfig


@dataclass
class Recovered:
    """What a restarted rollout process resumes from (:meth:`Journal.recover`)."""

    start: int
    """The first step not on the bus yet: the next to generate."""
    state: dict[str, int] | None
    """The data position step ``start`` begins at (None: step 0 of a journal with none, the data's start)."""
    prompt_log: list[tuple[int, list[str]]]
    """(step, prompt row ids) of the batches this run put (not those restored from a checkpoint), in order."""
    step_states: dict[int, dict[str, int]]
    """The data position each step before ``start`` began at."""


class Journal:
    """The journal at ``path``; with ``path`` None (no health manager) nothing is written."""

    def __init__(self, path: Path | None):
        self.path = path

    @classmethod
    def for_run(cls, cfg: RelaxConfig) -> Journal:
        """Journaled under the health manager, which restarts a rollout process in place."""
        if cfg.run.mode == "fully_async" and cfg.run.health:
            return cls(Path(cfg.run.output_dir) / "rollout_journal.jsonl")
        return cls(None)

    def log(self, entry: dict[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def reset(self) -> None:
        """A fresh run (or a global restart from a checkpoint): forget the previous process's batches."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def seed(self, begun: dict[str, dict], next_step: int, state: dict[str, int]) -> None:
        """Resumed from a checkpoint with a bus snapshot: the steps before ``next_step`` are on the bus
        already (put by the previous run); record where each began, and that ``next_step`` begins at
        ``state`` (the data position just loaded)."""
        for step in sorted(int(k) for k in begun):
            self.log({"begin": step, "state": begun[str(step)]})
            if step < next_step:
                self.log({"put": step, "prompts": [], "restored": True})
        if next_step > 0:
            self.log({"drawn": next_step - 1, "state": state})

    def recover(self) -> Recovered:
        """After the previous rollout process died: the first step that is not on the bus yet, and where
        its prompts begin (they come next, as they would have)."""
        if self.path is None or not self.path.is_file():
            raise RuntimeError("rollout recover(): no journal (needs --fully-async with the health manager)")
        begun: dict[int, dict] = {}
        drawn: dict[int, dict] = {}
        put: list[tuple[int, list[str], bool]] = []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            e = json.loads(line)
            if "begin" in e:
                begun[int(e["begin"])] = e["state"]
            elif "drawn" in e:
                drawn[int(e["drawn"])] = e["state"]
            elif "put" in e:
                put.append((int(e["put"]), list(e["prompts"]), bool(e.get("restored"))))
        done = {s for s, _, _ in put}
        pending = sorted(s for s in begun if s not in done)
        start = pending[0] if pending else (max(done) + 1 if done else 0)
        state = None
        if start in begun:
            state = begun[start]
        elif start - 1 in drawn:  # died between two steps: the next one begins where the last one ended
            state = drawn[start - 1]
        elif start > 0:
            raise RuntimeError(
                f"rollout journal {self.path} has no data position for step {start}: cannot restart in "
                "place without drawing other prompts (the run restarts from its last checkpoint)"
            )
        return Recovered(
            start,
            state,
            prompt_log=sorted((s, p) for s, p, restored in put if not restored),
            step_states={s: st for s, st in begun.items() if s < start},
        )
