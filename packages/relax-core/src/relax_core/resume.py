"""What a resumed or restarted run reads back: the rollout journal and the checkpoint directory's layout.

Two small classes, so the files are read and written in one place:

- :class:`Journal` — the rollout role's journal, ``<output_dir>/rollout_journal.jsonl``, one
  :class:`JournalEntry` a line (a JSON object), appended by the rollout as each step begins, draws its
  prompts and lands on the bus:

  - ``{"begin": step, "state": {...}}``: step ``step`` began at this data position;
  - ``{"drawn": step, "state": {...}}``: its prompts are drawn; the next step begins here;
  - ``{"put_group": step, "group": g}``: one of its prompt groups is on the bus (streaming rollout);
  - ``{"put": step, "prompts": [row ids]}``: its samples are on the bus (``"restored": true``: put by the
    run a checkpoint resumed, seeded by :meth:`Journal.seed`).

  A rollout process restarted in place continues from :meth:`Journal.recover` (the first step not on the
  bus, and where its prompts begin: not a batch skipped, none sent twice, no other prompts drawn). The
  trainer's checkpoints take the data position from :meth:`Journal.data_states` — the journal alone, not
  a call to the rollout role (which may be down and restarting).
- :class:`CheckpointDir` — one checkpoint, ``<save>/step_<version>``: what the trainer's backend writes
  (weights, optimizer and RNG state, ``meta.json`` with the version — nothing else), the run's own state
  beside it (``run_state.json``: the samples and prompts trained so far and the data position the next
  step begins at, from the journal), and in fully-async runs the bus snapshot (``bus/``) with
  ``bus_resume.json`` (the rollout step after the snapshot's samples, where each step from the trainer's
  version on began). Written whole or not at all by :func:`relax_core.checkpoints.save_atomically`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from relax_core.config import RelaxConfig

logger = logging.getLogger(__name__)

JOURNAL = "rollout_journal.jsonl"
RUN_STATE = "run_state.json"


EntryKind = Literal["begin", "drawn", "put", "put_group"]
KINDS: tuple[EntryKind, ...] = ("begin", "drawn", "put", "put_group")


@dataclass(frozen=True)
class JournalEntry:
    """One line of the rollout journal (the module docstring lists the kinds). Built by the writers with
    :meth:`begin` / :meth:`drawn` / :meth:`put` / :meth:`put_group`, read back by :meth:`from_json` alone:
    the line format is known here and nowhere else."""

    kind: EntryKind
    step: int
    state: dict[str, int] | None = None
    """``begin`` / ``drawn``: the data position (the prompt iterator's state)."""
    prompts: tuple[str, ...] = ()
    """``put``: the prompt row ids of the step."""
    group: int | None = None
    """``put_group``: the group's index in its step."""
    restored: bool = False
    """``put``: seeded from a checkpoint's bus snapshot (:meth:`Journal.seed`), not put by this run."""

    @classmethod
    def begin(cls, step: int, state: dict[str, int]) -> JournalEntry:
        return cls("begin", step, state=state)

    @classmethod
    def drawn(cls, step: int, state: dict[str, int]) -> JournalEntry:
        return cls("drawn", step, state=state)

    @classmethod
    def put(cls, step: int, prompts: list[str], restored: bool = False) -> JournalEntry:
        return cls("put", step, prompts=tuple(prompts), restored=restored)

    @classmethod
    def put_group(cls, step: int, group: int) -> JournalEntry:
        return cls("put_group", step, group=group)

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object: the kind's name holds the step."""
        out: dict[str, Any] = {self.kind: self.step}
        if self.kind in ("begin", "drawn"):
            out["state"] = self.state
        elif self.kind == "put":
            out["prompts"] = list(self.prompts)
            if self.restored:
                out["restored"] = True
        else:
            out["group"] = self.group
        return out

    @classmethod
    def from_json(cls, obj: Any) -> JournalEntry | None:
        """The entry of one parsed line; None for an object of no kind known here (skipped). Raises
        ValueError for anything else (a line that is no entry: torn by a kill mid-write)."""
        if not isinstance(obj, dict):
            raise ValueError(f"not a journal entry (a JSON object): {obj!r}")
        kind = next((k for k in KINDS if k in obj), None)
        if kind is None:
            return None
        try:
            step = int(obj[kind])
            if kind in ("begin", "drawn"):
                return cls(kind, step, state=obj["state"])
            if kind == "put":
                return cls.put(step, list(obj["prompts"]), bool(obj.get("restored")))
            return cls.put_group(step, int(obj["group"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a {kind!r} journal entry without its fields: {obj!r}") from e


@dataclass
class Recovered:
    """What a restarted rollout process resumes from (:meth:`Journal.recover`)."""

    start: int
    """The first step not on the bus yet: the next to generate."""
    state: dict[str, int] | None
    """The data position step ``start`` begins at (None: step 0 of a journal with none, the data's start)."""
    prompt_log: list[tuple[int, list[str]]]
    """(step, prompt row ids) of the batches this run put (not those restored from a checkpoint), in order."""


class Journal:
    """The journal at ``path``; with ``path`` None (no health manager) nothing is written."""

    def __init__(self, path: Path | None):
        self.path = path

    @classmethod
    def for_run(cls, cfg: RelaxConfig) -> Journal:
        """Every run journals, in either mode: the trainer's checkpoints take the data position from it,
        and under the health manager a restarted rollout process continues from it."""
        return cls(Path(cfg.run.output_dir) / JOURNAL)

    torn: int = 0
    """Lines of the journal that did not parse at the last read (a kill mid-write tears the last one)."""

    def entries(self) -> list[JournalEntry]:
        """The journal's entries, in order; a line that is no entry is skipped and counted in :attr:`torn`
        (it crashed the trainer's checkpoint and the rollout's restart)."""
        if self.path is None or not self.path.is_file():
            return []
        out, torn = [], 0
        for n, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = JournalEntry.from_json(json.loads(line))
            except ValueError:
                torn += 1
                logger.warning(
                    "%s line %d is not a journal entry (torn by a kill mid-write?): skipped", self.path, n
                )
                continue
            if entry is not None:
                out.append(entry)
        self.torn = torn
        return out

    def _positions(
        self,
    ) -> tuple[dict[int, dict[str, int] | None], dict[int, dict[str, int] | None], list[JournalEntry]]:
        """(step -> where it began, step -> where the next one begins, the ``put`` entries in order); the
        latest entry of a step wins."""
        begun: dict[int, dict[str, int] | None] = {}
        drawn: dict[int, dict[str, int] | None] = {}
        put: list[JournalEntry] = []
        for e in self.entries():
            if e.kind == "begin":
                begun[e.step] = e.state
            elif e.kind == "drawn":
                drawn[e.step] = e.state
            elif e.kind == "put":
                put.append(e)
        return begun, drawn, put

    def torn_lines(self) -> int:
        """Lines of the journal that are not entries (skipped; reported in the run's summary)."""
        self.entries()
        return self.torn

    def data_states(self, steps: list[int], timeout_s: float = 300.0) -> dict[int, dict[str, int] | None]:
        """Where the prompts stood when each of ``steps`` began: its ``begin`` entry, or for a step not
        begun yet the position after the step before it drew its prompts (where it will begin); None for
        step 0 before any entry (the data's start) and for every step where no rollout journals (no
        file: a trainer used without our rollout role). Waits up to ``timeout_s`` for entries the rollout
        has not written yet, then fails naming them."""
        if self.path is None or not self.path.is_file():
            return dict.fromkeys(steps)
        deadline = time.monotonic() + timeout_s
        while True:
            begun, drawn, _ = self._positions()
            out: dict[int, dict[str, int] | None] = {
                s: begun[s] if s in begun else drawn[s - 1] for s in steps if s in begun or s - 1 in drawn
            }
            if 0 in steps and 0 not in out:
                out[0] = None
            missing = [s for s in steps if s not in out]
            if not missing:
                return out
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rollout journal {self.path}: no data position for step(s) {missing} after {timeout_s}s: "
                    "the rollout role has not begun them (is it running?)"
                )
            time.sleep(0.2)

    def log(self, entry: JournalEntry) -> None:
        """Append ``entry`` (one JSON line)."""
        if not isinstance(entry, JournalEntry):
            raise TypeError(f"not a journal entry: {entry!r} (build one with JournalEntry.begin/drawn/put)")
        if self.path is not None:
            if not self.path.parent.is_dir():  # (a rollout role used before any run made its output dir)
                self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(entry.to_json()) + "\n")

    def reset(self) -> None:
        """A fresh run (or a global restart from a checkpoint): forget the previous process's batches."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def seed(self, begun: dict[str, dict[str, int]], next_step: int, state: dict[str, int]) -> None:
        """Resumed from a checkpoint with a bus snapshot: the steps before ``next_step`` are on the bus
        already (put by the previous run); record where each began, and that ``next_step`` begins at
        ``state`` (the data position just loaded)."""
        for step in sorted(int(k) for k in begun):
            self.log(JournalEntry.begin(step, begun[str(step)]))
            if step < next_step:
                self.log(JournalEntry.put(step, [], restored=True))
        if next_step > 0:
            self.log(JournalEntry.drawn(next_step - 1, state))

    def recover(self) -> Recovered:
        """After the previous rollout process died: the first step that is not on the bus yet, and where
        its prompts begin (they come next, as they would have)."""
        if self.path is None or not self.path.is_file():
            raise RuntimeError("rollout recover(): no journal (needs --fully-async with the health manager)")
        begun, drawn, put = self._positions()
        done = {e.step for e in put}
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
            prompt_log=sorted((e.step, list(e.prompts)) for e in put if not e.restored),
        )


class CheckpointDir:
    """One checkpoint directory (see the module docstring for what lies in it)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def for_step(cls, root: str | Path, version: int) -> CheckpointDir:
        return cls(Path(root) / f"step_{version:06d}")

    def write_run_state(
        self,
        trained_ids: list[int],
        trained_prompts: list[list[str]],
        data: dict[str, int] | None,
        run: dict[str, Any] | None = None,
    ) -> None:
        """Beside the backend's files: what was trained so far (a restarted trainer and the audit carry on
        from it), ``data``, where the rollout's prompts stand for the next step (None: unknown, or the
        data's start), and ``run``: the run's id and its data's fingerprint (``relax_core.ownership``), which
        every resume checks, with the model the run trained from and its output directory (what ``relax export``
        and ``relax eval`` read)."""
        state: dict[str, Any] = {"trained_ids": trained_ids, "trained_prompts": trained_prompts}
        if data is not None:
            state["data"] = data
        for key in (
            "run_id",
            "data_fingerprint",
            "data_settings",
            "train_settings",
            "model_path",
            "output_dir",
        ):
            if run is not None and run.get(key) is not None:
                state[key] = run[key]
        (self.path / RUN_STATE).write_text(json.dumps(state))

    def run_state(self) -> dict[str, Any]:
        """What :meth:`write_run_state` wrote (``trained_ids``, ``trained_prompts``, ``data``); a checkpoint
        written before relax-core 0.6 kept them in the backend's ``meta.json``; {} where there is none."""
        f = self.path / RUN_STATE
        if f.is_file():
            written: dict[str, Any] = json.loads(f.read_text())
            return written
        meta = self.path / "meta.json"
        old = json.loads(meta.read_text()) if meta.is_file() else {}
        return {k: old[k] for k in ("trained_ids", "trained_prompts", "data") if k in old}

    @property
    def bus(self) -> Path:
        """The bus snapshot (samples generated and not trained when it was written)."""
        return self.path / "bus"

    def write_bus_resume(self, next_step: int, begun: dict[int, dict[str, int] | None]) -> None:
        """Beside the bus snapshot: the rollout step after its samples and where each step from the trainer's
        version to ``next_step`` began."""
        resume = {
            "next_step": next_step,
            "data": begun[next_step],
            "begun": {str(k): v for k, v in begun.items()},
        }
        (self.path / "bus_resume.json").write_text(json.dumps(resume))

    def bus_resume(self) -> dict[str, Any] | None:
        """``bus_resume.json`` when the checkpoint holds a whole bus snapshot, listed in its manifest, else
        None (a checkpoint without one resumes by drawing those prompts again). The snapshot is added to the
        manifest after it is written (:meth:`seal_bus`): one a kill left out is not trusted."""
        from relax_core.checkpoints import listed

        resume = self.path / "bus_resume.json"
        if not ((self.bus / "manifest.json").is_file() and resume.is_file()):
            return None
        if not (listed(self.path, "bus_resume.json") and listed(self.path, "bus/state.pkl")):
            return None
        loaded: dict[str, Any] = json.loads(resume.read_text())
        return loaded

    def seal_bus(self) -> None:
        """The bus snapshot and ``bus_resume.json``, written into the checkpoint after it was renamed into
        place, join its manifest (checked at every load like the rest)."""
        from relax_core.checkpoints import extend_manifest

        extend_manifest(self.path, ["bus", "bus_resume.json"])
