"""Prompt datasets from local jsonl / parquet files, and a resumable, seeded prompt iterator.

A malformed row (not JSON, missing the prompt or label column, empty prompt) is skipped and counted —
never silently dropped, never fatal — and the error names the file, the row and what to fix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PromptRow:
    prompt: str
    label: Any
    metadata: dict[str, Any]
    row_id: str
    media: dict[str, Any] = field(default_factory=dict)
    """Media columns of the row (those named by --multimodal-keys that it has), for relax-multimodal."""


@dataclass
class PromptDataset:
    rows: list[PromptRow]
    skipped: list[str] = field(default_factory=list)
    """One message per skipped row, naming file, row and problem."""


def load_prompts(
    path: str | Path,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str | None = None,
    media_keys: dict[str, str] | None = None,
) -> PromptDataset:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-data {path}: file not found")
    raw: list[Any]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        raw = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        raw = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                raw.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raw.append(ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg}); fix or remove the line"))
    else:
        raise ValueError(f"--prompt-data {path}: unsupported format {path.suffix!r}; use .jsonl or .parquet")
    ds = PromptDataset(rows=[])
    for i, rec in enumerate(raw):
        where = f"{path} row {i}"
        if isinstance(rec, Exception):
            ds.skipped.append(str(rec))
            continue
        if not isinstance(rec, dict):
            ds.skipped.append(f"{where}: expected an object, got {type(rec).__name__}")
            continue
        prompt = rec.get(input_key)
        if not isinstance(prompt, str) or not prompt:
            ds.skipped.append(f"{where}: missing or empty --input-key column {input_key!r}")
            continue
        if label_key not in rec:
            ds.skipped.append(f"{where}: missing --label-key column {label_key!r}")
            continue
        meta = rec.get(metadata_key, {}) if metadata_key else {}
        if not isinstance(meta, dict):
            ds.skipped.append(f"{where}: --metadata-key column {metadata_key!r} must be an object")
            continue
        media = {c: rec[c] for c in (media_keys or {}).values() if rec.get(c) not in (None, [], "")}
        ds.rows.append(PromptRow(prompt, rec[label_key], dict(meta), str(rec.get("id", i)), media))
    if not ds.rows:
        raise ValueError(
            f"--prompt-data {path}: no usable rows ({len(ds.skipped)} skipped; first: "
            f"{ds.skipped[0] if ds.skipped else 'file is empty'})"
        )
    return ds


class PromptIterator:
    """Yields batches of rows epoch after epoch; its position is part of a checkpoint."""

    def __init__(self, rows: list[PromptRow], batch_size: int, shuffle: bool = True, seed: int = 0) -> None:
        self.rows, self.batch_size, self.shuffle, self.seed = rows, batch_size, shuffle, seed
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int | None = None) -> list[PromptRow]:
        """The next ``n`` rows (default: the batch size), continuing into the next epoch when needed."""
        batch: list[PromptRow] = []
        while len(batch) < (self.batch_size if n is None else n):
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._make_order()
            batch.append(self.rows[self._order[self.pos]])
            self.pos += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order()
