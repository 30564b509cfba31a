"""The OpenAI routes' response bodies as typed models: ``chat.completion``, ``chat.completion.chunk`` and
``text_completion`` (whole and streamed), after OpenAI's shapes and SGLang 0.5.23's.

Why typed: a reply is what agents and the ``openai`` client parse; a field of the wrong type (a tool call's
``arguments`` as an object, a missing ``finish_reason``) must fail here, at the server, with the field
named, not in the client. The routes build their bodies as dicts and pass them through :func:`body`, which
validates them and gives back exactly the keys that were set (so ``None`` fields the client expects stay,
and no default is added). Extensions (SGLang's ``matched_stop`` and ``metadata``, ``token_ids``,
``prompt_token_ids``, ``weight_version``, ``relax_trajectory``) are kept as extra fields: our names, not
OpenAI's, so they are declared where they are typed and allowed through otherwise.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=True)
    """Extensions pass; log-probs may be ``-inf`` (a token the distribution gave no mass)."""


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCall(_Out):
    name: str
    arguments: str
    """The call's arguments as a JSON text (OpenAI's type: a string, not an object)."""


class ToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int
    """Which call of the message this is (OpenAI's chunks carry it)."""


class ChatMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    """None when the reply is tool calls only."""
    reasoning_content: str | None = None
    """The thinking of a template that has it (SGLang's and DeepSeek's name)."""
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Out):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None
    matched_stop: str | int | None = None
    """SGLang's: the stop string or token that ended the choice."""
    token_ids: list[int] = []
    """The exact sampled tokens (vLLM's name)."""


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = None
    matched_stop: str | int | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    """Only in the last chunk, with ``stream_options.include_usage`` (and then ``choices`` is empty)."""


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None
    matched_stop: str | int | None = None
    token_ids: list[int] = []


class Completion(_Out):
    """A ``text_completion``: the whole reply, or one chunk of its stream (the same object name)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


RESPONSES: dict[str, type[_Out]] = {
    "chat.completion": ChatCompletion,
    "chat.completion.chunk": ChatCompletionChunk,
    "text_completion": Completion,
}
"""The model of each ``object`` name the routes answer with."""


class ResponseShapeError(RuntimeError):
    """A response body the server built does not have OpenAI's shape: a bug of the server, named by field."""


def body(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a response body or stream chunk, by its ``object``) validated as its typed model and dumped
    with exactly the keys it set."""
    model = RESPONSES[data["object"]]
    try:
        return model.model_validate(data).model_dump(exclude_unset=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ResponseShapeError(f"{data['object']} response: {where}: {err['msg']}") from None
