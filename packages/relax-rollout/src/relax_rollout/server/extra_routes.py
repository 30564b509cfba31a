"""Routes of SGLang's server beyond generation and weights: tokenize / detokenize, server info, cache flush
and Prometheus metrics — what operators' scrapers and clients written for SGLang call. Each takes
``(EngineServer, body)`` like the routes in ``sglang_routes.py``; shapes follow SGLang 0.5.23's
(``sglang.srt.entrypoints``). OpenAI's legacy completions, once here, are with the other OpenAI routes in
``openai_routes.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relax_rollout.server.protocol import BadRequest, Text

if TYPE_CHECKING:
    from relax_rollout.server.app import EngineServer


def tokenize(s: EngineServer, body: Any):
    """SGLang's ``/tokenize``: ``prompt`` (a string or a list) → ``tokens``, ``count``, ``max_model_len``."""
    tok = s.need_tokenizer("prompt")
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
    tok = s.need_tokenizer("tokens")
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
