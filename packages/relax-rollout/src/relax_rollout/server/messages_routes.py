"""Anthropic's Messages API (``POST /v1/messages``) on the engine server: a request is translated into the
chat route's (:func:`~relax_rollout.server.openai_routes.chat_completions`) and its answer back, so a
message is generated, parsed for tool calls and — in an agent session (``X-Relax-Session``) — recorded
token-exactly by the same code as a chat completion: the same conversation through either protocol is the
same tokens and loss masks (#55).

What maps to what: ``system`` → a system message; ``text`` blocks → content; ``tool_use`` blocks of the
assistant → its ``tool_calls``; ``tool_result`` blocks → ``tool`` messages; ``tools`` (``input_schema``) →
function tools; ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` → ``auto`` / ``required`` / the named
function / ``none``; ``stop_sequences`` → ``stop``. Back: ``end_turn``, ``max_tokens``, ``tool_use``,
``stop_sequence`` as stop reasons, ``input_tokens`` / ``output_tokens`` as usage. Errors answer in Anthropic's
shape (``{"type": "error", "error": {"type": "invalid_request_error", "message"}}``), naming the field.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from relax_rollout.http_api import EventStream, Request
from relax_rollout.server import openai_routes
from relax_rollout.server.protocol import BadRequest, objects
from relax_rollout.server.state import EngineServer

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text(content: Any, where: str) -> str:
    """A content given as a string or as text blocks, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(where, "must be a string or a list of content blocks")
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise BadRequest(f"{where}[{i}]", f"a {kind!r} block where text is expected")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user turn of tool results becomes ``tool`` messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise BadRequest(f"{where}.role", "must be 'user' or 'assistant'")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content", "must be a string or a list of content blocks")
    text, calls, results = [], [], []
    for k, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use" and m["role"] == "assistant":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind == "tool_result" and m["role"] == "user":
            body = block.get("content", "")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _text(body, f"{where}.content[{k}].content"),
                }
            )
        else:
            raise BadRequest(
                f"{where}.content[{k}]", f"a {kind!r} block is not served here (text, tool_use, tool_result)"
            )
    out: list[dict[str, Any]] = [*results]
    if m["role"] == "assistant":
        out.append(
            {
                "role": "assistant",
                "content": "".join(text) or None,
                **({"tool_calls": calls} if calls else {}),
            }
        )
    elif text or not results:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise BadRequest("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Messages request is (a field that cannot be served is refused by name)."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object (a Messages API request)")
    for field in ("model", "max_tokens", "messages"):
        if field not in body:
            raise BadRequest(field, "is required")
    if not isinstance(body["messages"], list) or not body["messages"]:
        raise BadRequest("messages", "must be a non-empty list")
    chat: dict[str, Any] = {"model": body["model"], "max_tokens": body["max_tokens"], "messages": []}
    if body.get("system"):
        chat["messages"].append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(body["messages"]):
        chat["messages"] += _message(m, i)
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("stop", "stop_sequences")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    if body.get("top_k") is not None:
        raise BadRequest("top_k", "is not served here (the engines sample without a top-k cut)")
    if body.get("tools"):
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or {},
                },
            }
            for t in objects(body["tools"], "tools")
        ]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("stream"):
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return chat


def from_chat(out: dict[str, Any], model: str, stops: list[str]) -> dict[str, Any]:
    """A ``chat.completion`` as an Anthropic ``message``."""
    choice = out["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = [{"type": "text", "text": msg["content"]}] if msg.get("content") else []
    for call in msg.get("tool_calls") or []:
        args = call["function"]["arguments"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(args or "{}"),
            }
        )
    reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
    matched = choice.get("matched_stop")
    stopped_by = matched if reason == "end_turn" and isinstance(matched, str) and matched in stops else None
    if stopped_by is not None:  # (one of the request's stop_sequences, not EOS)
        reason = "stop_sequence"
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stopped_by,
        "usage": {
            "input_tokens": out["usage"]["prompt_tokens"],
            "output_tokens": out["usage"]["completion_tokens"],
        },
        **{k: out[k] for k in ("metadata", "prompt_token_ids") if k in out},  # (our extensions, as on chat)
    }


def messages(s: EngineServer, body: dict, req: Request) -> tuple[int, Any]:
    """``POST /v1/messages``."""
    try:
        chat = to_chat(body)
        status, out = openai_routes.chat_completions(s, chat, req)
    except BadRequest as e:
        return 400, error(str(e))
    if status != 200:  # (the chat route's own error body)
        return status, error(
            str(out.get("message", out)), "invalid_request_error" if status < 500 else "api_error"
        )
    if isinstance(out, EventStream):
        return 200, EventStream(_events(out, body["model"]), out.on_close, named=True)
    return status, from_chat(out, body["model"], chat.get("stop") or [])


def _events(chunks: EventStream, model: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The chat stream's chunks as Messages stream events (text and tool-use blocks, their deltas)."""
    head: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    yield "message_start", {"type": "message_start", "message": head}
    block, kind, calls, finish, usage = -1, None, {}, "stop", None
    for chunk in chunks.events:
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            finish = choice.get("finish_reason") or finish
            if delta.get("content"):
                if kind != "text":
                    if block >= 0:
                        yield "content_block_stop", {"type": "content_block_stop", "index": block}
                    block, kind = block + 1, "text"
                    yield (
                        "content_block_start",
                        {
                            "type": "content_block_start",
                            "index": block,
                            "content_block": {"type": "text", "text": ""},
                        },
                    )
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": block,
                        "delta": {"type": "text_delta", "text": delta["content"]},
                    },
                )
            for call in delta.get("tool_calls") or []:
                if call.get("index") not in calls:
                    if block >= 0:
                        yield "content_block_stop", {"type": "content_block_stop", "index": block}
                    block, kind = block + 1, "tool_use"
                    calls[call.get("index")] = block
                    fn = call.get("function") or {}
                    start = {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": {}}
                    yield (
                        "content_block_start",
                        {"type": "content_block_start", "index": block, "content_block": start},
                    )
                args = (call.get("function") or {}).get("arguments")
                if args:
                    yield (
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": calls[call.get("index")],
                            "delta": {"type": "input_json_delta", "partial_json": args},
                        },
                    )
    if block >= 0:
        yield "content_block_stop", {"type": "content_block_stop", "index": block}
    out_tokens = usage["completion_tokens"] if usage else 0
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None},
            "usage": {"output_tokens": out_tokens},
        },
    )
    yield "message_stop", {"type": "message_stop"}
