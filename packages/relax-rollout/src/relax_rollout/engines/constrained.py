"""Constrained decoding for the torch engine (``SamplingParams.constraint``), on llguidance.

Why llguidance and not a grammar engine of our own: JSON schema, regex and Lark grammars compiled against
the real tokenizer are a project of their own (token healing, multi-byte tokens, special tokens); llguidance
is a small Rust wheel without dependencies that computes the allowed-token mask of a byte-level BPE
vocabulary in tens of microseconds, and is what SGLang ships for its ``llguidance`` grammar backend.

How it runs: every constrained sequence has its own matcher (:class:`GuidedRow`). Before a token is sampled
:meth:`Guide.mask_logits` sets the logits of the tokens that cannot continue a match to ``-inf`` — so the
log-probs the engine returns are those of the masked distribution it sampled from, token-exactly what an
RL trainer must get — and after it :meth:`GuidedRow.advance` feeds the token to the matcher. End tokens
(EOS, the request's stop ids) are allowed only where the match is complete; once the grammar can take
nothing more, the next step's distribution is the first EOS alone (probability 1, log-prob 0), sampled
through one more forward as SGLang does, so routing replay and the KV cache see a normal final step.
Requests without a constraint pay nothing: their rows are skipped.

JSON is generated without free whitespace (``, `` and ``: `` separators, as ``json.dumps`` writes): with
flexible whitespace a weak model can emit blank lines forever. A schema's own ``"x-guidance"`` options
override this.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

import torch

from relax_rollout.engines.base import Constraint

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options by default (a schema's ``"x-guidance"`` overrides them)."""
TOOL_CALL_SEPARATOR = "\n"
"""Between two tool calls of one response (SGLang's ``tool_call_separator`` of the Qwen/Hermes format)."""
_CACHED = 64  # compiled grammars kept per engine (an agent run reuses a handful of tool sets)
_PARALLEL_FROM = 1 << 20
"""Rows × vocabulary from which the masks are computed on llguidance's thread pool: below it (the demo's
batches, a few rows of a 150k vocabulary) waking the pool's threads costs more than it saves."""


def _import_llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:  # pragma: no cover - a dependency of relax-rollout
        raise ImportError(
            "constrained decoding needs llguidance: pip install 'llguidance>=1.9.1' (a dependency of relax-rollout)"
        ) from e
    return llguidance


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"Constraint.spec: {what} is not valid JSON ({e})") from e


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)


def strict_schema(schema: Any) -> Any:
    """``schema`` as SGLang's grammar backend reads it (xgrammar's strict mode, SGLang 0.5.23's default): an
    object that declares ``properties`` takes no other key unless it says so (``additionalProperties``), a
    ``prefixItems`` array no item past them unless it says so (``items``). Why: JSON Schema allows undeclared
    keys by default, and a tool's parameters rarely forbid them (LangChain's ``@tool``, pydantic's default):
    decoded so, forced tool calls wandered into made-up keys until ``max_tokens`` (6 of 10 came back as cut
    text without ``tool_calls``), where SGLang's stop at the declared ones."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(v) for v in out[key]]
    for key in _SCHEMA_ONES:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    return out


def call_schema(c: Constraint) -> dict:
    """The JSON schema of one call of a "tool_calls" constraint: ``{"name": <a tool's>, "arguments": <that
    tool's parameters>}`` (an empty object where a tool has no ``parameters``, as OpenAI reads a missing
    one), over the tools ``c.spec`` lists or ``c.required_name`` alone."""
    tools = _json(c.spec, "the tool list")
    if not isinstance(tools, list) or not tools:
        raise ValueError("Constraint.spec: a 'tool_calls' constraint needs a non-empty JSON list of tools")
    calls: dict[str, dict] = {}
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"Constraint.spec[{i}]: a tool must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        params = fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        params = strict_schema(_hoist_definitions(params, fn["name"], defs))
        calls[fn["name"]] = {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
    if c.required_name is not None:
        if c.required_name not in calls:
            raise ValueError(
                f"Constraint.required_name: {c.required_name!r} is not among the tools {sorted(calls)}"
            )
        calls = {c.required_name: calls[c.required_name]}
    return {"anyOf": list(calls.values()), **({"$defs": defs} if defs else {})}


def _hoist_definitions(params: Any, tool: str, defs: dict[str, Any]) -> Any:
    """``params`` (a tool's JSON schema) with its ``$defs`` / ``definitions`` moved into ``defs`` under
    ``<tool>.<name>`` and its ``$ref``s to them rewritten: a ``$ref`` is a pointer from the document's root,
    and nested under the call's schema ``#/$defs/X`` pointed at nothing (what pydantic generates for nested
    models: ``tool_choice`` refused it with "Pointer does not exist" while ``response_format`` took it)."""
    if not isinstance(params, dict):
        return params
    local = {**params.get("definitions", {}), **params.get("$defs", {})}
    if not local:
        return params
    key = {k: f"{tool}.{k}" for k in local}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            for prefix in ("#/$defs/", "#/definitions/"):
                if isinstance(ref, str) and ref.startswith(prefix) and ref[len(prefix) :] in key:
                    pointer = key[ref[len(prefix) :]].replace("~", "~0").replace("/", "~1")  # (JSON pointer)
                    out["$ref"] = "#/$defs/" + pointer
            return out
        return [rewrite(v) for v in node] if isinstance(node, list) else node

    for k, schema in local.items():
        defs[key[k]] = strict_schema(rewrite(schema))
    return rewrite(params)


def _lark_text(text: str, specials: dict[str, int]) -> list[str]:
    """``text`` as Lark items: the tokens in it that llguidance matches only as tokens (:attr:`Guide.specials`:
    special tokens, and added ``<...>`` tags such as Qwen's ``<tool_call>``) as ``<[id]>``, the rest as
    string literals (which never match such a token: the tag would be spelt out in plain tokens)."""
    found = [s for s in specials if s in text]
    if not found:
        return [json.dumps(text)] if text else []
    parts = re.split("(" + "|".join(re.escape(s) for s in sorted(found, key=len, reverse=True)) + ")", text)
    return [f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in parts if p]


def tool_calls_lark(c: Constraint, specials: dict[str, int] | None = None) -> str:
    """The Lark grammar of a "tool_calls" constraint: one or more ``open + <call JSON> + close``, separated by
    :data:`TOOL_CALL_SEPARATOR` (the call JSON: :func:`call_schema`); ``specials``: :attr:`Guide.specials`,
    matched as those tokens where ``open`` / ``close`` hold them."""
    schema = {**call_schema(c), "x-guidance": JSON_OPTIONS}
    specials = specials or {}
    parts = [*_lark_text(c.open, specials), f"%json {json.dumps(schema)}", *_lark_text(c.close, specials)]
    return f"start: call ({json.dumps(TOOL_CALL_SEPARATOR)} call)*\ncall: {' '.join(parts)}\n"


def grammar_of(c: Constraint, specials: dict[str, int] | None = None) -> str:
    """``c`` as an llguidance grammar (a ValueError naming the field when its spec is malformed);
    ``specials``: the tokenizer's special tokens by text (see :func:`tool_calls_lark`)."""
    LLMatcher = _import_llguidance().LLMatcher  # noqa: N806 - the class
    if c.kind == "json_schema":
        schema = _json(c.spec, "the JSON schema")
        if not isinstance(schema, (dict, bool)):
            raise ValueError(
                f"Constraint.spec: a JSON schema must be an object (got {type(schema).__name__})"
            )
        return LLMatcher.grammar_from_json_schema(json.dumps(strict_schema(schema)), defaults=JSON_OPTIONS)
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.spec)
    return LLMatcher.grammar_from_lark(tool_calls_lark(c, specials))


def sglang_constraint(c: Constraint) -> dict[str, str]:
    """``c`` as SGLang's ``/generate`` sampling params (0.5.2x, xgrammar): ``json_schema`` or ``regex`` as given,
    and "tool_calls" as a ``structural_tag`` of the ``tags_with_separator`` format — one or more tags, no
    other text — each tag ``open + <call JSON> + close``, so SGLang accepts what the torch engine does (its
    JSON whitespace is SGLang's: flexible unless launched with ``--constrained-json-disable-any-whitespace``)."""
    if c.kind in ("json_schema", "regex"):
        return {c.kind: c.spec}
    tag = {
        "type": "tag",
        "begin": c.open,
        "content": {"type": "json_schema", "json_schema": call_schema(c)},
        "end": c.close,
    }
    fmt = {
        "type": "tags_with_separator",
        "tags": [tag],
        "separator": TOOL_CALL_SEPARATOR,
        "at_least_one": True,
        "stop_after_first": False,
    }
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}


def check_constraint(c: Constraint) -> None:
    """Raise a ValueError saying what is wrong when ``c`` cannot be compiled (an invalid regex, schema or
    tool list); servers call it to answer 400 before any engine sees the request."""
    grammar = grammar_of(c)  # (first: it says how to install llguidance when it is missing)
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"Constraint.spec: the {c.kind} does not compile: {' '.join(error.split())}")


class Guide:
    """One engine's tokenizer as llguidance sees it (built once, ~10 ms for a small vocabulary, ~1 s for
    a 150k one) and its compiled grammars; :meth:`row` starts a matcher for one sequence."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        llg = _import_llguidance()
        if not eos_token_ids:
            raise ValueError(
                "constrained decoding needs an EOS token id: build the engine with eos_token_ids"
            )
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the model's output only {vocab_size}: "
                "constrained decoding needs the model's vocabulary to cover the tokenizer's"
            )
        self.tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size, self.eos = vocab_size, list(eos_token_ids)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.specials = {
            t.content: i for i, t in added.items() if i < vocab_size and self.tokenizer.is_special_token(i)
        }
        """The tokens llguidance matches only as tokens (``<[id]>``), by text: the special ones, and added
        tokens shaped ``<...>`` even where the tokenizer says ``special: false`` (Qwen's ``<tool_call>``)."""
        self._unflagged = [i for i, t in added.items() if i in self.specials.values() and not t.special]
        """Of those, the ones the tokenizer calls plain: llguidance's mask may offer one where a literal
        forces its text, then refuses it (:meth:`mask_logits` drops it unless the matcher takes it)."""
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._templates: OrderedDict[Constraint, Any] = OrderedDict()
        self._executor = llg.LLExecutor()

    def row(self, c: Constraint, stop_token_ids: tuple[int, ...] = ()) -> GuidedRow:
        """A fresh matcher for one sequence under ``c`` (compiled once per distinct constraint)."""
        from llguidance import LLMatcher

        template = self._templates.get(c)
        if template is None:
            template = LLMatcher(self.tokenizer, grammar_of(c, self.specials), log_level=0)
            if template.is_error():
                error = " ".join(template.get_error().split())
                raise ValueError(f"Constraint.spec: the {c.kind} does not compile: {error}")
            self._templates[c] = template
            while len(self._templates) > _CACHED:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(c)
        return GuidedRow(template.deep_copy(), [*self.eos, *stop_token_ids])

    def mask_logits(self, logits: torch.Tensor, rows: list[GuidedRow | None]) -> None:
        """Mask ``logits`` [len(rows), vocab] in place: for each row with a matcher, ``-inf`` on the tokens
        that cannot continue its match (end tokens allowed only where the match is complete); a complete
        row's distribution is its first end token alone. Rows without one (None) are left as they are."""
        live = [(i, r) for i, r in enumerate(rows) if r is not None]
        if not live:
            return
        bits = torch.zeros((len(live), self.words), dtype=torch.int32)
        todo = [(r.matcher, k) for k, (_, r) in enumerate(live) if not r.complete]
        if len(todo) > 1 and len(todo) * self.vocab_size >= _PARALLEL_FROM:
            self._executor.unsafe_compute_mask_ptr(todo, bits.data_ptr(), self.words * 4, len(live))
        else:
            for matcher, k in todo:
                matcher.unsafe_compute_mask_ptr(bits[k].data_ptr(), self.words * 4)
        allowed = ((bits.unsqueeze(-1) >> self._shifts) & 1).view(len(live), -1)[:, : logits.shape[-1]].bool()
        if self._unflagged:
            self._drop_refused(allowed, [r for _, r in live])
        for k, (_, r) in enumerate(live):
            allowed[k, r.ends] = not r.complete and r.matcher.is_accepting()
            if r.complete:
                allowed[k, r.ends[0]] = True
        every = len(live) == logits.shape[0]
        idx = None if every else torch.tensor([i for i, _ in live], device=logits.device)
        sub = logits if idx is None else logits[idx]
        sub.masked_fill_(~allowed.to(logits.device), float("-inf"))
        done = [k for k, (_, r) in enumerate(live) if r.complete]
        if done:  # one token left: its logit alone (probability 1 whatever min_new_tokens blocked)
            sub[done] = torch.where(allowed[done].to(logits.device), 0.0, float("-inf"))
        if idx is not None:
            logits[idx] = sub

    def _drop_refused(self, allowed: torch.Tensor, rows: list[GuidedRow]) -> None:
        """Keep llguidance's mask and its matcher in step (llguidance 1.9): where a grammar literal forces
        text such as ``<tool_call>``, the mask offers only the text's canonical first token, the added token
        of that text, which the matcher then refuses as a special token. Drop it, and where nothing else is
        left, offer the first token of the forced text spelt out in plain tokens instead."""
        for k, t in allowed[:, self._unflagged].nonzero().tolist():
            token, matcher = self._unflagged[t], rows[k].matcher
            if matcher.validate_tokens([token]) == 1:
                continue
            allowed[k, token] = False
            if not allowed[k].any():
                forced = matcher.compute_ff_bytes().decode("utf-8", "ignore")
                spelt = self.tokenizer.greedy_tokenize(forced) if forced else []
                if spelt and matcher.validate_tokens(spelt[:1]) == 1:
                    allowed[k, spelt[0]] = True


class GuidedRow:
    """One sequence's matcher and its end tokens."""

    def __init__(self, matcher: Any, ends: list[int]) -> None:
        self.matcher, self.ends = matcher, ends

    @property
    def complete(self) -> bool:
        """The match is complete and nothing more may follow (only an end token)."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> None:
        """Feed the sampled ``token`` (end tokens end the sequence and are not fed)."""
        if token in self.ends:
            return
        if not self.matcher.consume_token(token):
            raise RuntimeError(
                f"constrained decoding: token {token} was sampled outside the grammar's mask "
                f"({self.matcher.get_error()})"
            )
