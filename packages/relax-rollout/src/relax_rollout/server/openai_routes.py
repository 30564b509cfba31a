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

from relax_rollout.engines.base import GenerateOutput, SamplingParams, TokenDelta
from relax_rollout.http_api import EventStream
from relax_rollout.server import chat_request, openai_types, protocol, tool_calls, trajectories
from relax_rollout.server.protocol import BadRequest
from relax_rollout.server.streaming import TextDeltas, stop_token_ids

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from relax_rollout.http_api import Request
    from relax_rollout.server.state import EngineServer
    from relax_rollout.server.streaming import GenerationStream

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
    recorded trajectory holds token ids, not the media tensors a trainer would need with them. ``tools``
    are rendered by the chat template and the reply's calls parsed (``server.tool_calls``); a forced call
    (``tool_choice``) or JSON (``response_format``) is decoded under a constraint."""
    if s.tokenizer is None or s.recorder is None:
        raise BadRequest("messages", "this server has no tokenizer, so no chat template")
    chat = chat_request.parse_chat(body)
    session = trajectories.session_name(req.headers.get(trajectories.SESSION_HEADER), body)
    _check_chat(s, chat, session)
    request = chat.request
    template = tool_calls.response_template(s.tokenizer, s.engine, s.model_path)
    constraint, asked_by = tool_calls.constraint(request, template)
    params, min_new = protocol.parse_sampling(chat.sampling)
    params = SamplingParams(
        **{
            **params.__dict__,
            "min_new_tokens": min_new,
            "top_logprobs": chat.top_logprobs,
            "constraint": constraint,
        }
    )
    fields = {**CHAT_FIELDS, "constraint": asked_by}
    if constraint is not None:
        _check_constraint(s, params, fields, asked_by)
    kwargs = tool_calls.template_kwargs(request)
    every = protocol.per_choice(params, chat.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    given = [protocol.max_new_given(chat.sampling)] * chat.n
    ends = {*getattr(s.engine, "eos_token_ids", ()), s.tokenizer.eos_token_id, *params.stop_token_ids}

    def reply(out: GenerateOutput, prompt: list[int]) -> tuple[dict, str]:
        return tool_calls.reply(s.tokenizer, out, _reply(s, out), prompt, request, template, ends)

    recorded = None
    mm: list[dict[str, Any] | None] | None = None
    if session is None:
        if chat.images:
            assert s.media is not None, "images without a multimodal model are refused above"
            prompt, tensors = s.media.prompt(chat.messages, chat.images, kwargs)
            mm = [tensors] * chat.n
        else:
            prompt = trajectories.render_prompt(s.tokenizer, chat.messages, kwargs)
        rids = [f"{rid}-{i}" for i in range(chat.n)]
        if chat.stream:  # token by token (chat_stream)
            stream = s.stream([prompt] * chat.n, every, rids, given, fields, mm)
            marks = _markers(s, request, template, prompt)
            return 200, chat_stream(
                s, chat, stream, rid, len(prompt), every, lambda o: reply(o, prompt), marks
            )
        outs = s.generate([prompt] * chat.n, every, rids, given, fields, mm)
        replies = [reply(out, prompt) for out in outs]
    elif chat.stream:  # token by token; the turn is recorded (its session's lock held) until it ends
        turn = s.recorder.turn(session, chat.messages, kwargs)
        stream = _session_stream(s, turn, every, rid, given, fields, reply)
        marks = _markers(s, request, template, turn.prompt_ids)
        prompt_len = len(turn.prompt_ids)
        return 200, chat_stream(
            s, chat, stream, rid, prompt_len, every, lambda o: reply(o, turn.prompt_ids), marks
        )
    else:
        with s.recorder.turn(session, chat.messages, kwargs) as turn:
            # the session's recorded ids + the template's suffix: the model sees exactly its own tokens
            prompt = turn.prompt_ids
            outs = s.generate([prompt], every, [rid], given, fields)
            replies = [reply(outs[0], prompt)]
            recorded = turn.record(outs[0], tool_calls.template_message(replies[0][0]))
    return 200, _chat_completion(s, chat, rid, outs, replies, prompt, recorded)


def _check_chat(s: EngineServer, chat: chat_request.ChatRequest, session: str | None) -> None:
    """What a chat call may not ask of this server or of a session, refused with the field to change."""
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


def _chat_completion(
    s: EngineServer,
    chat: chat_request.ChatRequest,
    rid: str,
    outs: list[GenerateOutput],
    replies: list[tuple[dict, str]],
    prompt: list[int],
    recorded: dict | None,
) -> dict:
    """The ``chat.completion`` body: the choices, usage, and our extensions (the prompt's token ids, the
    weight versions, the session trajectory a call extended)."""
    choices = [
        _choice(
            i,
            out,
            {"message": message},
            _chat_logprobs(s, out) if chat.logprobs else None,
            finish,
        )
        for i, (out, (message, finish)) in enumerate(zip(outs, replies))
    ]
    metadata = protocol.weight_metadata(outs[0])  # SGLang's: the first choice's weight versions
    extensions = {
        "prompt_token_ids": prompt,  # what the trainer should record as the prompt
        "metadata": metadata,
        "weight_version": metadata["weight_version"],  # (our extension before SGLang had metadata)
    }
    if recorded:  # which trajectory of the session this call extended
        extensions["relax_trajectory"] = {k: recorded[k] for k in ("session", "index", "num_calls")}
    made = sum(len(out.token_ids) for out in outs)
    return _response(s, rid, "chat.completion", choices, len(prompt), made, **extensions)


def _check_constraint(s: EngineServer, params: SamplingParams, fields: dict[str, str], asked_by: str) -> None:
    """A 400 before generating: the engine cannot decode under a constraint (naming the field that asked
    for one), or the constraint does not compile (a tool's ``parameters`` or the JSON schema is invalid)."""
    s.check_features([params], fields)
    from relax_rollout.engines.constrained import check_constraint

    assert params.constraint is not None, "checked only for a constrained request"
    try:
        check_constraint(params.constraint)
    except ValueError as e:
        field = "tools" if asked_by == "tool_choice" else "response_format.json_schema.schema"
        raise BadRequest(field, str(e)) from None


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
    rids, given = [f"{rid}-{i}" for i in range(len(every))], [body.get("max_tokens") is not None] * len(every)
    if body.get("stream"):  # token by token
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        stream = s.stream(every, seeded, rids, given, {"top_logprobs": "logprobs"})
        return 200, completion_stream(s, stream, rid, seeded, logprobs, sum(len(p) for p in prompts), usage)
    outs = s.generate(every, seeded, rids, given, {"top_logprobs": "logprobs"})
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
    metadata = protocol.weight_metadata(outs[0])  # SGLang's: the first choice's weight versions
    return 200, _response(s, rid, "text_completion", choices, prompt_tokens, made, metadata=metadata)


def _session_stream(s, turn, every, rid, given, fields, reply) -> GenerationStream:
    """An agent session's streamed call: the turn (its session's lock) is entered here and left by the
    generation's thread once the reply is recorded, as the non-streamed call records it."""
    turn.__enter__()

    def record(outs: list[GenerateOutput] | None) -> Any:
        try:
            if outs:
                return turn.record(outs[0], tool_calls.template_message(reply(outs[0], turn.prompt_ids)[0]))
        finally:
            turn.__exit__(None, None, None)

    try:
        return s.stream([turn.prompt_ids], every, [rid], given, fields, on_done=record)
    except BaseException:
        turn.__exit__(None, None, None)
        raise


def _markers(s: EngineServer, request: Any, template: dict, prompt: list[int]) -> tuple[str, ...] | None:
    """What ends a streamed chat reply's text going out token by token: the template's thinking marks and,
    with tools offered, the mark that opens a call. Up to one of them the reply's text is its content as
    generated; from it only the whole reply says what is content, ``reasoning_content`` and ``tool_calls``
    (``tool_calls.reply``), which then come in its last delta. None: not one token can go out as content
    (the prompt opens the thinking, or the calls' opening mark is not a plain string)."""
    fields = template.get("fields") or {}
    marks: list[str] = []
    thinking = fields.get("thinking")
    if isinstance(thinking, dict):
        opened, closed = thinking.get("open"), thinking.get("close")
        marks += [m for m in (opened, closed) if isinstance(m, str) and m]
        tail = s.tokenizer.decode(prompt[-16:], skip_special_tokens=False)
        if isinstance(opened, str) and opened and tail.rfind(opened) > tail.rfind(closed or "\0"):
            return None
    if tool_calls.offered_tools(request) is not None:
        call = fields.get("tool_calls") or {}
        opening = call.get("open") or (call.get("open_pattern") or "").removeprefix(r"\s*")
        if not isinstance(opening, str) or not opening or any(c in opening for c in "\\()[]{}?*+|^$"):
            return None
        marks.append(opening)
    return tuple(marks)


def chat_stream(
    s: EngineServer,
    chat: chat_request.ChatRequest,
    stream: GenerationStream,
    rid: str,
    prompt_len: int,
    params: list[SamplingParams],
    reply: Callable[[GenerateOutput], tuple[dict, str]],
    marks: tuple[str, ...] | None = (),
) -> EventStream:
    """A chat completion as OpenAI's ``chat.completion.chunk`` stream, token by token: per choice (``index``;
    ``n`` choices interleave as they are sampled, those with seeds of their own one after another) chunks with the text as it comes (the first also with
    the role; with ``logprobs`` each chunk's tokens' log-probs), then, once generated, the rest of its
    message (``reply(output)``: the hook for what only the whole reply shows, tool calls and reasoning,
    ``stream_delta``), and a chunk with its finish reason and ``matched_stop``; with ``include_usage`` a
    last chunk with the usage and no choices. ``marks`` (see :func:`_markers`): a choice's text stops going
    out as it comes at the first of them (None: at once), the rest waits for the whole reply."""
    head = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": s.served_model_name,
    }
    return EventStream(
        _chat_events(s, chat, stream, head, prompt_len, params, reply, marks), on_close=stream.close
    )


def _chat_events(s, chat, stream, head, prompt_len, params, reply, marks) -> Iterator[dict]:
    texts = [TextDeltas(s.decode, (*p.stop, *(marks or ())), stop_token_ids(s.engine, p)) for p in params]
    opened, live = [False] * len(params), [marks is not None] * len(params)

    def chunk(i: int, delta: dict, logprobs: dict | None = None, finish: str | None = None, **extra) -> dict:
        if not opened[i]:
            delta, opened[i] = {"role": "assistant", **delta}, True
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra}
        return openai_types.body({**head, "choices": [choice]})

    outs: list[GenerateOutput] = []
    for item in stream:
        if not isinstance(item, TokenDelta):
            outs = item
            continue
        i, t = item.index, texts[item.index]
        if live[i] and marks:  # (a mark may be a special token: looked for in the text with them)
            raw = s.tokenizer.decode([*t.tokens, *item.token_ids], skip_special_tokens=False)
            live[i] = not any(m in raw for m in marks)
        text = t.add(item.token_ids) if live[i] else t.keep(item.token_ids)
        lps = None
        if chat.logprobs:
            tops = item.top_logprobs or [()] * len(item.token_ids)
            lps = {
                "content": [
                    {**_chat_logprob(s, t, lp), "top_logprobs": [_chat_logprob(s, a, alp) for a, alp in top]}
                    for t, lp, top in zip(item.token_ids, item.log_probs, tops)
                ]
            }
        if (live[i] and text) or lps:
            yield chunk(i, {"content": text if live[i] else ""}, lps)
    for i, out in enumerate(outs):
        message, finish = reply(out)
        delta = stream_delta(message)
        content = delta.pop("content", None)
        rest = texts[i].finish(content or "") if texts[i].sent else content
        if rest or not opened[i]:
            delta = {"content": rest, **delta}
        if delta:
            yield chunk(i, delta)
        yield chunk(i, {}, None, finish, matched_stop=protocol.matched_stop(out))
    if chat.include_usage:
        made = sum(len(o.token_ids) for o in outs)
        usage = {"prompt_tokens": prompt_len, "completion_tokens": made}
        usage["total_tokens"] = prompt_len + made
        yield openai_types.body({**head, "choices": [], "usage": usage})


def stream_delta(message: dict) -> dict:
    """A whole chat message as one stream delta: its ``content``, ``reasoning_content`` and ``tool_calls``
    (each with its ``index``, as OpenAI's chunks carry them)."""
    delta = {k: v for k, v in message.items() if k in ("content", "reasoning_content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    return delta


def completion_stream(
    s: EngineServer,
    stream: GenerationStream,
    rid: str,
    params: list[SamplingParams],
    logprobs: int | None,
    prompt_tokens: int,
    include_usage: bool,
) -> EventStream:
    """A text completion as OpenAI's ``text_completion`` stream, token by token: per choice (``index``,
    interleaved as sampled) chunks with the text as it comes (with ``logprobs``, each chunk's tokens' as
    the whole reply lists them, ``text_offset`` counted over the whole text), then per choice the rest of
    its text once generated and a chunk with its finish reason and ``matched_stop``; with
    ``include_usage`` a last chunk with the usage and no choices."""
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": s.served_model_name}
    events = _completion_events(s, stream, head, params, logprobs, prompt_tokens, include_usage)
    return EventStream(events, on_close=stream.close)


def _completion_events(s, stream, head, params, logprobs, prompt_tokens, include_usage) -> Iterator[dict]:
    token = (lambda t: s.tokenizer.decode([t])) if s.tokenizer is not None else str
    texts = [TextDeltas(s.decode, p.stop, stop_token_ids(s.engine, p)) for p in params]
    offset = [0] * len(params)  # each choice's log-prob tokens' text so far

    def chunk(i: int, text: str, lp: dict | None = None, finish: str | None = None, **extra) -> dict:
        choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish, **extra}
        return openai_types.body({**head, "choices": [choice]})

    outs: list[GenerateOutput] = []
    for item in stream:
        if not isinstance(item, TokenDelta):
            outs = item
            continue
        i, text, lp = item.index, texts[item.index].add(item.token_ids), None
        if logprobs is not None:
            tokens = [token(t) for t in item.token_ids]
            offsets = [offset[i] + sum(len(x) for x in tokens[:k]) for k in range(len(tokens))]
            offset[i] += sum(len(x) for x in tokens)
            tops = item.top_logprobs or ()
            lp = {
                "tokens": tokens,
                "token_logprobs": list(item.log_probs),
                "top_logprobs": [{token(a): alp for a, alp in row} for row in tops] if logprobs else None,
                "text_offset": offsets,
            }
        if text or lp:
            yield chunk(i, text, lp)
    for i, out in enumerate(outs):
        rest = texts[i].finish(protocol.response_text(s.decode, out))
        if rest:
            yield chunk(i, rest)
    for i, out in enumerate(outs):
        yield chunk(i, "", None, out.finish_reason, matched_stop=protocol.matched_stop(out))
    if include_usage:
        made = sum(len(o.token_ids) for o in outs)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": made,
            "total_tokens": prompt_tokens + made,
        }
        yield openai_types.body({**head, "choices": [], "usage": usage})


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


def _choice(
    index: int, out: GenerateOutput, content: dict, logprobs: dict | None, finish: str | None = None
) -> dict:
    """One choice of an OpenAI response: ``content`` (chat's ``message``, completions' ``text``), its
    ``logprobs`` and ``finish_reason`` (``finish``, else the engine's), and two extensions: ``matched_stop``
    (SGLang's: the stop string or token) and ``token_ids`` (vLLM's name: the exact sampled tokens)."""
    return {
        "index": index,
        **content,
        "logprobs": logprobs,
        "finish_reason": finish or out.finish_reason,
        "matched_stop": protocol.matched_stop(out),
        "token_ids": list(out.token_ids),
    }


def _response(
    s: EngineServer, rid: str, kind: str, choices: list[dict], prompt: int, made: int, **extensions: Any
) -> dict:
    """An OpenAI response (``object`` ``kind``) with its ``usage`` of ``prompt`` and ``made`` tokens and our
    ``extensions``, checked as its typed model (:mod:`relax_rollout.server.openai_types`)."""
    usage = {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}
    res = {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": s.served_model_name,
        "choices": choices,
        "usage": usage,
    }
    return openai_types.body({**res, **extensions})
