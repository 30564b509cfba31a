"""Engines that stream (``"stream"`` in their features) hand every token over as they sample it: the torch
engine's batch path and its continuous batcher from their loops, the engine pool (hence the ``sglang``
engine) from its servers' streamed ``/generate`` — read as SGLang 0.5.23 writes it (:mod:`wire_stream`).
The deltas of a call, put together, are its outputs."""

from __future__ import annotations

import threading

import pytest

from relax_rollout.engines.base import SamplingParams, TokenDelta, supports
from relax_rollout.engines.wire import ServerError, parse_reply
from relax_rollout.engines.wire_stream import StreamAssembler

PROMPTS = [[5, 6, 7], [12, 3], [20, 21, 22, 23]]


def _joined(deltas: list[TokenDelta], n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per prompt, its deltas' tokens and log-probs in order (each delta starting where the last ended)."""
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    for d in deltas:
        assert d.start == len(ids[d.index]), d
        ids[d.index] += d.token_ids
        lps[d.index] += d.log_probs
    return ids, lps


def test_the_torch_engine_hands_over_each_token_as_it_samples_it(local):
    deltas: list[TokenDelta] = []
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7, top_logprobs=2)
    outs = local.generate(PROMPTS, params, on_token=deltas.append)
    assert supports(local, "stream")
    assert all(len(d.token_ids) == 1 for d in deltas)  # one token per step and response
    ids, lps = _joined(deltas, len(PROMPTS))
    assert ids == [o.token_ids for o in outs] and lps == [o.log_probs for o in outs]
    assert [list(d.top_logprobs[0]) for d in deltas if d.index == 0] == outs[0].top_logprobs
    assert local.generate(PROMPTS, params) == outs  # (the same tokens whether streamed or not)


def test_the_continuous_batcher_hands_over_each_token(local):
    from relax_rollout.engines.continuous import ContinuousBatcher

    deltas: list[TokenDelta] = []
    batcher = ContinuousBatcher(local, max_running=2)  # the third prompt joins as one leaves
    try:
        outs = batcher.generate(PROMPTS, SamplingParams(max_new_tokens=5, seed=3), on_token=deltas.append)
    finally:
        batcher.close()
    ids, lps = _joined(deltas, len(PROMPTS))
    assert ids == [o.token_ids for o in outs] and lps == [o.log_probs for o in outs]


def _chunk(i: int, ids: list[int], lps: list[float], finished: bool = False) -> dict:
    """A chunk of SGLang 0.5.23's streamed batch ``/generate`` (tokenizer_manager: the reply so far)."""
    meta = {
        "id": f"rid-{i}",
        "finish_reason": {"type": "length", "length": len(ids)} if finished else None,
        "prompt_tokens": 3,
        "weight_version": "default",
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "e2e_latency": 0.01 * len(ids),
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
    }
    return {"text": "x" * len(ids), "output_ids": list(ids), "meta_info": meta, "index": i}


def test_sglang_stream_chunks_cumulative_or_incremental_make_the_reply():
    """SGLang's default chunks repeat the reply so far; with --incremental-streaming-output they carry the
    new tokens only. Both give the same deltas and, at the end, the reply the same request without
    ``stream`` gets (read by ``parse_reply``)."""
    a, b = [9, 4, 2], [7, 7]
    la, lb = [-0.5, -1.0, -0.25], [-2.0, -0.125]
    cumulative = [
        _chunk(0, a[:1], la[:1]),
        _chunk(1, b[:1], lb[:1]),
        _chunk(0, a[:2], la[:2]),
        _chunk(1, b, lb, finished=True),
        _chunk(0, a, la, finished=True),
    ]
    incremental = [
        _chunk(0, a[:1], la[:1]),
        _chunk(1, b[:1], lb[:1]),
        {
            **_chunk(0, a[1:2], la[1:2]),
            "meta_info": {**_chunk(0, a[1:2], la[1:2])["meta_info"], "completion_tokens": 2},
        },
        {
            **_chunk(1, b[1:], lb[1:], True),
            "meta_info": {**_chunk(1, b[1:], lb[1:], True)["meta_info"], "completion_tokens": 2},
        },
        {
            **_chunk(0, a[2:], la[2:], True),
            "meta_info": {**_chunk(0, a[2:], la[2:], True)["meta_info"], "completion_tokens": 3},
        },
    ]
    for flag, chunks in ((False, cumulative), (True, incremental)):
        s = StreamAssembler(2, incremental=flag)
        deltas = [d for d in map(s.feed, chunks) if d is not None]
        assert [(d.index, d.start, d.token_ids) for d in deltas] == [
            (0, 0, (9,)),
            (1, 0, (7,)),
            (0, 1, (4,)),
            (1, 1, (7,)),
            (0, 2, (2,)),
        ]
        assert _joined(deltas, 2) == ([a, b], [la, lb])
        outs = parse_reply(s.replies(), [[1, 2, 3], [1, 2, 3]])
        assert [o.token_ids for o in outs] == [a, b] and [o.log_probs for o in outs] == [la, lb]
        assert [o.finish_reason for o in outs] == ["length", "length"]


def test_a_cumulative_chunk_ahead_of_its_log_probs_is_read_up_to_them():
    """SGLang hands a cumulative chunk on with a reference to the growing token list: it can hold more
    tokens than its ``completion_tokens`` and its log-prob list (CI: such a chunk was taken for an
    incremental one, its tokens counted twice, and the next chunk failed the engine). The tokens past the
    log-probs come with the next chunk; the reply is the same."""
    a, la = [9, 4, 2, 8], [-0.5, -1.0, -0.25, -3.0]
    ahead = _chunk(0, a[:2], la[:2])
    ahead["output_ids"] = a[:3]  # one token more than its log-probs and completion_tokens
    s = StreamAssembler(1)
    deltas = [d for d in map(s.feed, [_chunk(0, a[:1], la[:1]), ahead, _chunk(0, a, la, True)]) if d]
    assert [d.token_ids for d in deltas] == [(9,), (4,), (2, 8)]
    assert _joined(deltas, 1) == ([a], [la])
    assert parse_reply(s.replies(), [[1, 2, 3]])[0].token_ids == a


def test_a_sglang_stream_error_or_cut_is_an_error():
    s = StreamAssembler(1)
    s.feed(_chunk(0, [3], [-1.0]))
    with pytest.raises(ValueError, match="before prompt 0's reply was finished"):
        s.replies()  # (the stream ended without the finished chunk)
    with pytest.raises(ServerError, match="out of memory"):
        s.feed({"error": {"message": "out of memory", "type": "invalid_request_error", "code": 400}})


def test_the_engine_pool_streams_from_its_servers(engine_server):
    """Over HTTP: the pool reads its server's streamed ``/generate``, token by token (the ``sglang`` engine
    drives SGLang through it)."""
    from relax_rollout.engines.pool import EnginePool

    pool = EnginePool([engine_server])
    try:
        assert supports(pool, "stream")
        params = SamplingParams(max_new_tokens=5, min_new_tokens=5, greedy=True)
        got: list[TokenDelta] = []
        seen = threading.Event()
        outs = pool.generate(PROMPTS, params, on_token=lambda d: (got.append(d), seen.set()))
        assert seen.is_set() and len(got) == 5 * len(PROMPTS)
        ids, lps = _joined(got, len(PROMPTS))
        assert ids == [o.token_ids for o in outs] and lps == [o.log_probs for o in outs]
        assert [o.token_ids for o in pool.generate(PROMPTS, params)] == ids  # as without streaming
    finally:
        pool.close()


def test_the_external_engine_streams_from_its_servers(engine_server):
    """The ``external`` engine (SGLang servers the user launched) streams too: two servers' deltas, each
    numbered as the caller's prompts, make its outputs."""
    from relax_rollout.engines.external import ExternalEngine

    ext = ExternalEngine(urls=[engine_server, engine_server])  # (one server twice: two chunks of prompts)
    assert supports(ext, "stream")
    params = SamplingParams(max_new_tokens=4, min_new_tokens=4, greedy=True)
    got: list[TokenDelta] = []
    lock = threading.Lock()

    def keep(d: TokenDelta) -> None:
        with lock:
            got.append(d)

    outs = ext.generate(PROMPTS, params, on_token=keep)
    ids, lps = _joined(sorted(got, key=lambda d: (d.index, d.start)), len(PROMPTS))
    assert len(got) == 4 * len(PROMPTS) and {d.index for d in got} == {0, 1, 2}
    assert ids == [o.token_ids for o in outs] and lps == [o.log_probs for o in outs]
    assert [o.token_ids for o in ext.generate(PROMPTS, params)] == ids  # as without streaming
