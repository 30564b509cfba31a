"""Request parsing and response shapes of the SGLang-compatible API, kept apart from the HTTP plumbing.

Every parser raises :class:`BadRequest` naming the offending field, which the server turns into a 400
with SGLang's error body (``{"object": "error", "message", "type", "param", "code"}``, the shape of
``sglang.srt.entrypoints.openai.protocol.ErrorResponse``; ``param`` carries the field name as in OpenAI).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from relax_rewards.types import short_repr
from relax_rollout.engines.base import Constraint, GenerateOutput, SamplingParams
from relax_rollout.engines.wire import encode_routed_experts, version_spans
from relax_rollout.http_api import BodyError

# SGLang ``SamplingParams`` keys we honour; keys about the returned text (``no_stop_trim`` is read by
# parse_generate; the others are accepted and ignored).
_SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "min_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "stop",
    "json_schema",  # constrained decoding (parse_constraint)
    "regex",
}
_SAMPLING_SEED_KEYS = ("sampling_seed", "seed")
_IGNORED_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
MAX_STOP = 32
"""The most stop strings one ``/generate`` request may give (SGLang's ``MAX_STOP_COUNT``)."""
MAX_STOP_OPENAI = 4
"""The most stop strings OpenAI's chat and completions take."""
MAX_TOP_LOGPROBS = 20
"""The most top log-probs per token any route returns (OpenAI's bound for chat; SGLang sets none)."""
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "top_k": (-1, 0),
    "min_p": (0,),
    "repetition_penalty": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "stop_regex": ([], ""),  # (the SGLang frontend sends [] with every gen)
}
"""SGLang sampling keys this server does not implement, accepted at the value that changes nothing (what
slime and veRL send by default: ``top_k: -1``, ``repetition_penalty: 1.0``, ...); any other
value is refused with a 400 naming the key, never silently ignored (``n: 2`` returned one result)."""
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
SAMPLING_EPS = 1e-6
"""A temperature below this samples greedily, as SGLang's ``SamplingParams`` does (dividing the logits by
1e-300 made them infinite and the sampler fail with a 500)."""
INT64_MAX = 2**63 - 1


class BadRequest(ValueError):
    """A payload error: ``field`` is the dotted path of the bad field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field

    def body(self) -> dict:
        return error_dict(str(self), "BadRequest", param=self.field, code=400)


class NotFound(LookupError):
    """A named resource (a session's trajectory) does not exist: the server answers 404."""

    def body(self) -> dict:
        return error_dict(str(self), "NotFound", code=404)


def objects(value: Any, where: str) -> list[dict[str, Any]]:
    """``value`` as a list of JSON objects, or a 400 naming the field (or the element) that is not one."""
    if not isinstance(value, list):
        raise BadRequest(where, f"must be a list of objects (got {type(value).__name__})")
    for i, v in enumerate(value):
        if not isinstance(v, dict):
            raise BadRequest(f"{where}[{i}]", f"must be an object (got {type(v).__name__})")
    return value


def error_dict(message: str, kind: str, **fields: Any) -> dict:
    """SGLang's error body (``ErrorResponse``): ``fields`` (``param``, ``code``, ...) follow in their order."""
    return {"object": "error", "message": message, "type": kind, **fields}


class HasBody(Protocol):
    """An error that gives its own JSON body (:class:`BadRequest`, :class:`NotFound`, the elastic API's
    ``Conflict``)."""

    def body(self) -> dict: ...


def error_body(
    code: int, message: str, kind: str, exc: BaseException | None, own: tuple[type[HasBody], ...] = ()
) -> dict:
    """The error body of a JSON API (the engine server's, the elastic API's): :class:`BadRequest`,
    :class:`NotFound` and the errors in ``own`` give their own ``body()``; a body that is not JSON names
    the field ``body`` (``param``)."""
    if isinstance(exc, (BadRequest, NotFound)):
        return exc.body()
    if isinstance(exc, own):
        return exc.body()
    body = error_dict(message, kind, code=code)
    if isinstance(exc, BodyError):
        body["param"] = exc.field
    return body


def _num(
    d: dict, key: str, where: str, kind: type, default: Any, lo: float | None = None, hi: float | None = None
):
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise BadRequest(
            f"{where}.{key}", f"must be a{'n integer' if kind is int else ' number'} (got {v!r})"
        )
    if (
        not math.isfinite(v) or abs(v) > INT64_MAX
    ):  # (JSON's NaN / Infinity literals parse; int64 ids overflow)
        raise BadRequest(f"{where}.{key}", f"must be a finite number within int64 (got {v!r})")
    v = kind(v)
    if lo is not None and v < lo:
        raise BadRequest(f"{where}.{key}", f"must be ≥ {lo} (got {v})")
    if hi is not None and v > hi:
        raise BadRequest(f"{where}.{key}", f"must be ≤ {hi} (got {v})")
    return v


def parse_sampling(sp: Any, where: str = "sampling_params", least_new: int = 1) -> tuple[SamplingParams, int]:
    """One SGLang sampling-params dict → (our SamplingParams with a scalar min_new_tokens, min_new_tokens).
    ``least_new``: the smallest ``max_new_tokens`` taken — 0 for ``/generate`` (SGLang: the prompt alone,
    for its log-probs or to cache it, as the SGLang frontend's ``select`` and ``fork`` send), 1 for OpenAI's
    routes (SGLang refuses ``max_tokens: 0`` there)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(where, f"must be an object (got {type(sp).__name__})")
    for key, value in sp.items():
        if key not in _SAMPLING_KEYS and key not in _IGNORED_KEYS and key not in _SAMPLING_SEED_KEYS:
            if value is None or (key in NEUTRAL and value in NEUTRAL[key] and not isinstance(value, bool)):
                continue
            neutral = f" (only at its neutral value {NEUTRAL[key][0]!r})" if key in NEUTRAL else ""
            raise BadRequest(f"{where}.{key}", f"is not supported by this server{neutral}; got {value!r}")
    max_new = _num(sp, "max_new_tokens", where, int, DEFAULT_MAX_NEW_TOKENS, lo=least_new)
    temperature = _num(sp, "temperature", where, float, 1.0, lo=0.0)
    top_p = _num(sp, "top_p", where, float, 1.0, lo=0.0, hi=1.0)
    if top_p <= 0.0:
        raise BadRequest(f"{where}.top_p", f"must be in (0, 1] (got {top_p})")
    min_new = _num(sp, "min_new_tokens", where, int, 0, lo=0)
    if sp.get("max_new_tokens") is not None and min_new > max_new:  # (was silently ignored; SGLang: 400)
        raise BadRequest(f"{where}.min_new_tokens", f"must be ≤ max_new_tokens (got {min_new} > {max_new})")
    if sp.get("ignore_eos"):
        min_new = max_new
    stops = sp.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
        raise BadRequest(f"{where}.stop_token_ids", f"must be a list of integers (got {short_repr(stops)})")
    for t in stops:  # (an id past int64 was a 500 from the tensor it went into)
        if not 0 <= t <= INT64_MAX:
            raise BadRequest(
                f"{where}.stop_token_ids", f"token ids must be in 0..2**63-1 (got {short_repr(t)})"
            )
    stop = parse_stop(sp.get("stop"), f"{where}.stop", MAX_STOP)
    seed = None
    for key in _SAMPLING_SEED_KEYS:
        if sp.get(key) is not None:
            seed = _num(sp, key, where, int, None)
    params = SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature if temperature >= SAMPLING_EPS else 1.0,
        top_p=top_p,
        greedy=temperature < SAMPLING_EPS,
        stop_token_ids=tuple(stops),
        seed=seed,
        stop=stop,
        constraint=parse_constraint(sp, where),
    )
    return params, min_new


def parse_constraint(sp: dict, where: str) -> Constraint | None:
    """SGLang's ``json_schema`` (``"$$ANY$$"``: any JSON) or ``regex`` sampling param as a
    :class:`~relax_rollout.engines.base.Constraint`, compiled here so that a bad one is a 400 naming its
    key; at most one, as SGLang checks (``ebnf`` and ``structural_tag`` are refused as unsupported)."""
    given = [k for k in ("json_schema", "regex") if sp.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise BadRequest(f"{where}.{given[1]}", "give only one of json_schema and regex (as SGLang)")
    key, value = given[0], sp[given[0]]
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}.{key}", f"must be a non-empty string (got {short_repr(value)})")
    from relax_rollout.engines.constrained import check_constraint

    constraint = Constraint(key, "{}" if key == "json_schema" and value == "$$ANY$$" else value)
    try:
        check_constraint(constraint)
    except ValueError as e:
        raise BadRequest(f"{where}.{key}", str(e).removeprefix("Constraint.spec: ")) from None
    return constraint


def parse_stop(v: Any, field: str, most: int) -> tuple[str, ...]:
    """``stop``: None, a string or a list of at most ``most`` strings. Empty strings are dropped (SGLang
    would end every response at its first token on ``""``; ``stop: ""`` meant no stop here before)."""
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise BadRequest(field, f"must be a string or a list of strings (got {v!r})")
    if len(items) > most:
        raise BadRequest(field, f"takes at most {most} stop strings (got {len(items)})")
    return tuple(dict.fromkeys(x for x in items if x))


def parse_top_logprobs(v: Any, field: str) -> int:
    """How many top log-probs per token: an integer from 0 to :data:`MAX_TOP_LOGPROBS` (None: 0)."""
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise BadRequest(field, f"must be an integer from 0 to {MAX_TOP_LOGPROBS} (got {v!r})")
    return v


@dataclass
class GenerateRequest:
    prompts: list[list[int]]
    params: list[SamplingParams]
    """One per prompt (min_new_tokens folded in)."""
    rids: list[str]
    return_logprob: bool
    single: bool
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    max_new_given: list[bool] | None = None
    """Per prompt: whether the request named ``max_new_tokens`` (SGLang refuses a named one that does not
    fit the context, and lets the default stop at the context's end)."""
    stream: bool = False
    """Answer in server-sent events, token by token: each chunk a prompt's reply so far, as SGLang's
    (``server.streaming``)."""
    return_text_in_logprobs: bool = False
    """Each log-prob entry's third item is its token's text (else None), as in SGLang."""
    no_stop_trim: list[bool] | None = None
    """Per prompt: keep the matched stop string / stop token in the returned text (SGLang's key)."""
    logprob_start_len: list[int] | None = None
    """Per prompt: from which prompt token on ``meta_info.input_token_logprobs`` lists the prompt's log-probs
    (SGLang's ``logprob_start_len``; -1, the default, or the prompt's length: none)."""


def _token_list(v: Any, field: str) -> list[int]:
    if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise BadRequest(field, "must be a non-empty list of token ids")
    return v


MEDIA_FIELDS = ("image_data", "video_data", "audio_data")


def _has_media(v: Any) -> bool:
    """SGLang's ``has_valid_data``: anything but None and (nested) empty lists."""
    if isinstance(v, list):
        return any(_has_media(x) for x in v)
    return v is not None


def parse_generate(body: Any, tokenizer: Any, max_text_chars: int | None = None) -> GenerateRequest:
    """SGLang ``GenerateReqInput``: ``text`` or ``input_ids`` (single or batch), ``sampling_params`` (one
    dict, or one per prompt), ``return_logprob``, ``top_logprobs_num`` (one, or one per prompt; as in
    SGLang it applies with ``return_logprob`` only), ``logprob_start_len`` (one, or one per prompt; with
    ``return_logprob`` only, as in SGLang), ``return_text_in_logprobs``, ``rid``,
    ``return_routed_experts`` and ``routed_experts_start_len``. Media (``image_data``, ``video_data``,
    ``audio_data``) are refused: this server serves text models (empty media lists, as SGLang's batch form
    sends for text-only prompts, pass)."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    prompts, single = _prompts(body, tokenizer, max_text_chars)
    stream = _flag("stream", body.get("stream") or False)
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise BadRequest("sampling_params", f"has {len(sp)} entries for {len(prompts)} prompts")
        parsed = [parse_sampling(x, f"sampling_params[{i}]", least_new=0) for i, x in enumerate(sp)]
    else:
        parsed = [parse_sampling(sp, least_new=0)] * len(prompts)
    params = [SamplingParams(**{**p.__dict__, "min_new_tokens": m}) for p, m in parsed]
    rids = _rids(body.get("rid"), len(prompts), single)
    return_logprob = _flag("return_logprob", body.get("return_logprob", False))
    top = body.get("top_logprobs_num")
    if isinstance(top, list):
        if len(top) != len(prompts):
            raise BadRequest("top_logprobs_num", f"has {len(top)} entries for {len(prompts)} prompts")
        tops = [parse_top_logprobs(x, f"top_logprobs_num[{i}]") for i, x in enumerate(top)]
    else:
        tops = [parse_top_logprobs(top, "top_logprobs_num")] * len(prompts)
    starts: list[int] | None = None
    if return_logprob:
        starts = parse_logprob_start_len(body.get("logprob_start_len"), prompts)
        params = [
            SamplingParams(**{**p.__dict__, "top_logprobs": k, "input_logprobs": 0 <= s < len(x)})
            for p, k, s, x in zip(params, tops, starts, prompts)
        ]
    text_in_logprobs = _flag("return_text_in_logprobs", body.get("return_text_in_logprobs", False))
    for key in MEDIA_FIELDS:
        if _has_media(body.get(key)):
            raise BadRequest(key, "media inputs are not supported by this server (it serves text models)")
    routed = _flag("return_routed_experts", body.get("return_routed_experts", False))
    start = _num(body, "routed_experts_start_len", "body", int, 0, lo=0)
    if routed and any(start > len(p) for p in prompts):
        raise BadRequest("routed_experts_start_len", f"must be ≤ the prompt length (got {start})")
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    given = [max_new_given(x) for x in sps]
    keep = [isinstance(x, dict) and bool(x.get("no_stop_trim")) for x in sps]
    return GenerateRequest(
        prompts,
        params,
        rids,
        return_logprob,
        single,
        routed,
        start,
        given,
        stream,
        text_in_logprobs,
        keep,
        starts,
    )


def _flag(key: str, value: Any) -> bool:
    """A request field's ``value`` (its default applied) when it is a boolean; else the 400 naming ``key``."""
    if not isinstance(value, bool):
        raise BadRequest(key, f"must be a boolean (got {value!r})")
    return value


def _prompts(body: dict, tokenizer: Any, max_text_chars: int | None) -> tuple[list[list[int]], bool]:
    """The request's prompts as token ids (``input_ids``, or ``text`` encoded), and whether it is one."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("input_ids", "give exactly one of 'text' or 'input_ids'")
    if ids is not None:
        single = not (isinstance(ids, list) and ids and isinstance(ids[0], list))
        prompts = (
            [_token_list(ids, "input_ids")]
            if single
            else [_token_list(x, f"input_ids[{i}]") for i, x in enumerate(ids)]
        )
    else:
        if tokenizer is None:
            raise BadRequest("text", "this server has no tokenizer; send input_ids")
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadRequest("text", "must be a non-empty string or list of strings")
        for i, t in enumerate(texts):
            if max_text_chars and len(t) > max_text_chars:
                raise BadRequest(
                    "text" if single else f"text[{i}]",
                    f"has {len(t)} characters: far more than the model's context holds",
                )
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return prompts, single


def _rids(rid: Any, n: int, single: bool) -> list[str]:
    """One request id per prompt: the ones given, or new ones."""
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif single and isinstance(rid, str):
        rids = [rid]
    elif not single and isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
        rids = rid
    else:
        raise BadRequest("rid", "must be a string (one prompt) or a list of strings, one per prompt")
    return rids


def parse_logprob_start_len(v: Any, prompts: list[list[int]]) -> list[int]:
    """SGLang's ``logprob_start_len``, one or one per prompt: -1 (None: the default) or a prompt position
    up to the prompt's length (SGLang aborts a request asking past it)."""
    items = v if isinstance(v, list) else [v] * len(prompts)
    if len(items) != len(prompts):
        raise BadRequest("logprob_start_len", f"has {len(items)} entries for {len(prompts)} prompts")
    out = []
    for i, (x, prompt) in enumerate(zip(items, prompts)):
        field = "logprob_start_len" if not isinstance(v, list) else f"logprob_start_len[{i}]"
        x = -1 if x is None else x
        if isinstance(x, bool) or not isinstance(x, int) or x < -1:
            raise BadRequest(field, f"must be -1 or a prompt position ≥ 0 (got {x!r})")
        if x > len(prompt):
            raise BadRequest(
                field,
                f"{x} is higher than the number of input tokens {len(prompt)}: use a "
                "smaller logprob_start_len",
            )
        out.append(x)
    return out


def max_new_given(sp: Any) -> bool:
    """Whether a sampling-params dict names ``max_new_tokens``."""
    return isinstance(sp, dict) and sp.get("max_new_tokens") is not None


def finish_reason(out: GenerateOutput, params: SamplingParams) -> dict:
    """SGLang's ``FINISH_MATCHED_STR`` / ``FINISH_MATCHED_TOKEN`` / ``FINISH_LENGTH`` / ``FINISH_ABORT``
    ``to_json()`` shapes."""
    if out.finish_reason == "stop":
        if out.matched_stop is not None:
            return {"type": "stop", "matched": out.matched_stop}
        return {"type": "stop", "matched": out.token_ids[-1] if out.token_ids else None}
    if out.finish_reason == "length":
        return {"type": "length", "length": params.max_new_tokens}
    return {"type": "abort", "message": "Abort request."}


def matched_stop(out: GenerateOutput) -> str | int | None:
    """SGLang's ``matched_stop`` of an OpenAI choice: the stop string or stop token that ended it."""
    return finish_reason(out, SamplingParams(max_new_tokens=0)).get("matched")


def response_text(decode: Any, out: GenerateOutput, no_stop_trim: bool = False) -> str:
    """The returned text of ``out`` as SGLang's detokenizer trims it (``trim_matched_stop``): cut before the
    matched stop string (through it with ``no_stop_trim``), and without the stop token that ended it (the
    EOS is not shown anyway). ``decode(ids) -> str``. The token ids and log-probs keep every generated
    token: the trainer scores exactly what the model produced."""
    if out.finish_reason != "stop" or not out.token_ids:
        return decode(out.token_ids)
    if out.matched_stop is None:
        return decode(out.token_ids if no_stop_trim else out.token_ids[:-1])
    text = decode(out.token_ids)
    pos = text.find(out.matched_stop)
    if pos < 0:  # (a special token's text: matched with special tokens, the shown text has none)
        return text
    return text[: pos + len(out.matched_stop)] if no_stop_trim else text[:pos]


def weight_metadata(out: GenerateOutput) -> dict[str, Any]:
    """SGLang's weight fields of a reply (``meta_info``; ``metadata`` of an OpenAI response): the runs of
    tokens by the weight version that sampled them (``weight_versions``: a request that went on across an
    in-place update has two or more) and ``weight_version``, the last run's."""
    spans = version_spans(out)
    return {"weight_version": spans[-1]["version"], "weight_versions": spans}


def generate_response(
    out: GenerateOutput,
    params: SamplingParams,
    rid: str,
    prompt_len: int,
    return_logprob: bool,
    text: str,
    latency: float,
    routed_experts_start: int | None = None,
    token_text: Any = None,
    prompt: list[int] | None = None,
    logprob_start: int = -1,
) -> dict:
    """SGLang's ``/generate`` reply. ``token_text(id) -> str``: the texts in the log-prob entries (SGLang's
    ``return_text_in_logprobs``; None there otherwise). With ``return_logprob``, the log-probs of the
    ``prompt`` tokens from ``logprob_start`` on (-1: none) too: SGLang's ``input_token_logprobs``, whose first
    entry's log-prob is None whatever the start, and with top log-probs ``input_top_logprobs`` (first None)."""
    txt = token_text or (lambda _: None)
    meta = {
        "id": rid,
        "finish_reason": finish_reason(out, params),
        "prompt_tokens": prompt_len,
        "completion_tokens": len(out.token_ids),
        "cached_tokens": 0,
        **weight_metadata(out),
        "e2e_latency": latency,
    }
    if return_logprob:
        # SGLang: a list of (logprob, token_id, token_text) with text None unless return_text_in_logprobs
        ids = list(prompt or [])
        first = len(ids) if logprob_start < 0 else logprob_start
        lps = (out.input_logprobs or [])[first:]  # (none for an aborted request)
        meta["input_token_logprobs"] = [
            [None if k == 0 else lp, t, txt(t)] for k, (lp, t) in enumerate(zip(lps, ids[first:]))
        ]
        meta["output_token_logprobs"] = [[lp, t, txt(t)] for lp, t in zip(out.log_probs, out.token_ids)]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if params.top_logprobs:  # per token the k most likely, the same triples
            rows = (out.input_top_logprobs or [])[first + 1 :]
            meta["input_top_logprobs"] = (
                # (only the first position has none: rows start after it)
                [None, *([[lp, t, txt(t)] for t, lp in row or ()] for row in rows)] if lps else []
            )
            meta["output_top_logprobs"] = [
                [[lp, t, txt(t)] for t, lp in row] for row in out.top_logprobs or []
            ]
    if routed_experts_start is not None and out.extra.get("routed_experts") is not None:
        meta["routed_experts"] = encode_routed_experts(out.extra["routed_experts"], routed_experts_start)
    return {"text": text, "output_ids": list(out.token_ids), "meta_info": meta}


MAX_N = 16
"""The most choices one chat request may ask for (``n``)."""


IMAGE_MARK = "<image>"
"""Where an ``image_url`` part was in a message's content: relax-multimodal's generic image marker, which it
turns into the model's vision block (a text part saying ``<image>`` itself counts as one too)."""


@dataclass(frozen=True)
class ImagePart:
    """One ``image_url`` content part: where it is (``messages[i].content[j]``) and its URL, unchecked."""

    where: str
    url: str


def parse_n(body: dict) -> int:
    """OpenAI's ``n``: choices per prompt, 1 to :data:`MAX_N`."""
    n = 1 if body.get("n") is None else body["n"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise BadRequest("n", f"must be an integer from 1 to {MAX_N} (got {n!r})")
    return n


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of ``n`` choices of one prompt: with a seed, choice ``i`` samples with seed + i (else
    all n would be the same sample)."""
    if params.seed is None:
        return [params] * n
    return [SamplingParams(**{**params.__dict__, "seed": params.seed + i}) for i in range(n)]


OPENAI_SAMPLING = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("min_new_tokens", "min_tokens"),
    ("stop_token_ids", "stop_token_ids"),
    ("sampling_seed", "seed"),
    ("stop", "stop"),
    # not implemented here: passed on so that only their neutral values pass (never ignored silently)
    ("frequency_penalty", "frequency_penalty"),
    ("presence_penalty", "presence_penalty"),
)
"""(SGLang's sampling key, OpenAI's field) of the sampling fields both OpenAI routes take."""
NEUTRAL_ONLY = (("top_k", "top_k"), ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty"))
"""More keys chat and completions pass on, for their neutral values only (see :data:`NEUTRAL`)."""


def openai_sampling(body: dict, keys: tuple[tuple[str, str], ...] = OPENAI_SAMPLING) -> dict[str, Any]:
    """The OpenAI sampling fields ``body`` gives, under SGLang's names (for :func:`parse_sampling`)."""
    return {ours: body[theirs] for ours, theirs in keys if body.get(theirs) is not None}
