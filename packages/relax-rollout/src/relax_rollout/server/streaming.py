"""Token-by-token streaming in the engine server: a generation on a thread of its own whose tokens a route
reads as they come, and the text they make, as server-sent events.

Why: the routes answered ``stream: true`` with one event once the whole response was generated, so
SGLang's ``bench_serving`` measured a time to first token equal to the end-to-end latency and an
inter-token latency of 0, and LangChain showed nothing until the reply was complete. Engines that list
``"stream"`` in their features (:data:`~relax_rollout.engines.base.OPTIONAL_FEATURES`) hand each token
over as they sample it (:class:`~relax_rollout.engines.base.TokenDelta`); the others still stream, one
delta per response once complete.

- :class:`GenerationStream` runs the server's ``generate`` on its own thread and yields its deltas,
  then its outputs. ``close()`` (the client left: ``http_api`` calls it, as ``EventStream.on_close``)
  aborts the requests, so the engine's rows are freed at its next step, as ``/abort_request`` does.
- :class:`TokenCount` follows a ``generate`` call's tokens as they come: the time to each response's
  first token and between tokens (``server.metrics``), and the deltas an engine that cannot stream did
  not give (its whole response, once complete).
- :class:`TextDeltas` turns a response's tokens into the text to send now: held back while it ends in an
  incomplete character (a byte-level token that is part of one), in a stop token (the reply never shows
  it) or in what could be the start of a stop string (the reply is cut before it), so that the deltas
  joined are exactly the non-streamed reply's text.
The events themselves are made by the routes: SGLang's native ``/generate`` stream in
:mod:`.sglang_routes`, the OpenAI streams in :mod:`.openai_routes`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from relax_rollout.engines.base import GenerateOutput, RolloutEngine, SamplingParams, TokenDelta

if TYPE_CHECKING:
    from relax_rollout.server.metrics import ServerMetrics


@dataclass
class _Failed:
    error: BaseException


class GenerationStream:
    """``generate(prompts, params, rids, on_token=..., streaming=True, **kwargs)`` (the engine server's) on a
    thread of its own, read by one consumer: iterating yields each :class:`TokenDelta` as the engine samples
    it, then once the list of outputs (the whole truth: every delta's tokens are in them), and re-raises the
    generation's error instead, if it failed. ``close()`` calls ``abort(rid)`` for each request.
    ``on_done(outputs or None)`` runs on the generation's thread before the outputs are yielded (None: it
    failed), e.g. to record an agent session's turn; its result is ``self.done``."""

    def __init__(
        self,
        generate: Callable[..., list[GenerateOutput]],
        abort: Callable[[str], Any],
        prompts: list[list[int]],
        params: list[SamplingParams],
        rids: list[str],
        on_done: Callable[[list[GenerateOutput] | None], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.generate, self.abort, self.rids, self.on_done = generate, abort, list(rids), on_done
        self.done: Any = None
        self.t0 = time.perf_counter()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._finished = False
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(prompts, params, kwargs), daemon=True, name="relax-stream"
        )
        self._thread.start()

    def _run(self, prompts: list[list[int]], params: list[SamplingParams], kwargs: dict) -> None:
        try:
            outs = self.generate(prompts, params, self.rids, on_token=self._q.put, streaming=True, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the reader's to see
            self._end(None)
            self._q.put(_Failed(e))
            return
        try:
            self._end(outs)
        except BaseException as e:  # noqa: BLE001
            self._q.put(_Failed(e))
            return
        self._q.put(outs)

    def _end(self, outs: list[GenerateOutput] | None) -> None:
        if self.on_done is not None:
            self.done = self.on_done(outs)

    def __iter__(self) -> Iterator[TokenDelta | list[GenerateOutput]]:
        return self

    def __next__(self) -> TokenDelta | list[GenerateOutput]:
        if self._finished:
            raise StopIteration
        item = self._q.get()
        if isinstance(item, _Failed):
            self._finished = True
            raise item.error
        if isinstance(item, list):
            self._finished = True
        return item

    def close(self) -> None:
        """The reader is gone (the client disconnected): abort the requests; the engine ends them at its
        next step (their slots freed) and the thread ends. Safe from any thread, more than once."""
        if self._closed.is_set():
            return
        self._closed.set()
        if not self._finished:
            for rid in self.rids:
                self.abort(rid)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


class TokenCount:
    """The tokens of one ``generate`` call as they come: each response's time to its first token and
    between tokens (the metrics), handed on to ``on_token``; :meth:`rest` passes on what the engine did not
    stream, so every response's tokens reach ``on_token`` once, whatever the engine."""

    def __init__(
        self, metrics: ServerMetrics, t0: float, n: int, streaming: bool, on_token: Callable | None
    ) -> None:
        self.metrics, self.t0, self.streaming, self.on_token = metrics, t0, streaming, on_token
        self.count = [0] * n
        self.last: list[float | None] = [None] * n

    def numbered(self, live: list[int]) -> Callable[[TokenDelta], None]:
        """``on_token`` for an engine call over the prompts ``live`` (its deltas numbered in the call)."""
        return lambda d: self(replace(d, index=live[d.index]))

    def __call__(self, d: TokenDelta) -> None:
        i, now = d.index, time.perf_counter()
        if d.start != self.count[i]:  # (a response re-issued on another engine starts over)
            raise RuntimeError(
                f"response {i} streamed tokens from {d.start}, after {self.count[i]}: it cannot start over"
            )
        last = self.last[i]
        if last is None:
            self.metrics.first_token(now - self.t0, self.streaming)
            self.metrics.tokens(len(d.token_ids))
        else:
            self.metrics.tokens(len(d.token_ids), now - last)
        self.count[i] += len(d.token_ids)
        self.last[i] = now
        if self.on_token is not None:
            self.on_token(d)

    def rest(self, i: int, out: GenerateOutput) -> None:
        n = self.count[i]
        if len(out.token_ids) > n:
            top = out.top_logprobs[n:] if out.top_logprobs is not None else None
            self(
                TokenDelta(
                    i,
                    n,
                    tuple(out.token_ids[n:]),
                    tuple(out.log_probs[n:]),
                    None if top is None else tuple(tuple(row) for row in top),
                )
            )


class TextDeltas:
    """One response's text as its tokens arrive: :meth:`add` returns the text to send now, :meth:`finish`
    the rest of the final reply text. ``decode(ids) -> str`` (special tokens skipped); ``stops``: the
    request's stop strings (and any other strings the text must not be sent past the beginning of);
    ``stop_ids``: token ids that end a response when sampled (the request's stop tokens and the engine's
    EOS), whose text the reply never shows."""

    def __init__(self, decode: Callable[[list[int]], str], stops=(), stop_ids=()) -> None:
        self.decode, self.stops, self.stop_ids = decode, tuple(s for s in stops if s), frozenset(stop_ids)
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token_ids: tuple[int, ...] | list[int]) -> str:
        self.tokens.extend(token_ids)
        ids = self.tokens[:-1] if self.tokens and self.tokens[-1] in self.stop_ids else self.tokens
        text = self.decode(ids)
        end = len(text) - _started(text, self.stops)
        while end > len(self.sent) and text[end - 1] == "\ufffd":  # part of a character: wait for the rest
            end -= 1
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent) : end], text[:end]
        return new

    def keep(self, token_ids: tuple[int, ...] | list[int]) -> str:
        """Take the tokens without sending their text (it goes with the whole reply: :meth:`finish`)."""
        self.tokens.extend(token_ids)
        return ""

    def finish(self, text: str) -> str:
        """What of the final reply ``text`` was not sent yet ("" if what was sent is not its beginning: a
        tokenizer whose text of a prefix is not a prefix of the text; nothing sent can be taken back)."""
        if not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


def _started(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` are held back: from the first of ``stops`` it holds (the
    reply is cut there), else those that could be the beginning of one (a string completed later begins
    there or after)."""
    found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    if found:
        return len(text) - min(found)
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


def stop_token_ids(engine: RolloutEngine, params: SamplingParams) -> tuple[int, ...]:
    """The ids whose text a reply never shows when they end it: the request's stop tokens and ``engine``'s
    EOS."""
    return (*params.stop_token_ids, *getattr(engine, "eos_token_ids", ()))
