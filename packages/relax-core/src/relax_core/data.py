"""Prompt datasets from local files, and a resumable, seeded prompt iterator.

A prompt is text or a list of chat messages (``{"role": ..., "content": ...}``; veRL's parquet and slime's
``messages`` jsonl hold them so), kept as messages so the chat template renders each turn with its role.
A content given as parts (OpenAI's ``{"type": "text", ...}``, ``image_url`` / ``input_audio``, or Qwen's
``{"type": "image", "image": ...}``) becomes text with a ``<image>`` / ``<video>`` / ``<audio>`` marker per
media part, the media kept with the row as a media column would be. Column names may be nested paths:
``reward_model.ground_truth`` is veRL's label (a column whose name holds the dot wins).

Files: ``.jsonl``, ``.json`` (lines or one array), ``.parquet``, and the ``datasets`` library's own: a
folder written by ``Dataset.save_to_disk`` or an ``.arrow`` file.

A malformed row (not JSON, missing the prompt or label column, empty prompt, a message without a role) is
skipped and counted — never silently dropped, never fatal — and the error names the file, the row and what
to fix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Message = dict[str, Any]
"""One chat message: ``role`` (system, user, assistant or tool) and ``content`` (text)."""

ROLES = ("system", "user", "assistant", "tool")
MEDIA_PARTS = {
    "image": "image",
    "image_url": "image",
    "video": "video",
    "video_url": "video",
    "audio": "audio",
    "input_audio": "audio",
}
"""A content part's ``type`` -> the modality it carries (OpenAI's and Qwen's / HF's spellings)."""


@dataclass
class PromptRow:
    prompt: str | list[Message]
    """The prompt as the dataset gives it: text, or chat messages (each content text, media marked)."""
    label: Any
    metadata: dict[str, Any]
    row_id: str
    media: dict[str, Any] = field(default_factory=dict)
    """Media of the row for relax-multimodal: the columns named by --multimodal-keys that it has, and the
    media parts of its messages (under their modality's column)."""


def prompt_text(prompt: str | list[Message]) -> str:
    """The prompt's text: the text itself, or every message's content joined (for marker checks, logs)."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


@dataclass
class PromptDataset:
    rows: list[PromptRow]
    skipped: list[str] = field(default_factory=list)
    """One message per skipped row, naming file, row and problem."""


class _Skip(ValueError):
    """A row that cannot be used; the message says why (the caller adds the file and row)."""


def lookup(rec: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) of column ``key`` in ``rec``: the column of that exact name, else the path its dots
    separate (``reward_model.ground_truth``)."""
    if key in rec:
        return True, rec[key]
    node: Any = rec
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def load_prompts(
    path: str | Path,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str | None = None,
    media_keys: dict[str, str] | None = None,
) -> PromptDataset:
    path = Path(path)
    raw = _records(path)
    ds = PromptDataset(rows=[])
    for i, rec in enumerate(raw):
        where = f"{path} row {i}"
        if isinstance(rec, Exception):
            ds.skipped.append(str(rec))
            continue
        if not isinstance(rec, dict):
            ds.skipped.append(f"{where}: expected an object, got {type(rec).__name__}")
            continue
        try:
            ds.rows.append(_row(rec, i, input_key, label_key, metadata_key, media_keys or {}))
        except _Skip as e:
            ds.skipped.append(f"{where}: {e}")
    if not ds.rows:
        raise ValueError(
            f"--prompt-data {path}: no usable rows ({len(ds.skipped)} skipped; first: "
            f"{ds.skipped[0] if ds.skipped else 'file is empty'})"
        )
    return ds


def _row(
    rec: dict[str, Any],
    i: int,
    input_key: str,
    label_key: str,
    metadata_key: str | None,
    media_keys: dict[str, str],
) -> PromptRow:
    found, value = lookup(rec, input_key)
    if not found or value is None:
        raise _Skip(f"missing --input-key column {input_key!r}" + _columns_hint(rec))
    parts_media: dict[str, list[Any]] = {}
    if isinstance(value, str):
        if not value.strip():  # (a blank prompt was trained)
            raise _Skip(f"empty or blank --input-key column {input_key!r}")
        prompt: str | list[Message] = value
    elif isinstance(value, list | tuple):
        prompt = _messages(value, input_key, parts_media)
    else:
        raise _Skip(
            f"--input-key column {input_key!r} holds {type(value).__name__}: give text or a list of chat "
            'messages ({"role": "user", "content": "..."})'
        )
    found, label = lookup(rec, label_key)
    if not found:  # (a null label is a label-free row: scored by the group hook, or counted unlabeled)
        raise _Skip(f"missing --label-key column {label_key!r}" + _columns_hint(rec))
    meta: Any = {}
    if metadata_key:
        found, meta = lookup(rec, metadata_key)
        meta = {} if not found or meta is None else meta
        if not isinstance(meta, dict):
            raise _Skip(f"--metadata-key column {metadata_key!r} must be an object")
    media = {c: rec[c] for c in media_keys.values() if rec.get(c) not in (None, [], "")}
    for modality, values in parts_media.items():
        column = media_keys.get(modality)
        if column is None:
            raise _Skip(
                f"--input-key {input_key!r}: a message holds {modality} parts, and the run reads no "
                f"{modality}: add --multimodal-keys '{{{modality}: {modality}}}' (a Qwen-VL/Omni model)"
            )
        if column in media:
            raise _Skip(
                f"the {modality} column {column!r} and {modality} parts in the messages both give media: "
                "keep one"
            )
        media[column] = values
    return PromptRow(prompt, label, dict(meta), str(rec.get("id", i)), media)


def _columns_hint(rec: dict[str, Any]) -> str:
    """The row's columns, for a missing one (nested objects by their keys: the path to give)."""
    names = [f"{k}.{{{', '.join(map(str, v))}}}" if isinstance(v, dict) else str(k) for k, v in rec.items()]
    return f" (the row has: {', '.join(names[:12])})"


def _messages(value: list[Any] | tuple[Any, ...], key: str, media: dict[str, list[Any]]) -> list[Message]:
    """Chat messages as the dataset gives them -> messages with text contents (media parts become markers,
    their values appended to ``media`` by modality); ``_Skip`` naming the message and what is wrong."""
    out: list[Message] = []
    for j, msg in enumerate(value):
        at = f"--input-key {key!r} message {j}"
        if not isinstance(msg, dict):
            raise _Skip(f"{at}: expected an object with role and content, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise _Skip(f"{at}: role {role!r} is not one of {', '.join(ROLES)}")
        content = msg.get("content")
        if isinstance(content, list | tuple):
            content = _parts_text(content, at, media)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _Skip(f"{at}: content must be text or a list of parts, got {type(content).__name__}")
        out.append({**{k: v for k, v in msg.items() if v is not None}, "role": role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise _Skip(f"--input-key {key!r}: no message has any content")
    return out


def _parts_text(parts: list[Any] | tuple[Any, ...], at: str, media: dict[str, list[Any]]) -> str:
    """A content given as parts -> its text, a ``<modality>`` marker where each media part stood."""
    text = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text.append(str(part.get("text", "")))
        elif kind in MEDIA_PARTS:
            modality = MEDIA_PARTS[kind]
            item = part.get(kind)
            if isinstance(item, dict):  # OpenAI's {"image_url": {"url": ...}}, {"input_audio": {"data": ...}}
                item = item.get("url", item.get("data"))
            if item in (None, ""):
                raise _Skip(f"{at}: a {kind} part without its {kind!r} value")
            media.setdefault(modality, []).append(item)
            text.append(f"<{modality}>")
        else:
            raise _Skip(f"{at}: content part of type {kind!r}: give text, image, video or audio parts")
    return "".join(text)


def _records(path: Path) -> list[Any]:
    """The file's records, by format (see the module docstring); a ``ValueError`` / ``FileNotFoundError``
    naming the file and what to do when it cannot be read at all."""
    if path.is_dir():
        if any((path / f).is_file() for f in ("state.json", "dataset_info.json", "dataset_dict.json")):
            return _hf_records(path, "--prompt-data")
        raise ValueError(
            f"--prompt-data {path}: is a directory; give a .jsonl / .parquet / .arrow file, or a folder the "
            "datasets library saved (Dataset.save_to_disk)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"--prompt-data {path}: file not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.read_table(path).to_pylist())
        except Exception as e:  # noqa: BLE001 - pyarrow's errors name neither the file nor what to do
            raise ValueError(
                f"--prompt-data {path}: not a readable parquet file ({type(e).__name__}: {str(e)[:200]}); "
                "re-export it, or convert it to .jsonl"
            ) from None
    if path.suffix == ".arrow":
        return _hf_records(path, "--prompt-data")
    if path.suffix in (".jsonl", ".json"):
        return _json_rows(path)
    raise ValueError(
        f"--prompt-data {path}: unsupported format {path.suffix!r}; use .jsonl, .json, .parquet, .arrow or "
        "a folder the datasets library saved"
    )


def _hf_records(path: Path, flag: str) -> list[Any]:
    """Rows of a ``datasets`` folder (``save_to_disk``; a DatasetDict: its ``train`` split) or ``.arrow``
    file."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{flag} {path}: reading the datasets library's format needs it: pip install datasets "
            "(or export the rows to .jsonl / .parquet)"
        ) from None
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ValueError(f"no 'train' split (it has {', '.join(ds)})")
                ds = ds["train"]
        else:
            ds = datasets.Dataset.from_file(str(path))
        return list(ds.to_list())
    except Exception as e:  # noqa: BLE001 - the library's errors do not name the flag
        raise ValueError(
            f"{flag} {path}: not readable by the datasets library ({type(e).__name__}: {str(e)[:200]})"
        ) from None


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
