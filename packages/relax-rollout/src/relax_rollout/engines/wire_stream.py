"""SGLang's streamed ``/generate`` as we read it: server-sent events, each a reply so far, turned into our
:class:`~relax_rollout.engines.base.TokenDelta` s as they come, and into the whole reply at the end.

Why: the ``sglang`` engine (and the engine pool under it) served ``stream`` requests of our server as one
delta once generated; SGLang streams token by token itself. Read from SGLang 0.5.23
(``managers/tokenizer_manager.py``, ``entrypoints/http_server.py``): each event is ``data: <json>``, the
last ``data: [DONE]``; by default every chunk is the reply so far (``text``, ``output_ids`` and the
log-prob lists of ``meta_info`` cumulative, ``meta_info.finish_reason`` null until the last); a server
started with ``--incremental-streaming-output`` sends only what is new (its ``output_ids`` and log-prob
lists the new tokens'). Which of the two a server sends is its launch flag (``/server_info``'s
``incremental_streaming_output``), not something a chunk shows: SGLang hands its cumulative chunks on with
a *reference* to the growing token list, so a chunk may hold more tokens than its ``completion_tokens`` and
than its log-prob lists (CI saw one taken for an incremental chunk: its tokens were counted twice). So a
cumulative chunk is read up to the shortest of its lists, the rest coming with a later chunk (the last is
a copy, complete). A batch's chunks carry their prompt's ``index``; an error after the stream began comes
as ``{"error": {...}}``. Standard library only (urllib), as :mod:`.wire`.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from relax_rollout.engines.base import TokenDelta
from relax_rollout.engines.wire import ServerError, server_info


def streams_incrementally(url: str, token: str | None = None, timeout_s: float = 60.0) -> bool:
    """Whether the SGLang server at ``url`` was launched with ``--incremental-streaming-output`` (its
    ``/server_info`` says): how :func:`stream_generate` must read its chunks."""
    return bool(server_info(url, token, timeout_s).get("incremental_streaming_output"))


class StreamAssembler:
    """The chunks of one streamed ``/generate`` of ``n`` prompts: :meth:`feed` each, it returns the
    :class:`TokenDelta` of the tokens it added (None: none); :meth:`replies` the whole replies, as the same
    request without ``stream`` answers them (``parse_reply`` reads them). ``incremental``: the server was
    launched with ``--incremental-streaming-output`` (each chunk the new tokens only)."""

    def __init__(self, n: int, incremental: bool = False) -> None:
        self.incremental = incremental
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[Any]] = [[] for _ in range(n)]
        self.tops: list[list[Any]] = [[] for _ in range(n)]
        self.last: list[dict | None] = [None] * n

    def feed(self, chunk: dict) -> TokenDelta | None:
        if "error" in chunk:
            err = chunk["error"]
            raise ServerError("(stream)", int(err.get("code") or 500) if isinstance(err, dict) else 500, err)
        i = int(chunk.get("index", 0))
        if not 0 <= i < len(self.ids):
            raise ValueError(f"a stream chunk for prompt {i} of a request of {len(self.ids)}")
        meta = chunk.get("meta_info") or {}
        ids = [int(t) for t in chunk.get("output_ids") or []]
        done = len(self.ids[i])
        lps, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
        if self.incremental:
            new = ids
            if lps is not None:
                self.logprobs[i].extend(lps)
            if tops is not None:
                self.tops[i].extend(tops)
        else:
            if ids[:done] != self.ids[i]:
                raise ValueError(f"prompt {i}: a stream chunk rewrote the tokens sent before")
            upto = min([len(ids), *(len(x) for x in (lps, tops) if x is not None)])
            new = ids[done:upto]
            if lps is not None:
                self.logprobs[i].extend(lps[done:upto])
            if tops is not None:
                self.tops[i].extend(tops[done:upto])
        self.ids[i].extend(new)
        self.last[i] = chunk
        if not new:
            return None
        got = self.logprobs[i][done : done + len(new)]
        log_probs = tuple(float(x[0]) for x in got) if len(got) == len(new) else ()
        top = self.tops[i][done : done + len(new)]
        top_rows = (
            tuple(tuple((int(x[1]), float(x[0])) for x in row or []) for row in top)
            if len(top) == len(new)
            else None
        )
        return TokenDelta(i, done, tuple(new), log_probs, top_rows)

    def replies(self) -> list[dict]:
        """Per prompt its whole reply (the last chunk, with every token and log-prob)."""
        out = []
        for i, last in enumerate(self.last):
            if last is None or (last.get("meta_info") or {}).get("finish_reason") is None:
                raise ValueError(f"the stream ended before prompt {i}'s reply was finished")
            meta = {k: v for k, v in last["meta_info"].items()}
            if self.logprobs[i] or "output_token_logprobs" in meta:
                meta["output_token_logprobs"] = list(self.logprobs[i])
            if self.tops[i] or "output_top_logprobs" in meta:
                meta["output_top_logprobs"] = list(self.tops[i])
            reply = {k: v for k, v in last.items() if k != "index"}
            out.append({**reply, "output_ids": list(self.ids[i]), "meta_info": meta})
        return out


def stream_generate(
    url: str,
    body: dict,
    on_token: Callable[[TokenDelta], None],
    token: str | None = None,
    timeout_s: float = 600.0,
    incremental: bool = False,
) -> list[dict]:
    """POST ``body`` to ``url``'s ``/generate`` with ``stream`` on; ``on_token`` gets each prompt's new
    tokens as they come (numbered by prompt). Returns the whole replies (one per prompt, as
    :func:`~relax_rollout.engines.wire.parse_reply` reads them). Not retried: tokens handed on cannot be
    taken back. ``incremental``: as :class:`StreamAssembler`. An HTTP error status raises :class:`~relax_rollout.engines.wire.ServerError`, a cut stream
    ``ConnectionError``."""
    prompts = body["input_ids"]
    n = len(prompts) if prompts and isinstance(prompts[0], list) else 1
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        url + "/generate", data=json.dumps({**body, "stream": True}).encode(), headers=headers, method="POST"
    )
    assembler = StreamAssembler(n, incremental)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                delta = assembler.feed(json.loads(data))
                if delta is not None:
                    on_token(delta)
    except urllib.error.HTTPError as e:
        raise ServerError.of(url + "/generate", e) from None
    except (urllib.error.URLError, http.client.HTTPException) as e:
        raise ConnectionError(f"{url}/generate: the stream broke off: {e}") from e
    return assembler.replies()
