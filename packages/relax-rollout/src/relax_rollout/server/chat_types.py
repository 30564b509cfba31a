"""The body of ``POST /v1/chat/completions`` as typed models: what OpenAI's chat API takes, tool calls and
structured output included, plus the SGLang extras this server honours.

Why models and not hand-parsed dicts: a tool agent's conversation has several message shapes (an assistant
turn with ``tool_calls`` and ``content: null``, ``tool`` messages with their ``tool_call_id``) and the
request has nested options (``tools``, ``tool_choice``, ``response_format``); checking each by hand had
drifted (an assistant message without content was a 400, ``tools`` were ignored without a word). Here one
``model_validate`` checks the whole body and :func:`validate_chat` turns the first problem into the server's
400 (:class:`~relax_rollout.server.protocol.BadRequest`) naming the field path, e.g.
``messages[2].tool_calls[0].function.name`` or ``tool_choice``.

Fields that only select sampling (``temperature``, ``max_tokens``, ...) are typed here and checked again,
with their cross-field rules, by ``protocol.parse_sampling``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from relax_rollout.server.protocol import (
    IMAGE_MARK,
    MAX_N,
    MAX_STOP_OPENAI,
    MAX_TOP_LOGPROBS,
    BadRequest,
    ImagePart,
)

StrictInt = Annotated[int, Field(strict=True)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A JSON number (an integer passes; a string or a boolean does not)."""


class _Model(BaseModel):
    """Unknown keys are kept (clients send more than we read; the chat template may read them)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# -- messages ------------------------------------------------------------------------------------------------
class ContentPart(_Model):
    """One part of a message's content list; :func:`content_text` reads ``text`` and ``image_url`` parts and
    refuses the other kinds by name."""

    type: str | None = None
    """``"text"``, ``"image_url"`` (a multimodal model), or a kind this server refuses (``input_audio``...);
    :func:`content_text` names a part without one."""


Content = str | list[ContentPart]


def content_text(content: list[dict[str, Any]], where: str, images: list[ImagePart]) -> str:
    """A list of content parts (dumped :class:`ContentPart`) as the message's text: text parts joined, each
    ``image_url`` part appended to ``images`` and marked with :data:`~relax_rollout.server.protocol.IMAGE_MARK`,
    other media parts refused by name (``where[j]``)."""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            images.append(ImagePart(f"{where}[{j}]", _image_url(part, f"{where}[{j}]")))
            texts.append(IMAGE_MARK)
        elif kind in ("input_audio", "video_url", "file"):
            raise BadRequest(
                f"{where}[{j}]",
                f"'{kind}' parts are not supported: this server takes 'text' "
                "parts and, for a multimodal model, 'image_url' parts",
            )
        else:
            raise BadRequest(f"{where}[{j}]", "must be a content part like {'type': 'text', 'text': ...}")
    return "".join(texts)


def _image_url(part: dict, where: str) -> str:
    """OpenAI's ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` (``detail`` is
    ignored: the image is sized by the model's own budget)."""
    v = part.get("image_url")
    url = v.get("url") if isinstance(v, dict) else v
    if not isinstance(url, str) or not url:
        raise BadRequest(f"{where}.image_url", "must be an object like {'url': 'data:image/png;base64,...'}")
    return url


class FunctionCall(_Model):
    """The function an assistant's tool call names."""

    name: str = Field(min_length=1)
    """The tool's name."""
    arguments: str | dict[str, Any] = "{}"
    """Its arguments: OpenAI's JSON-object string (an object is accepted too, as HF templates take it)."""


class ToolCall(_Model):
    """One tool call of an assistant message, as OpenAI returns it and agents send it back."""

    id: str | None = None
    """The call's id (the ``tool`` message answering it names it in ``tool_call_id``)."""
    type: Literal["function"] = "function"
    """Always ``"function"``."""
    function: FunctionCall
    """What is called."""


class SystemMessage(_Model):
    role: Literal["system", "developer"]
    """``developer`` is OpenAI's newer name for ``system``; the template gets it as written."""
    content: Content
    """The instructions."""


class UserMessage(_Model):
    role: Literal["user"]
    content: Content
    """Text, or text and image parts."""


class AssistantMessage(_Model):
    role: Literal["assistant"]
    content: Content | None = None
    """The reply's text; null (or absent) in a turn that only calls tools."""
    tool_calls: list[ToolCall] | None = None
    """The tools this turn called (what this server returned as ``message.tool_calls``)."""
    reasoning_content: str | None = None
    """The turn's thinking, as this server returned it (kept for templates that render it)."""

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        return self


class ToolMessage(_Model):
    role: Literal["tool"]
    content: Content
    """The tool's result."""
    tool_call_id: str | None = None
    """Which call of the assistant turn before it this answers (OpenAI requires it; older agents omit it)."""


def _role(v: Any) -> str | None:
    role = v.get("role") if isinstance(v, dict) else getattr(v, "role", None)
    return {"developer": "system"}.get(role, role) if isinstance(role, str) else None


Message = Annotated[
    Annotated[SystemMessage, Tag("system")]
    | Annotated[UserMessage, Tag("user")]
    | Annotated[AssistantMessage, Tag("assistant")]
    | Annotated[ToolMessage, Tag("tool")],
    Discriminator(
        _role,
        custom_error_type="invalid_role",
        custom_error_message="must have a 'role' of system, developer, user, assistant or tool",
    ),
]
"""A chat message, chosen by its ``role``."""


# -- tools and output formats ------------------------------------------------------------------------------
class FunctionDef(_Model):
    """An OpenAI function tool's definition: what the chat template shows the model."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    """The name the model calls it by (OpenAI's rule: letters, digits, ``_``, ``-``, ``.``; at most 64)."""
    description: str | None = None
    """What it does."""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    """A JSON schema of its arguments (an object schema)."""
    strict: bool | None = None
    """OpenAI's strict mode; arguments are held to ``parameters`` by constrained decoding either way when
    ``tool_choice`` requires a call."""


class Tool(_Model):
    type: Literal["function"]
    """Only function tools exist in OpenAI's chat API."""
    function: FunctionDef
    """The function."""


class NamedFunction(_Model):
    name: str
    """The tool that must be called."""


class NamedToolChoice(_Model):
    type: Literal["function"]
    """Always ``"function"``."""
    function: NamedFunction
    """Which one."""


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(_Model):
    name: str = "response"
    """The schema's name (informative)."""
    description: str | None = None
    """What the output is (informative)."""
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    """The JSON schema the reply must match (empty: any JSON value)."""
    strict: bool | None = None
    """OpenAI's strict mode: the reply matches the schema whatever its value (constrained decoding)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema`` (``json_schema``)."""
    json_schema: JsonSchemaFormat | None = None
    """With ``json_schema``: the schema."""

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                "type 'json_schema' needs a 'json_schema' object: {'name': ..., 'schema': {...}}"
            )
        return self


class StreamOptions(_Model):
    include_usage: bool | None = None
    """A last chunk with the usage and no choices."""


# -- the request --------------------------------------------------------------------------------------------
class ChatCompletionRequest(_Model):
    """OpenAI's ``ChatCompletionRequest`` as this server takes it (unknown keys pass, unread)."""

    messages: list[Message] = Field(min_length=1)
    """The conversation."""
    model: str | None = None
    """Any name: this server serves one model."""
    max_tokens: StrictInt | None = Field(None, ge=1)
    """The most tokens to generate (default: SGLang's 128, cut to the context)."""
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    """OpenAI's newer name of ``max_tokens`` (wins when both are given)."""
    temperature: Number | None = Field(None, ge=0)
    """Sampling temperature; below 1e-6 samples greedily."""
    top_p: Number | None = None
    """Nucleus sampling, in (0, 1]."""
    n: StrictInt | None = Field(None, ge=1, le=MAX_N)
    """Choices to sample."""
    seed: StrictInt | None = None
    """Sampling seed (choice i samples with seed + i)."""
    stop: str | list[str] | None = None
    """Up to 4 stop strings: the text is cut before one (the tokens keep it)."""
    stream: bool | None = None
    """Answer in server-sent events."""
    stream_options: StreamOptions | None = None
    """``include_usage``."""
    logprobs: bool | None = None
    """Return the sampled tokens' log-probs."""
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """With ``logprobs``: per token this many most likely alternatives."""
    presence_penalty: Number | None = None
    """Not implemented: only 0 passes."""
    frequency_penalty: Number | None = None
    """Not implemented: only 0 passes."""
    user: str | None = None
    """Names an agent session (see ``trajectories``) unless the ``X-Relax-Session`` header does."""
    tools: list[Tool] | None = None
    """Function tools the model may call (rendered by the chat template)."""
    tool_choice: ToolChoice | None = None
    """``none`` (tools not offered, nothing parsed), ``auto`` (the default with tools: calls are parsed from
    the reply), ``required`` or a named function (a call is forced by constrained decoding)."""
    parallel_tool_calls: bool | None = None
    """False: at most one call is returned (the first)."""
    response_format: ResponseFormat | None = None
    """``json_object`` / ``json_schema``: the reply is constrained to JSON (matching the schema)."""
    logit_bias: dict[str, Number] | None = None
    """Not implemented: refused unless empty."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. Qwen3's ``enable_thinking``), as SGLang and vLLM take."""
    # SGLang's sampling extras (``ChatCompletionRequest`` of sglang.srt.entrypoints.openai.protocol)
    min_tokens: StrictInt | None = None
    """Generate at least this many tokens."""
    stop_token_ids: list[StrictInt] | None = None
    """Token ids that end the reply."""
    top_k: Any = None
    """Not implemented: only its neutral values (-1, 0) pass."""
    min_p: Any = None
    """Not implemented: only 0 passes."""
    repetition_penalty: Any = None
    """Not implemented: only 1 passes."""

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_OPENAI:
            raise _FieldError("stop", f"takes at most {MAX_STOP_OPENAI} stop strings (got {len(self.stop)})")
        if self.top_logprobs and not self.logprobs:
            raise _FieldError("top_logprobs", "needs logprobs: true (as in OpenAI)")
        if self.logit_bias:
            raise _FieldError(
                "logit_bias",
                "is not supported by this server (its engines sample without a per-token bias); leave it "
                "out, or use response_format / tool_choice to constrain the reply",
            )
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise _FieldError("tools", f"tool names must be unique (got {names})")
        choice = self.tool_choice
        if choice == "required" and not names:
            raise _FieldError("tool_choice", "'required' needs 'tools' to choose from")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _FieldError(
                "tool_choice.function.name", f"{choice.function.name!r} is not one of the tools {names}"
            )
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise _FieldError(
                "response_format",
                "cannot be combined with a tool_choice that forces a call: give one or the other",
            )
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with OpenAI's default: ``auto`` when tools are given, else ``none``."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class _FieldError(ValueError):
    """A cross-field rule broken: ``field`` is the path to name in the 400."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


def validate_chat(body: Any) -> ChatCompletionRequest:
    """``body`` as a :class:`ChatCompletionRequest`, or a :class:`BadRequest` naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _bad_request(e) from None


def _bad_request(e: ValidationError) -> BadRequest:
    errors = e.errors(include_url=False)
    for err in errors:  # a cross-field rule names its own field
        ctx = err.get("ctx") or {}
        if isinstance(ctx.get("error"), _FieldError):
            return BadRequest(ctx["error"].field, ctx["error"].message)
    first = errors[0]
    path = _path(first["loc"])
    if first["type"] == "missing":  # named by the object that lacks it, as the server always did
        parent, _, leaf = path.rpartition(".")
        return BadRequest(parent, f"needs '{leaf}'") if parent else BadRequest(leaf, "is required")
    # a union's members fail one by one at the same place: say what any of them would take
    same = [err["msg"] for err in errors if _path(err["loc"]) == path]
    message = " or ".join(dict.fromkeys(_message(m) for m in same))
    if first["type"] == "invalid_role":
        got = first["input"].get("role") if isinstance(first["input"], dict) else first["input"]
        message = f"{message} (got {_short(got)})"
    return BadRequest(path, message)


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "system", "user", "assistant", "tool"}


def _path(loc: tuple[Any, ...]) -> str:
    """pydantic's ``loc`` as the field path the server names: ``messages[2].tool_calls[0].function``
    (a union's member labels — ``str``, ``list[ContentPart]``, a role tag, a model's class name — dropped)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if not part.isidentifier() or not part.islower() or (part in _TYPE_NAMES and i > 0):
            continue
        out += f".{part}" if out else part
    return out


def _message(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def _short(v: Any) -> str:
    text = json.dumps(v, default=str) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
