"""Weight sync that sends only what changed: each bucket of a new version against the version the receiver
holds (#53's codec; the DCS mode that uses it comes next).

Why: between two RL steps most bf16 weights do not change at all and the others change in few bits, so a
bucket's difference is mostly zeros. Encodings of one bucket (its raw bytes: one dtype, elements of
``itemsize`` bytes):

- ``full``: the bucket's bytes — the first sync, a receiver that (re-)joined, after a version gap or a
  refused delta, every N versions.
- ``xor``: new XOR base, zstd-compressed (runs of zero bytes cost almost nothing).
- ``sparse``: where the elements changed and by how much, zstd-compressed: the gaps between changed
  elements' indices (a byte each, 255 escaping to a uint32), and each change as the difference of the
  element's bits read as an unsigned integer (a signed byte; -128 escaping to the new element). Why that
  and not indices + values (its first form: 1.8 bytes per changed bf16 element): an AdamW step moves a bf16
  weight by one unit in the last place or not at all, so the difference is +-1 and the gaps are small, and
  both compress to about half a byte per change (``benchmarks/weight_delta.py``).

The encoder keeps the smallest (``full`` too, where a delta does not pay); ``xor`` is tried only when the
``sparse`` one is over a tenth of the bucket (below that it never won in the benchmark, and it costs a
compression of the whole bucket). Nothing is rounded: decoding gives the new bytes exactly.

Integrity: a delta names its version, the base version it applies to, its bucket's index and the version's
bucket count, and the checksum (BLAKE2b, 128 bits) of the bucket's bytes after it is applied.
:class:`DeltaReceiver` applies a version's buckets to copies and commits them only when every bucket arrived
in order and checked; a delta on another base, a bucket out of order or twice, a checksum that differs, or a
version left incomplete (its sender killed mid-version) raise :class:`DeltaRefused`, naming what, and leave
the last complete version in place: the receiver then asks for a full sync. Never a silently wrong weight.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Encoding = Literal["full", "xor", "sparse"]
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
logger = logging.getLogger(__name__)
_ESCAPE_GAP, _ESCAPE_STEP = 255, -128
_XOR_TRIED_ABOVE = 0.1
"""``xor`` is tried only when ``sparse`` is over this share of the bucket's bytes."""


class DeltaRefused(ValueError):
    """A delta the receiver will not apply (what and why in the message); its last complete version stays."""


def bucket_checksum(data: np.ndarray) -> str:
    """BLAKE2b-128 of a bucket's bytes: what a receiver's copy must hash to after a delta."""
    return hashlib.blake2b(np.ascontiguousarray(data).view(np.uint8).data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class BucketDelta:
    """One bucket of one version, encoded against ``base_version`` (None: ``full``, against nothing)."""

    version: int
    base_version: int | None
    index: int
    """The bucket's place in its version (0 .. count - 1): buckets arrive in order."""
    count: int
    encoding: Encoding
    itemsize: int
    nbytes: int
    """The bucket's size, decoded."""
    payload: bytes
    checksum: str
    """:func:`bucket_checksum` of the bucket after it is applied."""


def _compress(data: bytes, level: int) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=level).compress(data)


def _decompress(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(data)


def _sparse(words: np.ndarray, was: np.ndarray, itemsize: int, level: int) -> bytes:
    """The ``sparse`` payload: counts (changes, escaped gaps, escaped steps, the first frame's bytes), then
    the gaps' frame, then one frame of the escaped gaps, the steps and the escaped elements."""
    idx = np.flatnonzero(words != was)
    gaps = np.diff(idx, prepend=-1)
    far = gaps >= _ESCAPE_GAP
    steps = (words[idx] - was[idx]).view(_INT[itemsize])  # (wraps: the bits' difference, read signed)
    near = (steps > _ESCAPE_STEP) & (steps <= 127)
    first = _compress(np.where(far, _ESCAPE_GAP, gaps).astype(np.uint8).tobytes(), level)
    rest = (
        gaps[far].astype(np.uint32).tobytes()
        + np.where(near, steps, _ESCAPE_STEP).astype(np.int8).tobytes()
        + words[idx[~near]].tobytes()
    )
    counts = np.array([len(idx), int(far.sum()), int((~near).sum()), len(first)], dtype=np.uint32)
    return counts.tobytes() + first + _compress(rest, level)


def _apply_sparse(out: np.ndarray, raw_payload: bytes, itemsize: int) -> None:
    """Write a ``sparse`` payload's changes into ``out`` (the base's words, a copy)."""
    n, n_far, n_esc, first = (int(c) for c in np.frombuffer(raw_payload[:16], dtype=np.uint32))
    gaps = np.frombuffer(_decompress(raw_payload[16 : 16 + first]), dtype=np.uint8).astype(np.int64)
    rest = _decompress(raw_payload[16 + first :])
    far = np.frombuffer(rest[: 4 * n_far], dtype=np.uint32)
    steps = np.frombuffer(rest[4 * n_far : 4 * n_far + n], dtype=np.int8)
    escaped = np.frombuffer(rest[4 * n_far + n :], dtype=_UINT[itemsize])
    if len(gaps) != n or len(escaped) != n_esc:
        raise DeltaRefused(f"a sparse delta of {n} changes carries {len(gaps)} gaps, {len(escaped)} escapes")
    gaps[gaps == _ESCAPE_GAP] = far
    idx = np.cumsum(gaps) - 1
    near = steps != _ESCAPE_STEP
    if n and idx[-1] >= len(out):
        raise DeltaRefused(f"a sparse delta changes element {idx[-1]} of a bucket of {len(out)}")
    out[idx[near]] = out[idx[near]] + steps[near].astype(_INT[itemsize]).view(_UINT[itemsize])
    out[idx[~near]] = escaped


def encode_bucket(
    new: np.ndarray,
    base: np.ndarray | None,
    *,
    version: int,
    base_version: int | None,
    index: int,
    count: int,
    itemsize: int,
    level: int = 1,
) -> BucketDelta:
    """``new`` (a bucket's bytes, uint8) as the smallest of a full copy and its deltas against ``base`` (the
    receiver's copy of that bucket at ``base_version``; None: full only)."""
    new = np.ascontiguousarray(new).view(np.uint8).reshape(-1)
    checksum = bucket_checksum(new)
    candidates: list[tuple[Encoding, bytes]] = []
    if base is not None:
        base = np.ascontiguousarray(base).view(np.uint8).reshape(-1)
        if base.nbytes != new.nbytes:
            raise ValueError(
                f"bucket {index}: {new.nbytes} bytes now, {base.nbytes} in the base: send it full"
            )
        words, was = new.view(_UINT[itemsize]), base.view(_UINT[itemsize])
        candidates.append(("sparse", _sparse(words, was, itemsize, level)))
        if len(candidates[-1][1]) > _XOR_TRIED_ABOVE * new.nbytes:
            candidates.append(("xor", _compress(np.bitwise_xor(new, base).tobytes(), level)))
    encoding, payload = min(candidates, key=lambda c: len(c[1]), default=("full", b""))
    if encoding != "full" and len(payload) >= new.nbytes:  # (a delta no smaller than the bucket)
        encoding = "full"
    if encoding == "full":  # (copied only where it goes: a bucket's bytes are most of a version's)
        payload = new.tobytes()
    return BucketDelta(
        version,
        None if encoding == "full" else base_version,
        index,
        count,
        encoding,
        itemsize,
        new.nbytes,
        payload,
        checksum,
    )


def decode_bucket(delta: BucketDelta, base: np.ndarray | None) -> np.ndarray:
    """The bucket's new bytes (a new array; ``base`` is not written), checked against the delta's checksum."""
    if delta.encoding == "full":
        out = np.frombuffer(delta.payload, dtype=np.uint8).copy()
    else:
        if base is None:
            raise DeltaRefused(f"version {delta.version} bucket {delta.index}: a delta, and no base held")
        out = np.ascontiguousarray(base).view(np.uint8).reshape(-1).copy()
        try:
            if delta.encoding == "xor":
                np.bitwise_xor(out, np.frombuffer(_decompress(delta.payload), dtype=np.uint8), out=out)
            else:
                _apply_sparse(out.view(_UINT[delta.itemsize]), delta.payload, delta.itemsize)
        except Exception as e:  # (zstd's error, a short buffer, an index out of range: not a payload of ours)
            raise DeltaRefused(
                f"version {delta.version} bucket {delta.index}: its {delta.encoding} payload does not decode ({e})"
            ) from e
    if out.nbytes != delta.nbytes or bucket_checksum(out) != delta.checksum:
        raise DeltaRefused(
            f"version {delta.version} bucket {delta.index}: the result's checksum differs from the sender's "
            f"(a {delta.encoding} delta on a base other than version {delta.base_version}'s bytes)"
        )
    return out


@dataclass
class DeltaSender:
    """The sender's side: what each receiver holds is the last version it sent (all receivers of a group
    take every version), so each new version is encoded against that one; a full sync when asked (a
    receiver joined, re-joined or refused one) and every ``full_every`` versions."""

    full_every: int = 50
    level: int = 1
    """zstd's level (1: fast; the payload is mostly zeros)."""
    gives_up_above: float = 0.5
    """A delta version costing over this share of the full bytes does not pay (fp32 weights, a high lr:
    nearly every element changes); after ``gives_up_after`` such versions in a row the sender says so once
    and sends full from then on (:attr:`gave_up`)."""
    gives_up_after: int = 3
    held: list[np.ndarray] | None = None
    held_version: int | None = None
    since_full: int = 0
    full_asked: bool = True
    not_paying: int = 0
    """Delta versions in a row that cost over ``gives_up_above`` of the full bytes."""
    gave_up: bool = False

    def ask_full(self) -> None:
        """The next version goes full (a receiver is new, came back, or refused a delta)."""
        self.full_asked = True

    def encode(self, version: int, buckets: list[np.ndarray], itemsizes: list[int]) -> list[BucketDelta]:
        """Version ``version``'s buckets (uint8 views of each bucket's bytes) as deltas, or full."""
        full = (
            self.full_due()
            or self.held is None
            or len(self.held) != len(buckets)
            or any(h.nbytes != np.asarray(b).nbytes for h, b in zip(self.held, buckets))
        )
        out = [
            encode_bucket(
                b,
                None if full or self.held is None else self.held[i],
                version=version,
                base_version=None if full else self.held_version,
                index=i,
                count=len(buckets),
                itemsize=itemsizes[i],
                level=self.level,
            )
            for i, b in enumerate(buckets)
        ]
        self.held = [np.ascontiguousarray(b).view(np.uint8).reshape(-1).copy() for b in buckets]
        self.sent(version, full, sum(len(d.payload) for d in out), sum(d.nbytes for d in out))
        return out

    def full_due(self) -> bool:
        """The schedule: the next version goes full (asked, none sent yet, every ``full_every``, or deltas
        given up on)."""
        return (
            self.full_asked
            or self.held_version is None
            or self.since_full + 1 >= self.full_every
            or self.gave_up
        )

    def sent(self, version: int, full: bool, payload: int, whole: int) -> None:
        """Record version ``version`` as sent (``full`` or a delta of ``payload`` bytes of ``whole``)."""
        self.held_version, self.full_asked = version, False
        self.since_full = 0 if full else self.since_full + 1
        if not full:
            self._count_pay(payload, whole)

    def _count_pay(self, sent: int, whole: int) -> None:
        """Give up on deltas after ``gives_up_after`` versions in a row that did not pay, saying so once."""
        self.not_paying = self.not_paying + 1 if sent > self.gives_up_above * whole else 0
        if self.not_paying >= self.gives_up_after and not self.gave_up:
            self.gave_up = True
            logger.warning(
                "delta weight sync does not pay here: the last %d versions' deltas cost over %.0f%% of the full "
                "bytes (%.0f%% the last; fp32 weights or a high lr change nearly every element), so every "
                "version goes full from now on; drop --weight-sync-delta for this run's settings",
                self.not_paying,
                100 * self.gives_up_above,
                100 * sent / max(whole, 1),
            )


@dataclass
class DeltaReceiver:
    """The receiver's side: the last complete version's buckets, and the version in progress (applied to
    copies, committed all at once)."""

    version: int | None = None
    buckets: list[np.ndarray] = field(default_factory=list)
    _pending: list[np.ndarray] = field(default_factory=list)
    _pending_version: int | None = None

    def apply(self, delta: BucketDelta) -> list[np.ndarray] | None:
        """Take one bucket of a version; the version's buckets once it is complete (then :attr:`version`
        is it), else None. Refuses (:class:`DeltaRefused`) what does not fit; what it held stays."""
        in_progress = delta.version == self._pending_version and bool(self._pending)
        if delta.index == 0 and not in_progress:  # a version begins (an unfinished one before it is dropped)
            self._pending, self._pending_version = [], delta.version
        elif not in_progress or delta.index != len(self._pending):
            twice = delta.version == self.version or (in_progress and delta.index < len(self._pending))
            expected = len(self._pending), self._pending_version
            self._pending, self._pending_version = [], None  # (the stream broke: that version is dropped)
            raise DeltaRefused(
                f"version {delta.version} bucket {delta.index} came {'twice' if twice else 'out of order'} "
                f"(expected bucket {expected[0]} of version {expected[1]}): ask for a full sync"
            )
        if delta.encoding != "full" and delta.base_version != self.version:
            self._pending, self._pending_version = [], None
            raise DeltaRefused(
                f"version {delta.version} bucket {delta.index} is a delta on version {delta.base_version}; this "
                f"receiver holds {self.version}: ask for a full sync"
            )
        base = (
            self.buckets[delta.index]
            if delta.encoding != "full" and delta.index < len(self.buckets)
            else None
        )
        try:
            self._pending.append(decode_bucket(delta, base))
        except DeltaRefused:
            self._pending, self._pending_version = [], None
            raise
        if len(self._pending) < delta.count:
            return None
        self.buckets, self.version = self._pending, delta.version
        self._pending, self._pending_version = [], None
        return self.buckets
