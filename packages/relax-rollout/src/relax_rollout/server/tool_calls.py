"""Tool calls and structured output of the chat route: what the template is given, what the engine is held
to, and what the reply is parsed into.

Why transformers' response templates: each model family writes its calls its own way (Qwen2/3's Hermes
``<tool_call>{json}</tool_call>``, Qwen3.5's XML, Gemma 4's ...), and a hand-written grammar drifts from
the model's own format. transformers keeps a declarative *response template* per family
(``tokenizer.response_template``, else a fallback per ``config.model_type`` in
``transformers.cli.serving.utils``) and parses with it (``parse_response``); we use exactly that, and only
fall back to the Hermes format (our demo template's) when neither knows the model.

Where a call is required (``tool_choice`` ``required`` or named) or the reply must be JSON
(``response_format``), the engine decodes under a :class:`~relax_rollout.engines.base.Constraint`, and the
reply is parsed the same way as an unconstrained one. Parsing never fails a request: a reply whose calls do
not parse (cut by ``max_tokens``, broken JSON, an unknown tool) is returned as plain text.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from relax_rollout.engines.base import Constraint, GenerateOutput, RolloutEngine

if TYPE_CHECKING:
    from relax_rollout.server.chat_types import ChatCompletionRequest

logger = logging.getLogger(__name__)

HERMES_MODEL_TYPE = "qwen3"
"""The family whose response template is the fallback: the Hermes format our demo template writes."""
HERMES_OPEN, HERMES_CLOSE = "<tool_call>\n", "\n</tool_call>"
"""What the Hermes format writes around each call's ``{"name": ..., "arguments": ...}``."""
PREFIX_TOKENS = 256
"""How much of the prompt's end the parser sees (it only needs the start of the assistant turn)."""


# -- what the template gets ----------------------------------------------------------------------------------
def offered_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools shown to the model: all of them unless ``tool_choice`` is ``none`` (then none are)."""
    if not req.tools or req.effective_tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """The extra arguments of ``apply_chat_template``: ``chat_template_kwargs`` and the offered ``tools``."""
    kwargs = dict(req.chat_template_kwargs or {})
    tools = offered_tools(req)
    if tools:
        kwargs["tools"] = tools
    return kwargs


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A validated message (dumped) as chat templates take it: no null fields (``content: null`` becomes
    ``""``), each tool call's ``arguments`` an object where the JSON string is one (HF templates render
    ``arguments | tojson``)."""
    out = {k: v for k, v in message.items() if v is not None}
    if message.get("content") is None:
        out["content"] = ""
    if message.get("tool_calls"):
        out["tool_calls"] = [_template_call(c) for c in message["tool_calls"]]
    elif "tool_calls" in out:
        del out["tool_calls"]
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call["function"])
    args = fn.setdefault("arguments", {})  # (unset: its declared default, "{}"; templates read it: a 500)
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return {"type": "function", **{k: v for k, v in call.items() if v is not None}, "function": fn}


# -- the model family's format -------------------------------------------------------------------------------
def response_template(tokenizer: Any, engine: RolloutEngine, model_path: str | None) -> dict:
    """The response template of the served model: the tokenizer's own, else transformers' for its model type
    (from the engine's model config, else the checkpoint's ``config.json``), else the Hermes one."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    config = getattr(getattr(engine, "model", None), "config", None)
    model_type = getattr(config, "model_type", None) or _model_type(model_path)
    found = _family_template(tokenizer, model_type) if model_type else None
    if found is None:
        found = _family_template(tokenizer, HERMES_MODEL_TYPE)
        assert found is not None, "transformers has the Hermes response template"
    return found


def _family_template(tokenizer: Any, model_type: str) -> dict | None:
    """transformers' response template for ``model_type`` (None: it has none)."""
    from transformers.cli.serving.utils import get_response_template

    # transformers types the model PreTrainedModel but reads only its config.model_type (what _Typed has)
    return get_response_template(tokenizer, _Typed(model_type))  # type: ignore[arg-type]


class _Typed:
    """What ``get_response_template`` reads of a model: ``config.model_type``."""

    def __init__(self, model_type: str):
        self.config = type("Config", (), {"model_type": model_type})()


@functools.lru_cache(maxsize=16)
def _model_type(model_path: str | None) -> str | None:
    if not model_path:
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path).model_type
    except Exception:  # (an external engine's server may serve a path this machine does not have)
        return None


def call_delimiters(template: dict) -> tuple[str, str] | None:
    """(open, close): what the model writes around each call's JSON ``{"name", "arguments"}``, for
    constrained decoding. None for a family whose calls are not such JSON (Qwen3.5's XML, Gemma 4)."""
    field = (template.get("fields") or {}).get("tool_calls")
    if not field or field.get("content") != "json":
        return None
    if (field.get("transform") or {}).get("function") != "{content}":  # (the name is outside the JSON)
        return None
    if field.get("open_pattern") == r"\s*<tool_call>" and field.get("close") == "</tool_call>":
        return HERMES_OPEN, HERMES_CLOSE
    if isinstance(field.get("open"), str) and isinstance(field.get("close"), str):
        return field["open"], field["close"]
    return None


# -- the constraint the engine decodes under -----------------------------------------------------------------
def constraint(req: ChatCompletionRequest, template: dict) -> tuple[Constraint | None, str]:
    """The constraint ``req`` asks for and the request field that asked (for the 400 of an engine without
    constrained decoding): a forced tool call (``tool_choice``) or JSON (``response_format``)."""
    from relax_rollout.server.chat_types import NamedToolChoice
    from relax_rollout.server.protocol import BadRequest

    choice = req.effective_tool_choice
    if choice == "required" or isinstance(choice, NamedToolChoice):
        delimiters = call_delimiters(template)
        if delimiters is None:
            raise BadRequest(
                "tool_choice",
                "forcing a call needs this model's tool-call format as JSON between markers (Hermes "
                "style); this model writes its calls otherwise: use tool_choice 'auto'",
            )
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or []]
        spec = json.dumps(tools)
        return Constraint(
            "tool_calls", spec, delimiters[0], delimiters[1], required_name=named
        ), "tool_choice"
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None, ""
    if fmt.type == "json_object":
        return Constraint("json_schema", json.dumps({"type": "object"})), "response_format"
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else {}
    return Constraint("json_schema", json.dumps(schema or {})), "response_format"


# -- the reply -----------------------------------------------------------------------------------------------
def reply(
    tokenizer: Any,
    out: GenerateOutput,
    text: str,
    prompt: list[int],
    req: ChatCompletionRequest,
    template: dict,
    end_ids: set[int],
) -> tuple[dict[str, Any], str]:
    """The choice's ``message`` and ``finish_reason``. ``text``: the reply as the server shows it (stop
    string cut, special tokens skipped); ``end_ids``: the tokens that end a reply (EOS, ``stop_token_ids``).

    With tools offered the calls are parsed: ``tool_calls``, ``content`` None when there is no text, and
    ``finish_reason`` "tool_calls" (a reply cut by ``max_tokens`` keeps "length" and the calls completed
    before the cut, as SGLang's parsers do). The thinking of a template that has it becomes
    ``reasoning_content``. Otherwise, and whenever parsing finds nothing, ``content`` is ``text``."""
    plain = {"role": "assistant", "content": text}
    tools_on = offered_tools(req) is not None and not _json_constrained(req)
    fields = template.get("fields") or {}
    thinking = fields.get("thinking") or {}
    raw = _raw_text(tokenizer, out, end_ids)
    if not tools_on and not (isinstance(thinking.get("close"), str) and thinking["close"] in raw):
        return plain, out.finish_reason
    schema = (
        template
        if tools_on
        else {**template, "fields": {k: v for k, v in fields.items() if k != "tool_calls"}}
    )
    parsed = _parse(tokenizer, raw, schema, _prefix(tokenizer, prompt, schema), req if tools_on else None)
    if parsed is None and tools_on and out.finish_reason == "length":
        close = (fields.get("tool_calls") or {}).get("close")
        if isinstance(close, str) and (end := raw.rfind(close)) >= 0:  # the calls completed before the cut
            parsed = _parse(
                tokenizer, raw[: end + len(close)], schema, _prefix(tokenizer, prompt, schema), req
            )
    calls = _calls(parsed.get("tool_calls") or [], req) if parsed is not None and tools_on else []
    if parsed is None or calls is None:
        return plain, out.finish_reason
    if req.parallel_tool_calls is False:
        calls = calls[:1]
    reasoning = parsed.get("thinking")
    if not calls and not reasoning:
        return plain, out.finish_reason
    content = parsed.get("content")
    message: dict[str, Any] = {"role": "assistant", "content": content or ("" if not calls else None)}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message, "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason


def _parse(
    tokenizer: Any, raw: str, schema: dict, prefix: str, req: ChatCompletionRequest | None
) -> dict | None:
    """``raw`` parsed with the response template (``req``: cast the calls' arguments by its tools' schemas);
    None where it does not parse (broken JSON, a call cut short)."""
    try:
        return tokenizer.parse_response(raw, schema, prefix=prefix, tools=offered_tools(req) if req else None)
    except Exception as e:
        logger.debug("reply not parsed (%s): returned as text", e)
        return None


def _json_constrained(req: ChatCompletionRequest) -> bool:
    fmt = req.response_format
    return fmt is not None and fmt.type != "text" and req.effective_tool_choice == "auto"


def _calls(parsed: list[Any], req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` of the parsed calls; None if one does not name an offered tool."""
    names = {t.function.name for t in req.tools or []}
    calls = []
    for item in parsed:
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(fn, dict) or fn.get("name") not in names:
            logger.debug("reply calls %r, not an offered tool: returned as text", fn)
            return None
        args = fn.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return calls


def _raw_text(tokenizer: Any, out: GenerateOutput, end_ids: set[int]) -> str:
    """The reply with its special tokens (call markers may be special tokens), cut as the shown text is:
    before a matched stop string, without the end token that ended it."""
    ids = list(out.token_ids)
    if out.finish_reason == "stop" and out.matched_stop is None and ids and ids[-1] in end_ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if out.finish_reason == "stop" and out.matched_stop is not None:
        at = text.find(out.matched_stop)
        text = text[:at] if at >= 0 else text
    return text


def _prefix(tokenizer: Any, prompt: list[int], template: dict) -> str:
    """The end of the prompt, for templates that pre-write part of the reply (an opened ``<think>``); ""
    when it lacks the template's start anchor (else the parser would read the whole prompt as reply)."""
    from transformers.utils.chat_parsing.response_templates import load_response_template

    text = tokenizer.decode(prompt[-PREFIX_TOKENS:], skip_special_tokens=False)
    anchor = load_response_template(template).start_anchor_re
    if anchor is None or anchor.search(text) is None:
        return ""
    return text
