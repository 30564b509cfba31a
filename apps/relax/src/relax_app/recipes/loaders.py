"""Converters from three public datasets, as their authors publish them, to the jsonl ``relax train`` reads.

Each converter reads the dataset's own local files (nothing is fetched) and writes one JSON object per
line with the columns the recipes in ``apps/relax/recipes/`` name::

    {"id": ..., "prompt": "<image>...", "label": ..., "metadata": {...}, "image": ["/abs/0001.png"], ...}

``prompt`` is plain text (the rollout wraps it in the chat template); media columns hold absolute paths
of local files; ``metadata`` carries what the reward may use (option texts for ``multiple_choice``).

Formats (``relax prepare-data FORMAT SRC OUT``):

``dapo-math``
    BytedTsinghua-SIA/DAPO-Math-17k: parquet rows ``data_source``, ``prompt`` (chat messages: one user
    turn that already asks for a final ``Answer: ...`` line), ``ability``, ``reward_model``
    (``ground_truth``, ``style``), ``extra_info`` (``index``). The published file repeats every problem
    many times; repeats of a row (same prompt and answer) are dropped and counted. A jsonl with ``prompt`` and
    ``label`` (the pre-processed copy slime and upstream Relax use) is read too.
``openr1-mm``
    lmms-lab/multimodal-open-r1-8k-verified: parquet rows ``image`` (an HF Image: ``{bytes, path}``),
    ``problem``, ``solution`` (the answer inside ``<answer>...</answer>``), ``original_question``,
    ``original_answer``. Image bytes are decoded once (a row whose bytes do not decode is skipped) and
    written to ``<OUT stem>_images/`` next to the output.
``avqa``
    AVQA-R1-6K (EchoInk-R1): ``AVQA_R1/{train,valid}/omni_rl_format_{split}.json``, a JSON array of
    ``problem_id``, ``problem``, ``data_type``, ``problem_type``, ``options`` (``["A. ...", ...]``),
    ``solution`` (``<answer>B</answer>``), ``path`` (``{"image": "images/x.jpg", "audio": "audios/x.wav"}``,
    relative to the JSON's folder; a ``video`` entry is taken too). Media files must exist.

A bad row (a missing or empty column, image bytes that do not decode, an empty answer, a media file that
is not there) is skipped and counted, with a message naming the row and the field; the conversion goes on.
"""

from __future__ import annotations

import io
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FORMATS",
    "ConversionError",
    "ConversionReport",
    "convert",
    "main",
]

MEDIA_COLUMNS = ("image", "video", "audio")
"""Output columns holding media paths; the recipes map modalities to these (``--multimodal-keys``)."""

OPENR1_INSTRUCTION = (
    "First reason about the problem inside <think> </think>, then write only the final answer inside "
    "<answer> </answer>."
)
AVQA_INSTRUCTION = (
    "Use both what you see and what you hear. Reason inside <think> </think>, then end with a last line "
    "'Answer: X', where X is the letter of the correct option."
)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_OPTION = re.compile(r"^\s*\(?([A-Za-z])\s*[.):]\s*(.*\S)\s*$", re.DOTALL)
_PIL_EXT = {"JPEG": "jpg", "PNG": "png", "GIF": "gif", "WEBP": "webp", "BMP": "bmp", "TIFF": "tif"}
_MAX_MESSAGES_SHOWN = 10


class ConversionError(ValueError):
    """The source as a whole cannot be read (missing file, unknown format); rows never raise it."""


class _Skip(Exception):
    """One row is unusable; the message names the field and what is wrong."""


@dataclass
class ConversionReport:
    format: str
    source: str
    output: str
    rows_read: int = 0
    written: int = 0
    duplicates: int = 0
    """Rows dropped because an identical row (prompt, label and media) was already written."""
    skipped: list[str] = field(default_factory=list)
    """One message per bad row: ``SRC row N: field: problem``."""
    media_dir: str | None = None
    """Where media embedded in the source were written (None when the source references files)."""

    def summary(self) -> str:
        parts = [f"{self.rows_read} read", f"{len(self.skipped)} skipped"]
        if self.duplicates:
            parts.append(f"{self.duplicates} duplicates dropped")
        lines = [
            f"prepare-data {self.format}: {self.written} rows written to {self.output} ({', '.join(parts)})"
        ]
        if self.media_dir:
            lines.append(f"  media written under {self.media_dir}")
        lines += [f"  skipped: {m}" for m in self.skipped[:_MAX_MESSAGES_SHOWN]]
        if len(self.skipped) > _MAX_MESSAGES_SHOWN:
            lines.append(f"  ... and {len(self.skipped) - _MAX_MESSAGES_SHOWN} more skipped rows")
        return "\n".join(lines)


# -- reading the source ------------------------------------------------------------------------------


def _records(src: Path) -> Iterator[Any]:
    """Rows of a .parquet / .jsonl / .json file, in order; an unparsable jsonl line comes as an exception."""
    suffix = src.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(src)
        except Exception as exc:
            raise ConversionError(f"{src}: not a readable parquet file ({exc})") from None
        for batch in pf.iter_batches(batch_size=512):
            yield from batch.to_pylist()
    elif suffix == ".jsonl":
        with src.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    yield _Skip(f"not valid JSON ({exc.msg})")
    elif suffix == ".json":
        try:
            data = json.loads(src.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{src}: not valid JSON ({exc})") from None
        if isinstance(data, dict):  # {"data": [...]} or a single record
            data = data.get("data", [data])
        if not isinstance(data, list):
            raise ConversionError(f"{src}: expected a JSON array of records, got {type(data).__name__}")
        yield from data
    else:
        raise ConversionError(
            f"{src}: unsupported file type {src.suffix!r}; expected .parquet, .jsonl or .json"
        )


# -- small field helpers -----------------------------------------------------------------------------


def _text(rec: dict, key: str) -> str:
    if key not in rec or rec[key] is None:
        raise _Skip(f"{key}: missing column")
    value = rec[key]
    if not isinstance(value, str):
        raise _Skip(f"{key}: expected text, got {type(value).__name__}")
    if not value.strip():
        raise _Skip(f"{key}: empty")
    return value.strip()


def _prompt(value: Any, key: str) -> str | list[dict[str, str]]:
    """A prompt given as text (stripped), or as chat messages kept as messages, each turn with its role (the
    chat template renders them: a system turn stays a system turn); content parts become their text."""
    if isinstance(value, str):
        return value.strip()
    if not isinstance(value, list | tuple):
        raise _Skip(f"{key}: expected text or chat messages, got {type(value).__name__}")
    messages = []
    for msg in value:
        if not isinstance(msg, dict):
            raise _Skip(f"{key}: chat message is not an object")
        role = msg.get("role", "user")
        if role not in ("system", "user", "assistant"):
            raise _Skip(f"{key}: chat message role {role!r} is not system, user or assistant")
        content = msg.get("content")
        if isinstance(content, list):  # OpenAI-style content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if isinstance(content, str) and content.strip():
            messages.append({"role": role, "content": content.strip()})
    if not any(m["role"] == "user" for m in messages):
        return ""
    return messages


def _answer_text(solution: str) -> str:
    """The content of the last ``<answer>...</answer>``, or the whole text when there is no tag."""
    found = _ANSWER_TAG.findall(solution)
    return (found[-1] if found else solution).strip()


# -- DAPO-Math-17k -----------------------------------------------------------------------------------


def _dapo_row(rec: dict, i: int, ctx: _Context) -> dict:
    if rec.get("prompt") is None:
        raise _Skip("prompt: missing column")
    prompt = _prompt(rec["prompt"], "prompt")
    if not prompt:
        raise _Skip("prompt: no user text")
    rm = rec.get("reward_model")
    if isinstance(rm, dict):
        where, label = "reward_model.ground_truth", rm.get("ground_truth")
    elif "label" in rec:
        where, label = "label", rec.get("label")
    else:
        raise _Skip("reward_model: missing column (and no label column)")
    if label is None or not str(label).strip():
        raise _Skip(f"{where}: empty answer")
    label = str(label).strip()
    extra_info = rec.get("extra_info")
    extra = extra_info if isinstance(extra_info, dict) else {}
    meta = {k: rec[k] for k in ("data_source", "ability") if isinstance(rec.get(k), str)}
    if isinstance(rm, dict) and rm.get("style"):
        meta["style"] = str(rm["style"])
    if extra.get("index") is not None:
        meta["index"] = str(extra["index"])
    return {
        "id": str(extra.get("index") or rec.get("id") or i),
        "prompt": prompt,
        "label": label,
        "metadata": meta,
    }


# -- multimodal-open-r1-8k-verified ------------------------------------------------------------------


def _image_bytes(item: Any, base: Path) -> tuple[bytes | None, Path | None]:
    """(bytes, None) for embedded bytes, (None, path) for a referenced file; _Skip if neither."""
    if isinstance(item, dict):
        if item.get("bytes") is not None:
            return bytes(item["bytes"]), None
        if item.get("path"):
            path = Path(item["path"])
            path = path if path.is_absolute() else base / path
            if path.is_file():
                return None, path.resolve()
            raise _Skip(f"image: no bytes and file {path} not found")
        raise _Skip("image: neither bytes nor path")
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item), None
    raise _Skip(f"image: expected image bytes, got {type(item).__name__}")


def _decode_image(data: bytes) -> str:
    """The file extension of decodable image bytes; _Skip if they do not decode."""
    from PIL import Image

    if not data:
        raise _Skip("image: zero-length bytes")
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format or "PNG"
            im.load()  # a full decode: catches truncated files that a header check passes
    except Exception as exc:
        raise _Skip(f"image: bytes do not decode as an image ({type(exc).__name__}: {exc})") from None
    return _PIL_EXT.get(fmt, fmt.lower())


def _openr1_row(rec: dict, i: int, ctx: _Context) -> dict:
    problem = _text(rec, "problem")
    if "solution" not in rec or rec["solution"] is None:
        raise _Skip("solution: missing column")
    label = _answer_text(str(rec["solution"]))
    if not label:
        raise _Skip("solution: empty answer")
    if rec.get("image") is None:
        raise _Skip("image: missing column")
    items = rec["image"] if isinstance(rec["image"], list) else [rec["image"]]
    if not items:
        raise _Skip("image: empty list")
    decoded = []
    for item in items:  # check every image before writing any, so a skipped row leaves no files
        data, path = _image_bytes(item, ctx.src.parent)
        decoded.append((data, path, _decode_image(data) if data is not None else None))
    paths = []
    for k, (data, path, ext) in enumerate(decoded):
        if data is None:
            paths.append(str(path))
            continue
        target = ctx.media_dir() / f"{i:06d}{f'_{k}' if len(decoded) > 1 else ''}.{ext}"
        target.write_bytes(data)
        paths.append(str(target))
    markers = "" if "<image>" in problem else "<image>" * len(paths)
    meta = {"solution": str(rec["solution"]).strip()}
    return {
        "id": f"openr1mm-{i}",
        "prompt": f"{markers}{problem}\n\n{OPENR1_INSTRUCTION}",
        "label": label,
        "metadata": meta,
        "image": paths,
    }


# -- AVQA-R1-6K --------------------------------------------------------------------------------------


def _options(value: Any) -> dict[str, str]:
    if not isinstance(value, list | tuple) or not value:
        raise _Skip("options: missing or empty")
    out: dict[str, str] = {}
    for k, raw in enumerate(value):
        if not isinstance(raw, str) or not raw.strip():
            raise _Skip(f"options: option {k} is empty")
        m = _OPTION.match(raw)
        letter, text = (m.group(1).upper(), m.group(2)) if m else (chr(ord("A") + k), raw.strip())
        if letter in out:
            raise _Skip(f"options: letter {letter} appears twice")
        out[letter] = text
    return out


def _avqa_row(rec: dict, i: int, ctx: _Context) -> dict:
    problem = _text(rec, "problem")
    choices = _options(rec.get("options"))
    if "solution" not in rec or rec["solution"] is None:
        raise _Skip("solution: missing column")
    answer = _answer_text(str(rec["solution"])).strip("() .").upper()
    if not answer:
        raise _Skip("solution: empty answer")
    if answer not in choices:
        raise _Skip(f"solution: answer {answer!r} is not one of the options {', '.join(choices)}")
    media_paths = rec.get("path")
    if not isinstance(media_paths, dict):
        raise _Skip("path: missing column (expected {image, audio} file paths)")
    base = ctx.media_root or ctx.src.parent
    media: dict[str, list[str]] = {}
    for modality in MEDIA_COLUMNS:
        rel = media_paths.get(modality)
        if rel in (None, ""):
            continue
        if not isinstance(rel, str):
            raise _Skip(f"path.{modality}: expected a file path, got {type(rel).__name__}")
        file = Path(rel) if os.path.isabs(rel) else base / rel
        if not file.is_file():
            raise _Skip(f"path.{modality}: file {file} not found")
        media[modality] = [str(file.resolve())]
    if not media:
        raise _Skip("path: no image, video or audio file")
    markers = "".join(f"<{m}>" for m in media)
    options = "\n".join(f"{letter}. {text}" for letter, text in choices.items())
    meta: dict[str, Any] = {"choices": choices}
    for key in ("problem_id", "problem_type", "data_type", "data_source"):
        if rec.get(key) is not None:
            meta[key] = rec[key] if isinstance(rec[key], int | str) else str(rec[key])
    return {
        "id": str(rec.get("problem_id", f"avqa-{i}")),
        "prompt": f"{markers}{problem}\nOptions:\n{options}\n\n{AVQA_INSTRUCTION}",
        "label": answer,
        "metadata": meta,
        **media,
    }


# -- driver ------------------------------------------------------------------------------------------


@dataclass
class _Context:
    src: Path
    out: Path
    media_root: Path | None = None
    _media: Path | None = None

    def media_dir(self) -> Path:
        """The folder media are written to (beside ``out``), made at the first call."""
        if self._media is None:
            self._media = (self.out.parent / f"{self.out.stem}_images").resolve()
            self._media.mkdir(parents=True, exist_ok=True)
        return self._media

    @property
    def media_written(self) -> Path | None:
        """:meth:`media_dir` once a row wrote media there; None while none did (no folder made)."""
        return self._media


RowConverter = Callable[[dict, int, _Context], dict]

FORMATS: dict[str, RowConverter] = {
    "dapo-math": _dapo_row,
    "openr1-mm": _openr1_row,
    "avqa": _avqa_row,
}
"""Format name (``relax prepare-data FORMAT``) → per-row converter."""


def convert(
    fmt: str,
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    limit: int | None = None,
    media_root: str | os.PathLike | None = None,
) -> ConversionReport:
    """Convert ``src`` (the dataset's own file) to the jsonl ``out``; bad rows are skipped and reported.

    ``limit``: stop after this many written rows. ``media_root``: folder that relative media paths are
    joined to (default: the source file's folder)."""
    if fmt not in FORMATS:
        raise ConversionError(f"unknown format {fmt!r}; one of: {', '.join(FORMATS)}")
    src, out = Path(src), Path(out)
    if not src.is_file():
        raise ConversionError(f"{src}: file not found")
    if out.suffix.lower() != ".jsonl":
        raise ConversionError(f"{out}: the output is jsonl; name it *.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    ctx = _Context(src, out, Path(media_root) if media_root is not None else None)
    row_fn = FORMATS[fmt]
    report = ConversionReport(fmt, str(src), str(out))
    seen: set[str] = set()
    ids: set[str] = set()
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for i, rec in enumerate(_records(src)):
                report.rows_read += 1
                try:
                    if isinstance(rec, _Skip):
                        raise rec
                    if not isinstance(rec, dict):
                        raise _Skip(f"expected an object, got {type(rec).__name__}")
                    row = row_fn(rec, i, ctx)
                except _Skip as skip:
                    report.skipped.append(f"{src} row {i}: {skip}")
                    continue
                except Exception as exc:  # a shape no rule above foresaw: still one bad row, not a crash
                    report.skipped.append(f"{src} row {i}: {type(exc).__name__}: {exc}")
                    continue
                # identical rows only: the same question over different media is a different sample
                key = json.dumps([row["prompt"], row["label"], *(row.get(m) for m in MEDIA_COLUMNS)])
                if key in seen:
                    report.duplicates += 1
                    continue
                seen.add(key)
                if row["id"] in ids:  # ids name rows in caches and messages: keep them unique
                    row["id"] = f"{row['id']}-row{i}"
                ids.add(row["id"])
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                report.written += 1
                if limit is not None and report.written >= limit:
                    break
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    report.media_dir = str(ctx.media_written) if ctx.media_written is not None else None
    return report


USAGE = f"""usage: relax prepare-data FORMAT SRC OUT.jsonl [--limit N] [--media-root DIR]

Converts a dataset's own local file into the jsonl `relax train` reads (prompt, label, metadata and media
columns with local file paths). Bad rows are skipped and listed.

  FORMAT  {" | ".join(FORMATS)}
            dapo-math  BytedTsinghua-SIA/DAPO-Math-17k  data/dapo-math-17k.parquet
            openr1-mm  lmms-lab/multimodal-open-r1-8k-verified  data/train-00000-of-00001.parquet
                       (images written to OUT's folder, <OUT stem>_images/)
            avqa       AVQA-R1-6K  AVQA_R1/train/omni_rl_format_train.json (media next to it)
  --limit N          stop after N rows written
  --media-root DIR   folder relative media paths are joined to (default: SRC's folder)
"""


def main(argv: list[str]) -> int:
    """``relax prepare-data ...``; returns the exit status (0 ok, 1 no usable row, 2 usage or source error)."""
    import sys

    if not argv or any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0 if argv else 2
    positional: list[str] = []
    options: dict[str, str] = {}
    it = iter(argv)
    for arg in it:
        if arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            if key not in ("limit", "media-root"):
                print(f"relax prepare-data: unknown option {arg!r}\n\n{USAGE}", file=sys.stderr)
                return 2
            if not eq:
                following = next(it, None)
                if following is None:
                    print(f"relax prepare-data: --{key} needs a value", file=sys.stderr)
                    return 2
                value = following
            options[key] = value
        else:
            positional.append(arg)
    if len(positional) != 3:
        print(f"relax prepare-data: expected FORMAT SRC OUT, got {positional}\n\n{USAGE}", file=sys.stderr)
        return 2
    limit = None
    if "limit" in options:
        try:
            limit = int(options["limit"])
        except ValueError:
            limit = 0
        if limit < 1:
            print(
                f"relax prepare-data: --limit must be a positive integer (got {options['limit']!r})",
                file=sys.stderr,
            )
            return 2
    fmt, src, out = positional
    try:
        report = convert(fmt, src, out, limit=limit, media_root=options.get("media-root"))
    except ConversionError as exc:
        print(f"relax prepare-data: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0 if report.written else 1
