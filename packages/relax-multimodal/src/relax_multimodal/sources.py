"""Where media comes from: a path, ``file://`` URI, raw bytes, base64, a data URI, or an object.

Everything is resolved to either a local path or bytes (plus a short human name for error messages),
and hashed by content for the cache. URLs are not fetched: a training run should not depend on the
network, so http(s) sources raise with a hint to download them first.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import MediaError


@dataclass(frozen=True)
class Source:
    path: str | None = None
    data: bytes | None = None
    obj: object = None  # an already-decoded object (PIL image, numpy array)
    name: str = "<bytes>"

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        if self.path is not None:
            return Path(self.path).read_bytes()
        raise TypeError("an in-memory object has no bytes")

    def local_path(self) -> str:
        """The file's path; a TypeError (as ``open(None)`` raised) for bytes or an in-memory object."""
        if self.path is None:
            raise TypeError(f"{self.name} is not a file")
        return self.path

    def nbytes(self) -> int:
        if self.data is not None:
            return len(self.data)
        if self.path is not None:
            try:
                return os.path.getsize(self.path)
            except OSError:
                return 0
        return int(getattr(self.obj, "nbytes", 0) or 0)


def _short(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def resolve(item: object, media_root: str | os.PathLike | None = None) -> Source:
    """Turn one media item into a :class:`Source`; raise :class:`MediaError` if the file is missing."""
    if isinstance(item, dict):  # {"bytes": ..., "path": ...} as HF datasets store Image/Audio features
        if item.get("bytes") is not None:
            return Source(data=bytes(item["bytes"]), name=str(item.get("path") or "<bytes>"))
        if item.get("path") is not None:
            return resolve(item["path"], media_root)
        if item.get("array") is not None:
            return Source(obj=item, name="<array>")
        raise MediaError(
            "bad_input", f"dict media item without 'bytes', 'path' or 'array' (keys {sorted(item)})"
        )
    if isinstance(item, bytes | bytearray | memoryview):
        if len(item) == 0:
            raise MediaError("empty", "zero-length bytes")
        return Source(data=bytes(item))
    if isinstance(item, os.PathLike):
        item = os.fspath(item)
    if isinstance(item, str):
        if item.startswith("data:"):
            head, _, payload = item.partition(",")
            if ";base64" not in head:
                raise MediaError("bad_input", f"data URI without base64 payload ({_short(head)})")
            return Source(data=_b64(payload, head), name=f"<{head}>")
        if item.startswith(("http://", "https://")):
            raise MediaError("bad_input", f"URLs are not fetched ({_short(item)}); download the file first")
        path = item[7:] if item.startswith("file://") else item
        if media_root is not None and not os.path.isabs(path):
            path = os.path.join(media_root, path)
        if os.path.isfile(path):
            return Source(path=path, name=path)
        if len(item) > 64 and _looks_b64(item):
            return Source(data=_b64(item, "base64 string"), name="<base64>")
        raise MediaError("missing", "file not found", source=path)
    if hasattr(item, "size") and hasattr(item, "mode") or hasattr(item, "shape"):
        return Source(obj=item, name=f"<{type(item).__name__}>")
    raise MediaError("bad_input", f"cannot read media from a {type(item).__name__}")


def _looks_b64(s: str) -> bool:
    head = s[:128].rstrip("=")
    return bool(head) and all(c.isalnum() or c in "+/\n\r" for c in head)


def _b64(payload: str, what: str) -> bytes:
    try:
        data = base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as e:
        raise MediaError("corrupt", f"invalid base64 in {_short(what)}: {e}") from None
    if not data:
        raise MediaError("empty", f"empty payload in {_short(what)}")
    return data


def content_hash(src: Source) -> str | None:
    """sha256 of the bytes (for files: of the file's bytes); None for in-memory objects."""
    if src.obj is not None:
        return None
    h = hashlib.sha256()
    if src.data is not None:
        h.update(src.data)
    else:
        with open(src.local_path(), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
