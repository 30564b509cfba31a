"""OpenAI's routes of the engine server: ``/v1/models``, ``/v1/chat/completions`` and the legacy
``/v1/completions``, and the server-sent event streams they answer with ``stream``.

Why a module of its own: these serve agents, OpenAI clients and ``bench_serving --backend sglang-oai``,
while the SGLang-native routes the trainer's side calls are :mod:`relax_rollout.server.sglang_routes`.
The two OpenAI routes share their response shape here — choices with the token-exact extensions
``token_ids`` and ``matched_stop``, usage, streams — following SGLang 0.5.23's OpenAI entrypoints. Each
route takes ``(EngineServer, body)`` (chat also the request, for its session header) and returns
``(status, out)``; chat calls naming a session are recorded as agent trajectories
(:mod:`relax_rollout.server.trajectories`).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from relax_rollout.engines.base import GenerateOutput, SamplingParams
from relax_rollout.server import protocol, trajectories
from relax_rollout.server.protocol import BadRequest, EventStream

if TYPE_CHECKING:
    from relax_rollout.http_api import Request
    from relax_rollout.server.app import EngineServer

CHAT_FIELDS = {"top_logprobs": "top_logprobs", "stop": "stop"}
"""The chat request's names of the engine features it asks for (see ``EngineServer.check_features``)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and SGLang's CompletionRequest default


def models(s: EngineServer, _: dict):
    card = {
        "id": s.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "relax",
        "root": s.served_model_name,
    }
    return 200, {"object": "list", "data": [card]}


def chat_completions(s: EngineServer, body: dict, req: Request):
    """OpenAI chat. With a session (``X-Relax-Session`` or ``user``) the prompt continues the session's
    recorded token ids (see ``trajectories``), and the call is recorded. ``n`` choices are sampled together
    (each with its own seed when one is given); ``stream`` answers in server-sent events. ``image_url``
    parts (``data:`` URLs) are served for a Qwen-VL/Omni model (``server.media``), outside sessions only: a
    recorded trajectory holds token ids, not the media tensors a trainer would need with them."""
    if s.tokenizer is None or s.recorder is None:
        raise BadRequest("messages", "this server has no tokenizer, so no chat template")
    chat = protocol.parse_chat(body)
    session = trajectories.session_name(req.headers.get(trajectories.SESSION_HEADER), body)
    if session is not None and chat.n > 1:
        raise BadRequest("n", "a session's call extends one trajectory: n must be 1 (send n calls instead)")
    if chat.images and s.media is None:
        raise BadRequest(chat.images[0].where, f"'image_url' parts need a multimodal model; {s.no_media}")
    if chat.images and session is not None:
        raise BadRequest(
            chat.images[0].where,
            "images are not recorded in agent sessions (X-Relax-Session "
            "or 'user'): send calls with images without one",
        )
    params, min_new = protocol.parse_sampling(chat.sampling)
    params = SamplingParams(
        **{**params.__dict__, "min_new_tokens": min_new, "top_logprobs": chat.top_logprobs}
    )
    every = protocol.per_choice(params, chat.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    given = [protocol.max_new_given(chat.sampling)] * chat.n
    recorded, mm = None, None
    if session is None:
        if chat.images:
            prompt, tensors = s.media.prompt(chat.messages, chat.images)
            mm = [tensors] * chat.n
        else:
            prompt = trajectories.render_prompt(s.tokenizer, chat.messages)
        rids = [f"{rid}-{i}" for i in range(chat.n)]
        outs = s.generate([prompt] * chat.n, every, rids, given, CHAT_FIELDS, mm)
    else:
        with s.recorder.turn(session, chat.messages) as turn:
            # the session's recorded ids + the template's suffix: the model sees exactly its own tokens
            prompt = turn.prompt_ids
            outs = s.generate([prompt], every, [rid], given, CHAT_FIELDS)
            recorded = turn.record(outs[0], _reply(s, outs[0]))
    choices = [
        _choice(
            i,
            out,
            {"message": {"role": "assistant", "content": _reply(s, out)}},
            _chat_logprobs(s, out) if chat.logprobs else None,
        )
        for i, out in enumerate(outs)
    ]
    res = _response(s, rid, "chat.completion", choices, len(prompt), sum(len(out.token_ids) for out in outs))
    res["prompt_token_ids"] = prompt  # extension: what the trainer should record as the prompt
    res["metadata"] = protocol.weight_metadata(outs[0])  # SGLang's: the first choice's weight versions
    res["weight_version"] = res["metadata"]["weight_version"]  # (our extension before SGLang had metadata)
    if recorded:  # extension: which trajectory of the session this call extended
        res["relax_trajectory"] = {k: recorded[k] for k in ("session", "index", "num_calls")}
    return 200, (chat_stream(res, chat.include_usage) if chat.stream else res)


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
            prompts.append(s.need_tokenizer("prompt").encode(p, add_special_tokens=False))
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
    # (SGLang's completions take top_k, min_p and repetition_penalty too: refused unless neutral, never
    # silently ignored)
    sp |= protocol.openai_sampling(body, protocol.OPENAI_SAMPLING + protocol.NEUTRAL_ONLY)
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
        choices.append(_choice(i, out, {"text": protocol.response_text(s.decode, out)}, lp))
    prompt_tokens = sum(len(p) for p in prompts)
    made = sum(len(o.token_ids) for o in outs)
    res = _response(s, rid, "text_completion", choices, prompt_tokens, made)
    res["metadata"] = protocol.weight_metadata(outs[0])  # SGLang's: the first choice's weight versions
    if not body.get("stream"):
        return 200, res
    return 200, completion_stream(res, bool((body.get("stream_options") or {}).get("include_usage")))


def chat_stream(res: dict, include_usage: bool) -> EventStream:
    """A whole chat completion as OpenAI's ``chat.completion.chunk`` stream: per choice a chunk with the
    role and content (and log-probs), then one with its finish reason; with ``include_usage`` a last chunk
    with the usage and no choices. The content comes as one delta once generated (not token by token: the
    engines hand over finished responses)."""
    head = {k: res[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    events = []
    for ch in res["choices"]:
        delta = {"role": "assistant", "content": ch["message"]["content"]}
        events.append(
            {
                **head,
                "choices": [
                    {"index": ch["index"], "delta": delta, "logprobs": ch["logprobs"], "finish_reason": None}
                ],
            }
        )
        events.append(
            {
                **head,
                "choices": [
                    {
                        "index": ch["index"],
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": ch["finish_reason"],
                    }
                ],
            }
        )
    if include_usage:
        events.append({**head, "choices": [], "usage": res["usage"]})
    return EventStream(events)


def completion_stream(res: dict, include_usage: bool) -> EventStream:
    """A whole text completion as OpenAI's ``text_completion`` stream: per choice a chunk with its text (and
    log-probs), then per choice one with its finish reason; with ``include_usage`` a last chunk with the
    usage and no choices."""
    head = {k: res[k] for k in ("id", "object", "created", "model")}
    events = [{**head, "choices": [{**c, "finish_reason": None}]} for c in res["choices"]]
    events += [
        {
            **head,
            "choices": [
                {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
            ],
        }
        for c in res["choices"]
    ]
    if include_usage:
        events.append({**head, "choices": [], "usage": res["usage"]})
    return EventStream(events)


def _reply(s: EngineServer, out: GenerateOutput) -> str:
    """A choice's text: cut before its stop string (OpenAI's and SGLang's ``stop``)."""
    return protocol.response_text(s.decode, out)


def _chat_logprob(s: EngineServer, token_id: int, logprob: float) -> dict:
    """OpenAI's ``{token, logprob, bytes}``; ``bytes`` are the UTF-8 of the token's text (as SGLang for a
    tokenizer that is not byte-level; a byte-level token that is part of a character shows U+FFFD)."""
    text = s.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(s: EngineServer, out: GenerateOutput) -> dict:
    """A chat choice's ``logprobs``: every generated token, the stop string's included (as SGLang)."""
    tops = out.top_logprobs or [[]] * len(out.token_ids)
    return {
        "content": [
            {**_chat_logprob(s, t, lp), "top_logprobs": [_chat_logprob(s, a, alp) for a, alp in top]}
            for t, lp, top in zip(out.token_ids, out.log_probs, tops)
        ]
    }


def _choice(index: int, out: GenerateOutput, content: dict, logprobs: dict | None) -> dict:
    """One choice of an OpenAI response: ``content`` (chat's ``message``, completions' ``text``), its
    ``logprobs`` and ``finish_reason``, and two extensions: ``matched_stop`` (SGLang's: the stop string or
    token) and ``token_ids`` (vLLM's name: the exact sampled tokens)."""
    return {
        "index": index,
        **content,
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
        "matched_stop": protocol.matched_stop(out),
        "token_ids": list(out.token_ids),
    }


def _response(s: EngineServer, rid: str, kind: str, choices: list[dict], prompt: int, made: int) -> dict:
    """An OpenAI response (``object`` ``kind``) with its ``usage`` of ``prompt`` and ``made`` tokens."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": s.served_model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made},
    }
