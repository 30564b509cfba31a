"""Routes of SGLang's server beyond generation and weights: OpenAI's legacy completions, tokenize /
detokenize, server info, cache flush and Prometheus metrics — what ``bench_serving --backend sglang-oai``,
operators' scrapers and clients written for SGLang call. Each takes ``(EngineServer, body)`` like the routes
in ``app.py``; shapes follow SGLang 0.5.23's (``sglang.srt.entrypoints``)."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from relax_rollout.engines.base import SamplingParams
from relax_rollout.server import protocol
from relax_rollout.server.protocol import BadRequest, EventStream, Text

if TYPE_CHECKING:
    from relax_rollout.server.app import EngineServer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and SGLang's CompletionRequest default


def _tokenizer(s: EngineServer, field: str) -> Any:
    if s.tokenizer is None:
        raise BadRequest(field, "this server has no tokenizer; send and read token ids")
    return s.tokenizer


def completions(s: EngineServer, body: Any):
    """OpenAI ``/v1/completions``: ``prompt`` (a string, token ids, or a list of either), ``max_tokens``
    (16), ``temperature``, ``top_p``, ``n``, ``seed``, ``stop`` (the text is cut before it; ``token_ids``
    keep every generated token), ``logprobs`` (k: the sampled tokens' log-probs and, per token, a
    ``{text: logprob}`` of the k most likely, as SGLang builds it: k entries, the sampled token not added),
    ``stream``; SGLang's extras ``stop_token_ids``, ``min_tokens`` and ``matched_stop``."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    raw = body.get("prompt")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("prompt", "must be a string, a list of token ids, or a list of those")
    prompts = []
    for i, p in enumerate(raw):
        if isinstance(p, str) and p:
            prompts.append(_tokenizer(s, "prompt").encode(p, add_special_tokens=False))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            prompts.append(p)
        else:
            raise BadRequest(f"prompt[{i}]", "must be a non-empty string or list of token ids")
    n = protocol.parse_n(body)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = protocol.parse_top_logprobs(logprobs, "logprobs")
    protocol.parse_stop(body.get("stop"), "stop", protocol.MAX_STOP_OPENAI)
    for key in ("echo", "best_of", "suffix", "logit_bias"):
        if body.get(key) not in (None, False, {}, 1 if key == "best_of" else None):
            raise BadRequest(key, "is not supported by this server")
    sp = {"max_new_tokens": body.get("max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS}
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("sampling_seed", "seed"),
        ("min_new_tokens", "min_tokens"),
        ("stop_token_ids", "stop_token_ids"),
        ("stop", "stop"),
        ("frequency_penalty", "frequency_penalty"),
        ("presence_penalty", "presence_penalty"),
    ):
        if body.get(theirs) is not None:
            sp[ours] = body[theirs]
    params, min_new = protocol.parse_sampling(sp, "body")
    params = SamplingParams(**{**params.__dict__, "min_new_tokens": min_new, "top_logprobs": logprobs or 0})
    every = [p for p in prompts for _ in range(n)]
    seeded = protocol.per_choice(params, n) * len(prompts)
    rid = f"cmpl-{uuid.uuid4().hex}"
    outs = s.generate(
        every,
        seeded,
        [f"{rid}-{i}" for i in range(len(every))],
        [body.get("max_tokens") is not None] * len(every),
        {"top_logprobs": "logprobs"},
    )
    token = (lambda t: s.tokenizer.decode([t])) if s.tokenizer is not None else str
    decode = (
        (lambda ids: s.tokenizer.decode(ids, skip_special_tokens=True))
        if s.tokenizer is not None
        else (lambda _: "")
    )
    choices = []
    for i, out in enumerate(outs):
        lp = None
        if logprobs is not None:
            tokens = [token(t) for t in out.token_ids]
            offsets = [sum(len(x) for x in tokens[:k]) for k in range(len(tokens))]
            top = [{token(a): alp for a, alp in row} for row in out.top_logprobs or []] if logprobs else None
            lp = {
                "tokens": tokens,
                "token_logprobs": list(out.log_probs),
                "top_logprobs": top,
                "text_offset": offsets,
            }
        choices.append(
            {
                "index": i,
                "text": protocol.response_text(decode, out),
                "logprobs": lp,
                "finish_reason": out.finish_reason,
                "matched_stop": protocol.matched_stop(out),
                "token_ids": list(out.token_ids),
            }
        )
    prompt_tokens = sum(len(p) for p in prompts)
    made = sum(len(o.token_ids) for o in outs)
    res = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": s.served_model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": made,
            "total_tokens": prompt_tokens + made,
        },
    }
    if not body.get("stream"):
        return 200, res
    head = {k: res[k] for k in ("id", "object", "created", "model")}
    events = [{**head, "choices": [{**c, "finish_reason": None}]} for c in choices]
    events += [
        {
            **head,
            "choices": [
                {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
            ],
        }
        for c in choices
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**head, "choices": [], "usage": res["usage"]})
    return 200, EventStream(events)


def tokenize(s: EngineServer, body: Any):
    """SGLang's ``/tokenize``: ``prompt`` (a string or a list) → ``tokens``, ``count``, ``max_model_len``."""
    tok = _tokenizer(s, "prompt")
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_special_tokens=False)
        return 200, {"tokens": ids, "count": len(ids), "max_model_len": s.context_len or 0}
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        ids = [tok.encode(p, add_special_tokens=False) for p in prompt]
        return 200, {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": s.context_len or 0}
    raise BadRequest("prompt", "must be a string or a list of strings")


def detokenize(s: EngineServer, body: Any):
    """SGLang's ``/detokenize``: ``tokens`` (ids, or a list of lists) → ``text``."""
    tok = _tokenizer(s, "tokens")
    tokens = body.get("tokens") if isinstance(body, dict) else None
    skip = bool(body.get("skip_special_tokens", True)) if isinstance(body, dict) else True
    ok = lambda x: isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)  # noqa: E731
    if ok(tokens):
        return 200, {"text": tok.decode(tokens, skip_special_tokens=skip)}
    if isinstance(tokens, list) and all(ok(x) for x in tokens):
        return 200, {"text": [tok.decode(x, skip_special_tokens=skip) for x in tokens]}
    raise BadRequest("tokens", "must be a list of token ids or a list of such lists")


def server_info(s: EngineServer, _: Any):
    """What SGLang's ``/server_info`` reports that applies here."""
    from relax_rollout import __version__

    return 200, {
        "model_path": s.model_path,
        "served_model_name": s.served_model_name,
        "context_length": s.context_len,
        "vocab_size": s.vocab_size,
        "weight_version": str(s.engine.weight_version),
        "version": f"relax-rollout {__version__}",
        "paused": s.paused,
    }


def flush_cache(s: EngineServer, _: Any):
    """SGLang flushes its radix (prefix) cache; this server's engines keep none between requests."""
    return 200, Text("Cache flushed.\n")


def metrics(s: EngineServer, _: Any):
    return 200, Text(
        s.metrics.render(s.served_model_name, str(s.engine.weight_version)),
        "text/plain; version=0.0.4; charset=utf-8",
    )
