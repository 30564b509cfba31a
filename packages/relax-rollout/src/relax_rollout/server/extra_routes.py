"""Routes of SGLang's server beyond generation and weights: tokenize / detokenize, server info, cache flush
and Prometheus metrics — what operators' scrapers and clients written for SGLang call. Each takes
``(EngineServer, body)`` like the routes in ``sglang_routes.py``; shapes follow SGLang 0.5.23's
(``sglang.srt.entrypoints``). OpenAI's legacy completions, once here, are with the other OpenAI routes in
``openai_routes.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

from relax_rollout.http_api import Text
from relax_rollout.server.protocol import BadRequest

if TYPE_CHECKING:
    from relax_rollout.http_api import Request
    from relax_rollout.server.state import EngineServer


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


def _ids(x: Any) -> TypeGuard[list[int]]:
    """Whether ``x`` is a list of token ids (ints, not bools)."""
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def detokenize(s: EngineServer, body: Any):
    """SGLang's ``/detokenize``: ``tokens`` (ids, or a list of lists) → ``text``."""
    tok = s.need_tokenizer("tokens")
    tokens = body.get("tokens") if isinstance(body, dict) else None
    skip = bool(body.get("skip_special_tokens", True)) if isinstance(body, dict) else True
    if _ids(tokens):
        s.check_ids(tokens, "tokens")
        return 200, {"text": tok.decode(tokens, skip_special_tokens=skip)}
    if isinstance(tokens, list) and all(_ids(x) for x in tokens):
        for i, x in enumerate(tokens):
            s.check_ids(x, f"tokens[{i}]")
        return 200, {"text": [tok.decode(x, skip_special_tokens=skip) for x in tokens]}
    raise BadRequest("tokens", "must be a list of token ids or a list of such lists")


def server_info(s: EngineServer, _: Any):
    """SGLang's ``/server_info`` (and its older name ``/get_server_info``): the launch settings and live
    state SGLang 0.5.23 reports there that apply here, under its keys (``model_path``, ``tokenizer_path``,
    ``served_model_name``, ``context_length``, ``skip_tokenizer_init``, ``enable_metrics``,
    ``disable_radix_cache`` and ``disable_overlap_schedule``: true, this server has neither a prefix cache
    nor an overlap scheduler; ``max_queued_requests``, ``tp_size`` / ``dp_size`` 1, ``device``, ``dtype``,
    ``internal_states`` with ``last_gen_throughput``, ``version``), and ours: ``vocab_size``,
    ``weight_version``, ``paused``, ``engine`` and its ``features``."""
    from relax_rollout import __version__

    model = getattr(s.engine, "model", None)
    dtype = getattr(model, "dtype", None)
    return 200, {
        "model_path": s.model_path,
        "tokenizer_path": s.model_path if s.tokenizer is not None else None,
        "served_model_name": s.served_model_name,
        "context_length": s.context_len,
        "skip_tokenizer_init": s.tokenizer is None,
        "enable_metrics": True,
        "disable_radix_cache": True,
        "disable_overlap_schedule": True,
        "max_queued_requests": s.max_queued_requests,
        "tp_size": 1,
        "dp_size": 1,
        "device": str(getattr(s.engine, "device", "")) or None,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
        "internal_states": [{"last_gen_throughput": s.metrics.throughput()}],
        "version": f"relax-rollout {__version__}",
        "vocab_size": s.vocab_size,
        "weight_version": str(s.engine.weight_version),
        "paused": s.paused,
        "engine": type(s.engine).__name__,
        "features": sorted(getattr(s.engine, "features", ())),
    }


def flush_cache(s: EngineServer, _: Any):
    """SGLang flushes its radix (prefix) cache; this server's engines keep none between requests."""
    return 200, Text("Cache flushed.\n")


def metrics(s: EngineServer, _: Any, req: Request):
    """Prometheus metrics (``server.metrics``): OpenMetrics when the ``Accept`` header asks for it (as
    Prometheus does), else the text format 0.0.4."""
    body, content_type = s.metrics.render(req.headers.get("accept"))
    return 200, Text(body.decode(), content_type)
