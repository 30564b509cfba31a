"""A pool of worker processes for preprocessing, with a bound on bytes in flight.

Decoding video and resizing images is CPU work under the GIL, so it runs in processes. Each worker
builds its own :class:`MultimodalProcessor` (and content cache) once; rows go in, decoded uint8 media come
back (patchify/normalise to float32 happens in the consumer, on demand, 4-8× smaller to ship).
Results come back in input order. The bound: a row is submitted only while the encoded media bytes
of the rows submitted and not yet handed to the consumer stay under ``max_inflight_bytes`` (one row
always goes, so a single huge row cannot stall the pool). A worker that dies (a decoder segfault)
fails only the rows it may have held: they come back as ``MediaError(reason="crash")`` and the pool
restarts.

Workers that cannot start at all are a different failure, not a bad sample: the pool (and every restart)
first waits for one worker to come up, and raises :class:`PoolStartError` when it dies instead. The
usual cause: under the ``spawn`` start method each worker re-imports the main module, so a script that
builds the pool at its top level without ``if __name__ == "__main__":`` kills every worker at start-up.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from .errors import MediaError
from .processor import MODALITIES, MultimodalConfig, MultimodalProcessor, ProcessedSample
from .sources import resolve

_WORKER: MultimodalProcessor | None = None


def _init(config: MultimodalConfig, tokenizer: Any) -> None:
    global _WORKER
    _WORKER = MultimodalProcessor(config, tokenizer)


def _ready() -> bool:
    return _WORKER is not None


def _run(row: dict, index: Any) -> ProcessedSample | MediaError:
    """One row in a worker: its sample, or the :class:`MediaError` naming it (a bad row, not a crash)."""
    assert _WORKER is not None
    try:
        out = _WORKER.process(row, index)
    except MediaError as e:
        return e
    out.row = None  # the caller has it; do not ship it back
    return out


class PoolStartError(RuntimeError):
    """The pool's worker processes die before taking any sample (see the worker's traceback on stderr)."""


class PreprocessPool:
    """``imap(rows)`` → ProcessedSample or MediaError per row, in order, processed by ``workers`` processes."""

    def __init__(
        self,
        config: MultimodalConfig,
        tokenizer: Any = None,
        workers: int | None = None,
        max_inflight_bytes: int = 512 << 20,
        start_method: str = "spawn",
    ):
        if max_inflight_bytes <= 0:
            raise ValueError(f"max_inflight_bytes must be > 0 (got {max_inflight_bytes})")
        self.config = config
        self.workers = workers or max(1, min(8, (os.cpu_count() or 2) - 1))
        self.max_inflight_bytes = max_inflight_bytes
        self.peak_inflight_bytes = 0
        self._args = (start_method, tokenizer)
        self._ex = self._start()

    def _start(self) -> ProcessPoolExecutor:
        """A new executor, once one of its workers has started and built its processor."""
        start_method, tokenizer = self._args
        ex = ProcessPoolExecutor(
            self.workers,
            mp_context=mp.get_context(start_method),
            initializer=_init,
            initargs=(self.config, tokenizer),
        )
        try:
            ex.submit(_ready).result()
        except BrokenProcessPool as e:
            ex.shutdown(wait=False, cancel_futures=True)
            guard = 'if __name__ == "__main__":'
            raise PoolStartError(
                f"PreprocessPool: a worker process died while starting, before any sample ({e}); its "
                f"traceback is on stderr above. In a script, build the pool under `{guard}` (the "
                f"{start_method!r} start method re-imports the main module in every worker); the config and "
                "tokenizer must be picklable and importable in a fresh process."
            ) from e
        except BaseException:
            ex.shutdown(wait=False, cancel_futures=True)
            raise
        return ex

    def _estimate(self, row: dict) -> int:
        total = 0
        for column in self.config.multimodal_keys.values():
            value = row.get(column)
            values = value if isinstance(value, list | tuple) else [value]
            for v in values:
                if isinstance(v, dict):
                    v = next((v[k] for k in (*MODALITIES, "bytes", "path") if v.get(k) is not None), None)
                if v is None:
                    continue
                try:
                    total += resolve(v, self.config.media_root).nbytes()
                except MediaError:
                    pass
        return max(total, 1)

    def imap(self, rows: Iterable[dict]) -> Iterator[ProcessedSample | MediaError]:
        pending: deque[tuple[Future, int, dict, int]] = deque()
        inflight = 0
        for index, row in enumerate(rows):
            cost = self._estimate(row)
            while pending and inflight + cost > self.max_inflight_bytes:
                out, spent = self._take(pending)
                inflight -= spent
                yield out
            pending.append((self._ex.submit(_run, row, index), cost, row, index))
            inflight += cost
            self.peak_inflight_bytes = max(self.peak_inflight_bytes, inflight)
        while pending:
            out, _ = self._take(pending)
            yield out

    def _take(self, pending: deque) -> tuple[ProcessedSample | MediaError, int]:
        fut, cost, row, index = pending.popleft()
        try:
            out = fut.result()
        except BrokenProcessPool:
            out = MediaError("crash", "a preprocessing worker died on this sample", sample=index)
            self._ex.shutdown(wait=False, cancel_futures=True)
            self._ex = self._start()
            for i, (_, c, r, ix) in enumerate(pending):  # resubmit what the dead pool still held
                pending[i] = (self._ex.submit(_run, r, ix), c, r, ix)
        if isinstance(out, ProcessedSample):
            out.row = row
        return out, cost

    def close(self) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PreprocessPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
