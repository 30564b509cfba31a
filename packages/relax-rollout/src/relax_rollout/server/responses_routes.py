"""OpenAI's Responses API (``POST /v1/responses``) on the engine server: a request is translated into the chat
route's (:func:`~relax_rollout.server.openai_routes.chat_completions`) and its answer back, as the Messages
API is (:mod:`.messages_routes`): one generation, tool-call parsing and session recording for the three
protocols, so an agent session records the same tokens and loss masks through any of them (#55).

What maps to what: ``instructions`` → a system message; ``input`` (a string, or items: messages with
``input_text`` / ``output_text`` parts, ``function_call`` and ``function_call_output``) → chat messages, the
function calls of one turn gathered into one assistant message; ``tools`` of type ``function`` → function
tools; ``tool_choice``; ``text.format`` (``json_schema`` / ``json_object``) → ``response_format``;
``max_output_tokens`` → ``max_tokens``. ``previous_response_id`` continues a stored response: the server
keeps each response's conversation (:class:`~relax_rollout.server.response_store.ResponseStore`: a
bounded number, for an hour; ``store: false`` keeps none). Streaming sends the protocol's events (``response.created`` …
``response.completed``), the text token by token. Errors are OpenAI's shape.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from relax_rollout.http_api import EventStream, Request
from relax_rollout.server import openai_routes
from relax_rollout.server.protocol import BadRequest, NotFound, objects
from relax_rollout.server.state import EngineServer


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(where, "must be a string or a list of content parts")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise BadRequest(f"{where}[{i}]", f"a {kind!r} part is not served here (input_text, output_text)")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _items(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise BadRequest("input", "must be a string or a list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("user", "assistant", "system"):
                raise BadRequest(f"input[{i}].role", "must be 'user', 'assistant', 'system' or 'developer'")
            out.append({"role": role, "content": _content(item.get("content", ""), f"input[{i}].content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))}
            )
        else:
            raise BadRequest(
                f"input[{i}].type",
                f"{kind!r} items are not served here (message, function_call, function_call_output)",
            )
    return out


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise BadRequest(f"tools[{i}].type", f"{kind!r} tools are not served here (function tools only)")
        fn = {
            "name": t.get("name"),
            "description": t.get("description", ""),
            "parameters": t.get("parameters") or {},
        }
        out.append({"type": "function", "function": fn})
    return out


def _object(value: Any, where: str) -> dict[str, Any]:
    """``value`` (the field ``where``) as an object, {} when absent, else a 400 naming it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(where, f"must be an object (got {type(value).__name__})")
    return value


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request a Responses request is, after ``history`` (a previous response's conversation)."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object (a Responses API request)")
    if "input" not in body:
        raise BadRequest("input", "is required")
    messages = list(history)
    if body.get("instructions"):  # (a new request's instructions replace the previous ones)
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": str(body["instructions"])})
    chat: dict[str, Any] = {
        "model": body.get("model", "default"),
        "messages": messages + _items(body["input"]),
    }
    for ours, theirs in (
        ("max_tokens", "max_output_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
    ):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    if body.get("tools"):
        chat["tools"] = _tools(objects(body["tools"], "tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = _object(_object(body.get("text"), "text").get("format"), "text.format")
    if fmt.get("type") == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema") or {}},
        }
    elif fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def from_chat(out: dict[str, Any], body: dict[str, Any], rid: str) -> dict[str, Any]:
    """A ``chat.completion`` as a ``response``."""
    choice = out["choices"][0]
    msg = choice["message"]
    items: list[dict[str, Any]] = []
    if msg.get("content"):
        text = {"type": "output_text", "text": msg["content"], "annotations": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [text],
            }
        )
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    cut = choice["finish_reason"] == "length"
    usage = out["usage"]
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": body.get("model", "default"),
        "output": items,
        "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "previous_response_id": body.get("previous_response_id"),
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        },
        **{k: out[k] for k in ("metadata", "prompt_token_ids") if k in out},  # (our extensions, as on chat)
    }


def responses(s: EngineServer, body: dict, req: Request) -> tuple[int, Any]:
    """``POST /v1/responses``; what is wrong with a request is answered in OpenAI's error shape."""
    try:
        return _respond(s, body, req)
    except (BadRequest, NotFound) as e:
        return _error(e.body())


def _error(b: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Our error body (SGLang's, flat) as OpenAI's: ``{"error": {"message", "type", "param", "code"}}``."""
    code = int(b.get("code") or 400)
    kind = "invalid_request_error" if code < 500 else "server_error"
    return code, {
        "error": {"message": b.get("message", ""), "type": kind, "param": b.get("param"), "code": None}
    }


def _respond(s: EngineServer, body: dict, req: Request) -> tuple[int, Any]:
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    if prev is not None and not isinstance(prev, str):
        raise BadRequest(
            "previous_response_id", f"must be a response's id, a string (got {type(prev).__name__})"
        )
    chat = to_chat(body, s.responses.get(prev) if prev else [])
    if body.get("stream"):
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    status, out = openai_routes.chat_completions(s, chat, req)
    if status != 200:
        return _error(out)
    rid = f"resp_{uuid.uuid4().hex}"

    def keep(message: dict[str, Any]) -> None:
        if body.get("store", True):
            s.responses.put(rid, chat["messages"] + [message])

    if isinstance(out, EventStream):
        return 200, EventStream(_events(out, body, rid, keep), out.on_close, named=True)
    keep(out["choices"][0]["message"])
    return 200, from_chat(out, body, rid)


class _Assembly:
    """The chat stream's pieces gathered into the chat answer they make (what ``from_chat`` reads)."""

    def __init__(self) -> None:
        self.text, self.finish = "", "stop"
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, int] = {"prompt_tokens": 0, "completion_tokens": 0}

    def add(self, call: dict[str, Any]) -> None:
        """A streamed piece of a tool call (its id and name first, its arguments in parts)."""
        blank = {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
        entry = self.calls.setdefault(call.get("index", 0), blank)
        entry["id"] = call.get("id") or entry["id"]
        fn = call.get("function") or {}
        entry["function"]["name"] = fn.get("name") or entry["function"]["name"]
        entry["function"]["arguments"] += fn.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        calls = [self.calls[k] for k in sorted(self.calls)]
        return {"role": "assistant", "content": self.text or None, **({"tool_calls": calls} if calls else {})}

    def chat(self) -> dict[str, Any]:
        return {"choices": [{"message": self.message(), "finish_reason": self.finish}], "usage": self.usage}


def _events(
    chunks: EventStream, body: dict[str, Any], rid: str, keep: Any
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The chat stream's chunks as the Responses stream's events, the text token by token; the whole
    response (``response.completed``) at the end, when it is also stored."""
    seq = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        return kind, {"type": kind, "sequence_number": next(seq), **fields}

    got, text_id = _Assembly(), f"msg_{uuid.uuid4().hex}"
    start = {**from_chat(got.chat(), body, rid), "status": "in_progress", "output": []}
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    where = {"item_id": text_id, "output_index": 0, "content_index": 0}
    for chunk in chunks.events:
        got.usage = chunk.get("usage") or got.usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            got.finish = choice.get("finish_reason") or got.finish
            if delta.get("content"):
                if not got.text:
                    item = {
                        "type": "message",
                        "id": text_id,
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [],
                    }
                    yield event("response.output_item.added", output_index=0, item=item)
                    part = {"type": "output_text", "text": "", "annotations": []}
                    yield event("response.content_part.added", **where, part=part)
                got.text += delta["content"]
                yield event("response.output_text.delta", **where, delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls") or []:
                got.add(call)
    keep(got.message())
    response = from_chat(got.chat(), body, rid)
    yield from _closing(event, response, text_id)


def _closing(event: Any, response: dict[str, Any], text_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The end of a streamed response: each output item done (a call's arguments, parsed from the whole
    reply, sent whole), then the response."""
    for i, item in enumerate(response["output"]):
        if item["type"] == "message":
            item["id"] = text_id
            text, where = item["content"][0], {"item_id": text_id, "output_index": i, "content_index": 0}
            yield event("response.output_text.done", **where, text=text["text"], logprobs=[])
            yield event("response.content_part.done", **where, part=text)
        else:
            added = {**item, "status": "in_progress", "arguments": ""}
            yield event("response.output_item.added", output_index=i, item=added)
            where = {"item_id": item["id"], "output_index": i}
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event(
                "response.function_call_arguments.done",
                **where,
                arguments=item["arguments"],
                name=item["name"],
            )
        yield event("response.output_item.done", output_index=i, item=item)
    done = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield event(done, response=response)
