"""What each training step trained on, per sample, for looking at a run (``relax ui``): ``<output_dir>/samples``.

Why: metrics say a step's reward fell; only the samples say why — which prompts, which responses, which
policy version produced each token, where the trainer's log-probs disagree with the rollout's. The trainer
has every one of those fields in hand after its step, so it writes them here: a file per step
(``step_<k>.jsonl``, k as ``metrics.jsonl``'s ``step``), one JSON line per sample, whole groups first (at most
``--log-samples`` samples a step). Token ids, not text: decoding costs the run nothing this way and the
viewer decodes with the run's tokenizer. Writing is a background thread's (a bounded queue: when it is full
a step's samples are skipped and counted, the step is not held up); a crash loses at most the steps queued.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from pathlib import Path
from typing import Any

import numpy as np

from relax_core import sample
from relax_core.sample import TrainBatch, columns

logger = logging.getLogger(__name__)

SAMPLES_DIR = "samples"
QUEUED_STEPS = 8
"""Steps waiting to be written at most; past that a step's samples are skipped (counted in ``skipped``)."""

_PER_TOKEN = (
    sample.LOSS_MASK,
    sample.ROLLOUT_LOG_PROBS,
    sample.LOG_PROBS,
    sample.TOKEN_VERSIONS,
    sample.ADVANTAGES,
)
"""The per-token arrays a line holds (under the sample's own names), each over the response's tokens."""
_SCALARS = (
    sample.GROUP_ID,
    sample.PROMPT_ID,
    sample.REWARD,
    sample.REWARD_FAILURE,
    sample.POLICY_VERSION,
    sample.ROLLOUT_STEP,
    sample.FINISH_REASON,
    sample.TURNS,
    sample.AGENT,
    sample.RESPONSE_TEXT,
)


def step_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"step_{step}.jsonl"


def logged_steps(run_dir: str | Path) -> list[int]:
    """The steps whose samples were written, ascending."""
    folder = Path(run_dir) / SAMPLES_DIR
    steps = []
    for f in folder.glob("step_*.jsonl") if folder.is_dir() else ():
        tail = f.stem.removeprefix("step_")
        if tail.isdigit():
            steps.append(int(tail))
    return sorted(steps)


def read_step(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """The samples of ``step`` (a line cut by a crash mid-write is left out); FileNotFoundError naming
    the file when the step has none."""
    path = step_path(run_dir, step)
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _floats(v: Any, digits: int = 4) -> list[float]:
    return [round(float(x), digits) for x in np.asarray(v, dtype=np.float64).ravel()]


def lines(d: TrainBatch, limit: int) -> list[dict[str, Any]]:
    """At most ``limit`` samples of the batch as JSON lines, whole groups first (in the batch's order)."""
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(d[sample.GROUP_ID]):
        groups.setdefault(str(g), []).append(i)
    keep: list[int] = []
    for idx in groups.values():
        if len(keep) + len(idx) > limit and keep:
            break
        keep += idx[: max(0, limit - len(keep))]
    cols = columns(d)
    out = []
    for i in keep:
        plen = int(d[sample.PROMPT_LEN][i])
        tokens = np.asarray(d[sample.TOKENS][i])
        line: dict[str, Any] = {"prompt_ids": tokens[:plen].tolist(), "response_ids": tokens[plen:].tolist()}
        for name in _PER_TOKEN:
            col = cols.get(name)
            if col is not None and col[i] is not None and len(col[i]):
                v = col[i]
                line[name] = [int(x) for x in v] if name == sample.TOKEN_VERSIONS else _floats(v)
        for name in _SCALARS:
            col = cols.get(name)
            if col is not None and i < len(col) and col[i] is not None:
                v = col[i]
                line[name] = v.item() if isinstance(v, np.generic) else v
        out.append(line)
    return out


class SampleLog:
    """Writes each trained step's samples under ``run_dir`` from a background thread (``per_step`` at most;
    0: nothing)."""

    def __init__(self, run_dir: str | Path, per_step: int) -> None:
        self.run_dir, self.per_step = Path(run_dir), per_step
        self.skipped = 0
        self._queue: queue.Queue[tuple[int, list[dict[str, Any]]] | None] = queue.Queue(maxsize=QUEUED_STEPS)
        self._thread: threading.Thread | None = None

    def write(self, step: int, d: TrainBatch) -> None:
        """Queue step ``step``'s samples (made into lines here, so the batch may be reused at once)."""
        if self.per_step <= 0:
            return
        try:
            self._queue.put_nowait((step, lines(d, self.per_step)))
        except queue.Full:
            self.skipped += 1
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sample-log", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            step, rows = item
            path = step_path(self.run_dir, step)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
                tmp.replace(path)
            except OSError as e:  # (a full disk loses a step's samples, never the run)
                self.skipped += 1
                logger.warning("samples of step %d not written to %s: %s", step, path, e)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the sample log did not finish writing within %.0f s", timeout_s)
        self._thread = None
