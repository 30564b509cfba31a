"""The trainer's checkpoints: save, resume, and the bus snapshot that makes a fully-async resume exact.

A checkpoint holds the backend's weights and optimizer, what was trained so far (sample and prompt ids, for
audits and restarts), the rollout's data position and, in fully-async mode, the samples generated but not
trained yet (the layout: :class:`relax_core.resume.CheckpointDir`). A part of
:class:`~relax_train.roles.actor.ActorWorker`, apart so the training step reads on its own; it is given the
trainer's backend, bus, tracer and record.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core import sample
from relax_core.checkpoints import save_atomically
from relax_core.config import RelaxConfig
from relax_core.ownership import read_record
from relax_core.resume import CheckpointDir, Journal
from relax_core.role import TrainerRecord
from relax_core.trace import Tracer

if TYPE_CHECKING:
    from relax_bus import Bus

logger = logging.getLogger(__name__)


class TrainerCheckpoints:
    """Save / load of the trainer's state and the fully-async bus snapshot (a part of ActorWorker)."""

    def __init__(
        self,
        cfg: RelaxConfig,
        bus: Bus,
        backend: Any,
        tracer: Tracer,
        record: TrainerRecord,
        fence: Callable[[], float],
    ) -> None:
        """``record``: the trainer's (a load puts back its ids and history); ``fence``: waits for a weight
        broadcast still reading the weights (a load overwrites them)."""
        self.cfg, self.bus, self.backend, self.tracer = cfg, bus, backend, tracer
        self.record, self.fence = record, fence
        self.out = Path(cfg.run.output_dir)

    def data_states(self, steps: list[int]) -> dict[int, dict[str, int] | None]:
        """Where the rollout's prompts stood when each rollout step began: from the rollout journal alone,
        so a checkpoint never waits on the rollout role, which may be down and restarting."""
        return Journal.for_run(self.cfg).data_states(steps)

    def save_bus(self, checkpoint: str) -> None:
        """Fully async: put the bus (samples generated and not trained yet) into the checkpoint, with the
        rollout step that comes after them and where its prompts start, so a resumed run trains those
        samples instead of generating them again. Called after the step's batch is acked, so the snapshot
        never holds a trained sample; a checkpoint without it resumes by drawing those prompts again."""
        if self.cfg.run.mode != "fully_async":
            return
        from relax_bus import snapshot

        ckpt = CheckpointDir(checkpoint)
        if ckpt.bus_resume() is not None:  # sealed by the save of this step already: it stays as it is (a
            return  # rewrite would leave the manifest naming the old snapshot until sealed again)
        with self.tracer.span("save_bus", version=self.backend.version):
            self.bus.snapshot(ckpt.bus)
            steps = [int(x.fields[sample.ROLLOUT_STEP]) for x in snapshot.read(ckpt.bus).samples]
            nxt = max([self.backend.version, *(s + 1 for s in steps)])
            if self.cfg.rollout.streaming_rollout:  # steps land group by group: resume at the first one
                # not whole, and the groups it still owes are generated again (those here are refused)
                nxt, per = self.backend.version, self.cfg.samples_per_rollout
                while steps.count(nxt) >= per:
                    nxt += 1
            # where each rollout step from the trainer's version on began: the resumed run's journal
            ckpt.write_bus_resume(nxt, self.data_states(list(range(self.backend.version, nxt + 1))))
            ckpt.seal_bus()  # (into the manifest last: a kill before leaves a snapshot that is not trusted)

    def save(self, path: str | None = None) -> str:
        """A checkpoint of this version under ``path`` (default ``--save``): the backend's weights and
        optimizer, and beside them what was trained so far and the data position the next step begins at
        (from the rollout journal, in either mode). Written whole or not at all."""
        v = self.backend.version
        root = path or self.cfg.train.save
        if root is None:
            raise ValueError("no checkpoint directory: pass a path or set --save DIR")
        target = CheckpointDir.for_step(root, v).path
        data = self.data_states([v])[v]
        run = read_record(self.cfg.run.output_dir)  # (its id and data fingerprint go into the checkpoint)
        if (
            target.is_dir()
            and run.get("run_id")
            and CheckpointDir(target).run_state().get("run_id") != run["run_id"]
        ):
            shutil.rmtree(target)  # another run's checkpoint of this step: never kept as if it were ours

        def write(tmp: Path) -> None:
            self.backend.save_checkpoint(tmp)
            ids, prompts = list(self.record.trained_ids), self.record.trained_prompts
            CheckpointDir(tmp).write_run_state(ids, prompts, data, run)

        with self.tracer.span("save", version=v):  # whole, or not there (a kill mid-save)
            save_atomically(target, write)
        return str(target)

    def load(self, path: str) -> dict[str, Any]:
        """Resume from a checkpoint; returns its ``version`` (the step to continue from) with its run state
        (``data``: the data position that step begins at; ``trained_ids``, ``trained_prompts``).

        The trained ids and prompts come back from the checkpoint and the history from this run's
        metrics.jsonl (rows up to the checkpoint's step): a restarted trainer reports the whole run."""
        self.fence()  # (no broadcast may be reading the weights the checkpoint overwrites)
        meta = self.backend.load_checkpoint(path)
        v = int(meta["version"])
        state = CheckpointDir(path).run_state()
        if isinstance(state.get("trained_ids"), list):
            self.record.trained_ids = [int(i) for i in state["trained_ids"]]
            self.record.trained_prompts = [list(p) for p in state.get("trained_prompts", [])]
        log = self.out / "metrics.jsonl"
        if log.is_file() and not self.record.history:
            rows = _json_lines(log)
            kept: dict[tuple, dict] = {}
            for r in rows:  # the latest row per (step, kind): a re-done step replaces the lost one
                if int(r.get("step", -1)) <= v:
                    kept[(int(r["step"]), "rollout/reward_mean" in r)] = r
            self.record.history = [kept[k] for k in sorted(kept)]
        return {**meta, **state}


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; a line that does not parse (the last one, torn by a kill mid-write)
    is left out with a warning naming it, instead of stopping the resume."""
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            logger.warning("%s line %d is not JSON (torn by a kill mid-write?): left out", path, n)
    return rows
