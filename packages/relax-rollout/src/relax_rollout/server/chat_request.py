"""The OpenAI chat request as the chat route uses it: the body validated as typed models
(:mod:`relax_rollout.server.chat_types`), its messages rendered for the chat template
(:mod:`relax_rollout.server.tool_calls`), its sampling fields under SGLang's names (:mod:`protocol`).

Why a module of its own: it joins those three, which must not import one another in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relax_rollout.server import protocol
from relax_rollout.server.chat_types import content_text, validate_chat
from relax_rollout.server.protocol import BadRequest, ImagePart
from relax_rollout.server.tool_calls import template_message


@dataclass
class ChatRequest:
    messages: list[dict]
    """With string contents (text parts joined, :data:`IMAGE_MARK` for each image part)."""
    sampling: dict
    """SGLang sampling dict."""
    logprobs: bool = False
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    """``stream_options.include_usage``: a last chunk with the usage and no choices."""
    top_logprobs: int = 0
    """With ``logprobs``: per token this many most likely alternatives."""
    images: list[ImagePart] = field(default_factory=list)
    """The ``image_url`` parts, in message order (the server refuses them for a text-only model)."""
    request: Any = None
    """The validated body (``chat_types.ChatCompletionRequest``): tools, tool_choice, response_format,
    chat_template_kwargs."""


def parse_chat(body: Any) -> ChatRequest:
    """OpenAI ``ChatCompletionRequest`` → :class:`ChatRequest`: the body checked as typed models
    (:mod:`relax_rollout.server.chat_types`; a 400 names the first bad field), its messages as the chat
    template takes them (:func:`relax_rollout.server.tool_calls.template_message`)."""
    req = validate_chat(body)
    out_messages: list[dict[str, Any]] = []
    images: list[ImagePart] = []
    for i, m in enumerate(req.messages):
        message = template_message(m.model_dump(by_alias=True, exclude_unset=True))
        if isinstance(message["content"], list):
            message["content"] = content_text(message["content"], f"messages[{i}].content", images)
        out_messages.append(message)
    sp: dict[str, Any] = {}
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None:
        sp["max_new_tokens"] = max_tokens
    sp |= protocol.openai_sampling(body, protocol.OPENAI_SAMPLING + protocol.NEUTRAL_ONLY)
    try:
        protocol.parse_sampling(sp, "body")
    except BadRequest as e:  # name the OpenAI field, not our internal one
        names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
        leaf = e.field.split(".")[-1]
        raise BadRequest(names.get(leaf, leaf), str(e).split(": ", 1)[1]) from None
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return ChatRequest(
        out_messages,
        sp,
        bool(req.logprobs),
        req.n or 1,
        bool(req.stream),
        usage,
        req.top_logprobs or 0,
        images,
        req,
    )
