"""SGLang's HTTP API as we speak it: the requests we send, the one parser of a ``/generate`` reply, the
formats inside them (routed experts), and what its errors mean (busy, a refused cache flush). Its
weight-update requests are :mod:`relax_rollout.engines.wire_weights`.

Why one module: the ``sglang`` engine, the ``external`` engine and the engine pool all drive SGLang-compatible
servers, and our engine server (``relax_rollout.server``) answers in the same shapes; each field name, each
encoding and each reply's reading is written here once, so the parties cannot drift apart (a reply read two
ways once gave the pool and the engine different outputs). Only the standard library at import (urllib):
relax-rollout gains no HTTP dependency; numpy, torch and safetensors are imported by the functions that
need them.

Request and reply field names follow sgl-project/sglang ``python/sglang/srt/managers/io_struct.py`` (read at
commit 001067fffe33, after v0.5.x, cross-checked with the v0.5.x dataclasses), ``entrypoints/http_server.py``
(routes, reply bodies; ``/health`` and ``/health_generate`` answer 503 while the server starts) and
``sampling/sampling_params.py``; the tests hold the field sets.
"""

from __future__ import annotations

import base64
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from relax_rollout.engines.base import GenerateOutput, SamplingParams

PAUSE_MODES = ("abort", "retract", "in_place")
MEDIA_FIELDS = ("image_data", "video_data", "audio_data")


SGLANG_BUSY_MESSAGES = ("The request queue is full.", "aborted by a higher priority request")
"""What SGLang 0.5.23 says with the 503 of a request refused at its queue bound (``scheduler.py``)."""


class ServerError(RuntimeError):
    """The server answered with an HTTP error; ``status`` and ``body`` carry its reply, ``message`` the
    body's message (the body itself when it is not a JSON object)."""

    def __init__(self, url: str, status: int, body: Any):
        self.message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{url} answered HTTP {status}: {self.message}")
        self.status, self.body = status, body

    @property
    def busy(self) -> bool:
        """The server is at its bound on requests: alive, ask again later — not a failure of the server.
        SGLang 0.5.23 under ``--max-queued-requests`` answers 503 "The request queue is full." (its
        scheduler's ``_abort_on_queued_limit``; with priority scheduling a queued request it evicts gets
        503 "...aborted by a higher priority request."), earlier SGLang 429, our engine server 503
        ``Overloaded``."""
        if self.status == 429:
            return True
        if self.status != 503:
            return False
        if isinstance(self.body, dict) and self.body.get("type") == "Overloaded":
            return True
        msg = self.message
        return isinstance(msg, str) and any(m in msg for m in SGLANG_BUSY_MESSAGES)

    @property
    def flush_refused(self) -> bool:
        """SGLang loaded the weights but refused to flush its cache, requests being still running or queued
        (HTTP 400; its reported version stays the old one). Without a pause this happens right after the
        last request ended: the scheduler removes a finished request from its running batch at its next
        loop turn, and an update reaching it first is refused (measured against SGLang 0.5.23 with its prefix
        cache on, both cores otherwise busy: 39 of 100 updates sent as a generation returned; it failed the
        engine, a restart, until :func:`retry_flush_refused`)."""
        msg = self.message
        return self.status == 400 and isinstance(msg, str) and "cache was not flushed" in msg

    @classmethod
    def of(cls, where: str, e: urllib.error.HTTPError) -> ServerError:
        """The error an HTTP error reply means (its JSON body, or its text when it is not JSON)."""
        raw = e.read()
        try:
            payload = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            payload = raw.decode(errors="replace")
        return cls(where, e.code, payload)


@dataclass(frozen=True)
class RoutingInfo:
    """What a routed-experts reply is reshaped with (from the model's ``config.json``; None: unknown)."""

    num_layers: int | None
    top_k: int | None


# -- transport ---------------------------------------------------------------------------------------------
def http_json(
    url: str,
    path: str,
    body: Any = None,
    token: str | None = None,
    timeout_s: float = 600.0,
    retries: int = 0,
    retry_backoff_s: float = 0.5,
) -> Any:
    """GET (``body`` None) or POST JSON to ``url + path``; the parsed reply (None when empty).

    Connection errors (refused, reset, the reply cut short) are retried ``retries`` times with exponential
    back-off, then raised as :class:`ConnectionError`; an HTTP error status is raised as
    :class:`ServerError` at once; a reply not read within ``timeout_s`` raises :class:`TimeoutError`."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    for attempt in range(retries + 1):
        req = urllib.request.Request(
            url + path, data=data, headers=headers, method="GET" if data is None else "POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
                return json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            raise ServerError.of(url + path, e) from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
            if attempt == retries:
                raise ConnectionError(f"{url}{path} unreachable after {attempt + 1} tries: {e}") from e
            time.sleep(retry_backoff_s * 2**attempt)
    raise AssertionError("unreachable")


_T = TypeVar("_T")


def retry_while(
    send: Callable[[], _T],
    refused: Callable[[ServerError], bool],
    within_s: float,
    delay_s: float = 0.05,
    max_delay_s: float = 1.0,
) -> _T:
    """``send()``, sent again while the server refuses it in a way ``refused`` says passes (back-off from
    ``delay_s`` doubling up to ``max_delay_s``), for up to ``within_s`` seconds; then its last error."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return send()
        except ServerError as e:
            if not refused(e) or time.monotonic() + delay_s > deadline:
                raise
        time.sleep(delay_s)
        delay_s = min(2 * delay_s, max_delay_s)


def retry_flush_refused(send: Callable[[], _T], within_s: float = 10.0) -> _T:
    """``send()`` (an ``/update_weights_from_disk`` request), sent again while SGLang refuses it only for
    its cache flush (:attr:`ServerError.flush_refused`), for up to ``within_s`` seconds: no new request
    starts during the update (SGLang holds its update lock), so the scheduler's next loop turn clears the
    finished ones. Loading the same directory again is idempotent."""
    return retry_while(send, lambda e: e.flush_refused, within_s)


def server_info(url: str, token: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """SGLang's ``/server_info`` (its launch flags among others); ``{}`` from a server without the route."""
    try:
        return http_json(url, "/server_info", None, token, timeout_s) or {}
    except ServerError as e:
        if e.status != 404:
            raise
    return {}


def model_info(url: str, token: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """An engine server's ``/model_info`` (its ``weight_version`` among others); ``/get_model_info``, its
    name before SGLang 0.5.2x deprecated it, for a server without the new route."""
    try:
        return http_json(url, "/model_info", None, token, timeout_s) or {}
    except ServerError as e:
        if e.status != 404:
            raise
    return http_json(url, "/get_model_info", None, token, timeout_s) or {}


class ServerClient:
    """What the engines that drive servers they did not build share (the ``external`` engine and the
    engine pool): the features they pass on, and one request policy — bearer token, time-out, and
    connection errors retried with back-off."""

    FEATURES: ClassVar[frozenset[str]] = frozenset({"top_logprobs", "stop"})
    """Passed on to the servers (SGLang's ``top_logprobs_num`` and ``stop``)."""

    @property
    def features(self) -> frozenset[str]:
        """The class's :attr:`FEATURES` (a property: an engine that asks its servers overrides it)."""
        return self.FEATURES

    def __init__(self, token: str | None, timeout_s: float, retries: int, retry_backoff_s: float) -> None:
        self.token, self.timeout_s = token, timeout_s
        self.retries, self.retry_backoff_s = retries, retry_backoff_s

    def request(self, url: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        """GET (body None) or POST JSON; retries connection errors; raises :class:`ServerError`."""
        return http_json(
            url, path, body, self.token, timeout_s or self.timeout_s, self.retries, self.retry_backoff_s
        )


# -- /generate ---------------------------------------------------------------------------------------------
def sampling_dict(p: SamplingParams, min_new: int) -> dict[str, Any]:
    """Our :class:`SamplingParams` (with one prompt's ``min_new_tokens``) as SGLang's sampling-params dict."""
    sp: dict[str, Any] = {
        "max_new_tokens": p.max_new_tokens,
        "temperature": 0.0 if p.greedy else p.temperature,
        "top_p": p.top_p,
        "min_new_tokens": min_new,
    }
    if p.stop_token_ids:
        sp["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        sp["sampling_seed"] = p.seed
    if p.stop:
        sp["stop"] = list(p.stop)
    if p.constraint is not None:  # (imported here: wire stays standard-library at import)
        from relax_rollout.engines.constrained import sglang_constraint

        sp.update(sglang_constraint(p.constraint))
    return sp


def min_tokens(params: SamplingParams, n: int) -> list[int]:
    """``params.min_new_tokens`` as one value per prompt."""
    mins = params.min_new_tokens
    return list(mins) if isinstance(mins, list) else [mins] * n


def generate_body(
    prompts: list[list[int]],
    params: SamplingParams,
    mins: list[int],
    fields: list[dict[str, Any]] | None = None,
    common: dict[str, Any] | None = None,
) -> dict:
    """A ``/generate`` request for a batch: one sampling dict, or one per prompt when the minima differ.

    ``fields``: per-prompt request fields (one dict per prompt, all with the same keys), sent as one list per
    key (SGLang's batch form, e.g. ``rid``, ``image_data``); ``common``: request-level fields (e.g.
    ``return_routed_experts``)."""
    sps = [sampling_dict(params, m) for m in mins]
    body: dict[str, Any] = {
        "input_ids": prompts,
        "sampling_params": sps if len(set(mins)) > 1 else sps[0],
        "return_logprob": True,
    }
    if params.top_logprobs:
        body["top_logprobs_num"] = params.top_logprobs
    if common:
        body.update(common)
    if fields is not None:
        if len(fields) != len(prompts):
            raise ValueError(f"{len(fields)} per-prompt field dicts for {len(prompts)} prompts")
        keys = set(fields[0]) if fields else set()
        if any(set(f) != keys for f in fields):
            raise ValueError("every prompt's request fields must have the same keys")
        for key in sorted(keys):
            body[key] = [f[key] for f in fields]
    return body


def media_fields(media: list[dict[str, Any] | None] | None, n: int) -> list[dict[str, Any]]:
    """Per-prompt media as SGLang's batch fields: for every modality any prompt has, one list per prompt
    (``[]`` for a prompt without it, which SGLang treats as none)."""
    if media is None:
        return [{} for _ in range(n)]
    if len(media) != n:
        raise ValueError(f"media has {len(media)} entries for {n} prompts")
    keys: set[str] = set()
    for i, m in enumerate(media):
        if m is None:
            continue
        if not isinstance(m, dict):
            raise ValueError(f"media[{i}] must be a dict of {MEDIA_FIELDS} or None (got {type(m).__name__})")
        unknown = set(m) - set(MEDIA_FIELDS)
        if unknown:
            raise ValueError(
                f"media[{i}] has {sorted(unknown)}: SGLang takes raw media as {MEDIA_FIELDS} (file names, "
                "URLs or base64/data URIs; e.g. relax_multimodal's ProcessedSample.sglang_payload()), not "
                "processed tensors"
            )
        keys |= {k for k, v in m.items() if v is not None}
    out = []
    for m in media:
        d = {}
        for k in sorted(keys):
            v = (m or {}).get(k)
            d[k] = [] if v is None else list(v) if isinstance(v, (list, tuple)) else [v]
        out.append(d)
    return out


def top_logprobs(meta: dict) -> list[list[tuple[int, float]]] | None:
    """SGLang's ``meta_info.output_top_logprobs`` (per token ``[[logprob, token_id, text], ...]``, or None)
    as :attr:`GenerateOutput.top_logprobs`; None when the reply has none."""
    rows = meta.get("output_top_logprobs")
    if rows is None:
        return None
    return [[(int(x[1]), float(x[0])) for x in row or []] for row in rows]


def matched_stop(meta: dict) -> str | None:
    """The stop string that ended a reply (SGLang's ``finish_reason.matched`` when a string)."""
    reason = meta.get("finish_reason")
    matched = reason.get("matched") if isinstance(reason, dict) else None
    return matched if isinstance(matched, str) else None


def version_number(v: Any) -> int:
    """A reply's ``weight_version`` (a string in SGLang) as our int; SGLang's default ``"default"`` is 0."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def version_spans(out: GenerateOutput) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions``: the runs of generated tokens sampled with one weight version,
    ``{"version", "start", "end"}`` (end exclusive); one span when the engine does not say per token, and
    one empty span for a response with no token, as SGLang writes them."""
    per = out.token_versions or [out.weight_version] * len(out.token_ids)
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(per):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans or [{"version": str(out.weight_version), "start": 0, "end": 0}]


def token_versions(meta: dict[str, Any], n: int) -> list[int] | None:
    """Per generated token its weight version, from a reply's ``weight_versions`` spans (None: none)."""
    spans = meta.get("weight_versions")
    if not spans:
        return None
    out = [version_number(spans[-1]["version"])] * n
    for span in spans:
        v = version_number(span["version"])
        for i in range(int(span["start"]), min(int(span["end"]), n)):
            out[i] = v
    return out


def parse_reply(
    results: Any, prompts: list[list[int]], routing: RoutingInfo | None = None, routed_start: int = 0
) -> list[GenerateOutput]:
    """A batch ``/generate`` reply as our outputs: tokens and log-probs from
    ``meta_info.output_token_logprobs`` (checked against ``output_ids`` when both are there),
    ``finish_reason.type``, ``weight_version`` (and per token from ``weight_versions``), and ``extra`` = ``rid``, ``cached_tokens`` and (when the
    reply has them) ``routed_experts``: the tokens ``[routed_start, prompt + generated - 1)`` (the request's
    ``routed_experts_start_len``), the prompt counted as SGLang's ``meta_info.prompt_tokens`` (after it
    expanded media placeholders) when the reply has it."""
    if isinstance(results, dict):
        results = [results]
    if not isinstance(results, list) or len(results) != len(prompts):
        n = len(results) if isinstance(results, list) else type(results).__name__
        raise ValueError(f"/generate answered {n} results for {len(prompts)} prompts")
    outs = []
    for r, prompt in zip(results, prompts):
        meta = r["meta_info"]
        lps = meta.get("output_token_logprobs")
        if lps is not None:
            token_ids = [int(x[1]) for x in lps]
            log_probs = [float(x[0]) for x in lps]
            if r.get("output_ids") is not None and list(r["output_ids"]) != token_ids:
                raise ValueError(
                    f"request {meta.get('id')}: output_ids and output_token_logprobs disagree "
                    f"({len(r['output_ids'])} vs {len(token_ids)} tokens)"
                )
        else:
            token_ids, log_probs = [int(t) for t in r["output_ids"]], []
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        extra: dict[str, Any] = {"rid": meta.get("id"), "cached_tokens": meta.get("cached_tokens")}
        if meta.get("routed_experts") is not None:
            prompt_len = int(meta.get("prompt_tokens") or len(prompt))
            extra["routed_experts"] = decode_routed_experts(
                meta["routed_experts"], prompt_len + len(token_ids) - 1 - routed_start, routing
            )
        version = version_number(meta.get("weight_version"))
        outs.append(
            GenerateOutput(
                token_ids,
                log_probs,
                str(kind or "abort"),
                version,
                extra,
                top_logprobs(meta),
                matched_stop(meta),
                token_versions=token_versions(meta, len(token_ids)),
            )
        )
    return outs


# -- routed experts (R3): ``meta_info.routed_experts`` ------------------------------------------------------
def encode_routed_experts(experts: Any, start: int = 0) -> str:
    """SGLang's ``meta_info["routed_experts"]``: base64 of the int32 C-order bytes of the
    ``[tokens, layers, top_k]`` expert ids from token ``start`` on (the caller knows the shape)."""
    import numpy as np

    arr = np.ascontiguousarray(np.asarray(experts)[start:], dtype=np.int32)
    return base64.b64encode(arr.tobytes()).decode("ascii")


def decode_routed_experts(b64: str, num_tokens: int, routing: RoutingInfo | None = None) -> Any:
    """``meta_info.routed_experts`` (base64 of int32 C-order bytes) as ``[num_tokens, layers, top_k]``
    (layers from the reply's size when the model's count does not fit it)."""
    import numpy as np

    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    layers = routing.num_layers if routing else None
    k = routing.top_k if routing else None
    if num_tokens <= 0:
        if flat.size:
            raise ValueError(f"routed_experts has {flat.size} ids for no routed token")
        return flat.reshape(0, layers or 0, k or 0)
    if layers and k and flat.size == num_tokens * layers * k:
        return flat.reshape(num_tokens, layers, k)
    if k and flat.size % (num_tokens * k) == 0:
        return flat.reshape(num_tokens, -1, k)
    if not k and flat.size % num_tokens == 0:
        return flat.reshape(num_tokens, -1)
    raise ValueError(
        f"routed_experts has {flat.size} ids, not a multiple of {num_tokens} tokens × top_k {k} "
        "(prompt + generated - 1 tokens are routed)"
    )


# -- control -----------------------------------------------------------------------------------------------
def pause_request(mode: str = "abort") -> dict[str, Any]:
    """SGLang's ``PauseGenerationReqInput``."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES} (got {mode!r})")
    return {"mode": mode}


def abort_request(rid: str | None = None) -> dict[str, Any]:
    """SGLang's ``AbortReq``: one request id, or every request."""
    return {"abort_all": True} if rid is None else {"rid": rid}
