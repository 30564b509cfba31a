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
    if path.is_dir():
        raise ValueError(f"--prompt-data {path}: is a directory; give a .jsonl or .parquet file")
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-data {path}: file not found")
    raw: list[Any]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            raw = pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow's errors name neither the file nor what to do
            raise ValueError(
                f"--prompt-data {path}: not a readable parquet file ({type(e).__name__}: {str(e)[:200]}); "
                "re-export it, or convert it to .jsonl"
            ) from None
    elif path.suffix in (".jsonl", ".json"):
        raw = _json_rows(path)
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
        if not isinstance(prompt, str) or not prompt.strip():  # (a blank prompt was trained)
            ds.skipped.append(f"{where}: missing, empty or blank --input-key column {input_key!r}")
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


def _json_rows(path: Path) -> list[Any]:
    """The records of a JSON-lines file (a ``.json`` file holding one array: its items), a line that is not
    UTF-8 or not JSON standing as an error that names the file and line (skipped and counted, not fatal).
    A UTF-8 byte-order mark is dropped (it made the first row invalid JSON)."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    if path.suffix == ".json" and data.lstrip()[:1] == b"[":
        try:
            records = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ValueError(
                f"--prompt-data {path}: not a valid JSON array ({e}); fix it, or write one object per line"
            ) from None
        return list(records)
    rows: list[Any] = []
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            rows.append(
                ValueError(
                    f"{path}:{lineno}: not UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1}); "
                    "re-encode the file as UTF-8"
                )
            )
            continue
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError as exc:
            rows.append(ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg}); fix or remove the line"))
        except RecursionError:  # (a line nested 100k deep killed the run)
            rows.append(
                ValueError(f"{path}:{lineno}: JSON nested too deeply to read; fix or remove the line")
            )
        except ValueError as exc:  # an integer of more digits than Python converts (4300), and the like
            rows.append(
                ValueError(f"{path}:{lineno}: unreadable JSON ({str(exc)[:200]}); fix or remove the line")
            )
    return rows


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
