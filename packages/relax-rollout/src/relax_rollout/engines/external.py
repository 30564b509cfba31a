"""An engine that drives already-running SGLang-compatible servers over HTTP (``--rollout-backend external``).

Why: engines started elsewhere — a real SGLang server on a GPU node, or ``python -m relax_rollout.server``
in another process — join a run by URL, and the rollout manager sees the same ``RolloutEngine`` protocol
as for the in-process torch engine. Only the standard library is used (urllib), so relax-rollout gains no
HTTP dependency. A batch is split into contiguous chunks, one per server, sent concurrently; connection
errors (a server restarting) are retried with back-off, HTTP errors are raised with the server's message.
The request, body and reply helpers (``http_json``, ``generate_body``, ``parse_generate``,
``save_safetensors``) are shared with the engine pool (``engines/pool.py``).

Weights: ``update_weights`` writes the tensors as safetensors to a temporary directory and calls
``/update_weights_from_disk`` on every server (same host or shared filesystem; fine for small CPU
models). For large models, ``connect_dcs`` makes every server join the trainer's DCS broadcast through
``/init_weights_update_group`` instead.
"""

from __future__ import annotations

import http.client
import json
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from relax_rollout.engines.base import GenerateOutput, SamplingParams, memory_request


class ServerError(RuntimeError):
    """The server answered with an HTTP error; ``status`` and ``body`` carry its reply."""

    def __init__(self, url: str, status: int, body: Any):
        msg = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{url} answered HTTP {status}: {msg}")
        self.status, self.body = status, body


def _version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):  # SGLang's default weight_version is "default"
        return 0


# -- shared helpers (also used by the engine pool, ``engines/pool.py``) ----------------------------------
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
            raw = e.read()
            try:
                payload = json.loads(raw) if raw else None
            except json.JSONDecodeError:
                payload = raw.decode(errors="replace")
            raise ServerError(url + path, e.code, payload) from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
            if attempt == retries:
                raise ConnectionError(f"{url}{path} unreachable after {attempt + 1} tries: {e}") from e
            time.sleep(retry_backoff_s * 2**attempt)
    raise AssertionError("unreachable")


def model_info(url: str, token: str | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """An engine server's ``/model_info`` (its ``weight_version`` among others); ``/get_model_info``, its
    name before SGLang 0.5.2x deprecated it, for a server without the new route."""
    try:
        return http_json(url, "/model_info", None, token, timeout_s) or {}
    except ServerError as e:
        if e.status != 404:
            raise
    return http_json(url, "/get_model_info", None, token, timeout_s) or {}


def sampling_dict(p: SamplingParams, min_new: int) -> dict:
    """Our :class:`SamplingParams` (with one prompt's ``min_new_tokens``) as SGLang's sampling-params dict."""
    sp = {"max_new_tokens": p.max_new_tokens, "temperature": 0.0 if p.greedy else p.temperature,
          "top_p": p.top_p, "min_new_tokens": min_new}  # fmt: skip
    if p.stop_token_ids:
        sp["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        sp["sampling_seed"] = p.seed
    if p.stop:
        sp["stop"] = list(p.stop)
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
    body = {"input_ids": prompts, "sampling_params": sps if len(set(mins)) > 1 else sps[0],
            "return_logprob": True}  # fmt: skip
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


def parse_generate(results: list[dict]) -> list[GenerateOutput]:
    """A batch ``/generate`` reply (``output_ids`` + ``meta_info``) as our outputs, in order."""
    outs: list[GenerateOutput] = []
    for r in results:
        meta = r["meta_info"]
        lps = meta.get("output_token_logprobs") or []
        outs.append(
            GenerateOutput(
                token_ids=list(r["output_ids"]),
                log_probs=[float(x[0]) for x in lps],
                finish_reason=meta["finish_reason"]["type"],
                weight_version=_version(meta.get("weight_version")),
                extra={"rid": meta.get("id")},
                top_logprobs=top_logprobs(meta),
                matched_stop=matched_stop(meta),
            )
        )
    return outs


def save_safetensors(tensors: dict[str, Any], directory: str) -> str:
    """Write ``tensors`` (CPU, contiguous) to ``directory/model.safetensors`` for /update_weights_from_disk.
    Views into a larger tensor (one expert of a fused MoE tensor) are copied: safetensors refuses tensors
    that share memory."""
    import torch
    from safetensors.torch import save_file

    def own(t):
        t = torch.as_tensor(t).detach().cpu().contiguous()
        return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()

    flat = {k: own(v) for k, v in tensors.items()}
    path = f"{directory}/model.safetensors"
    save_file(flat, path)
    return path


class ExternalEngine:
    features = frozenset({"top_logprobs", "stop"})
    """Passed on to the servers (SGLang's ``top_logprobs_num`` and ``stop``)."""

    def __init__(
        self,
        urls: list[str] | str | None = None,
        token: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 5,
        retry_backoff_s: float = 0.5,
        **_ignored: Any,  # model_path, dtype, eos/pad ids: the servers own their model
    ) -> None:
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("the external engine needs server URLs: set --rollout-external-urls")
        self.urls = [u.rstrip("/") for u in urls]
        self.token, self.timeout_s = token, timeout_s
        self.retries, self.retry_backoff_s = retries, retry_backoff_s
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, len(self.urls)), thread_name_prefix="relax-external"
        )
        self._lock = threading.Lock()

    # -- HTTP ------------------------------------------------------------------------------------
    def request(self, url: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        """GET (body None) or POST JSON; retries connection errors; raises :class:`ServerError`."""
        return http_json(
            url, path, body, self.token, timeout_s or self.timeout_s, self.retries, self.retry_backoff_s
        )

    def _all(self, path: str, body: Any = None, timeout_s: float | None = None) -> list[Any]:
        futs = [self._pool.submit(self.request, u, path, body, timeout_s) for u in self.urls]
        return [f.result() for f in futs]

    # -- RolloutEngine ---------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The lowest version any server holds (what a new request may be generated with)."""
        futs = [self._pool.submit(model_info, u, self.token, self.timeout_s) for u in self.urls]
        return min(_version(f.result().get("weight_version")) for f in futs)

    @staticmethod
    def _sampling(p: SamplingParams, min_new: int) -> dict:
        return sampling_dict(p, min_new)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerateOutput]:
        if not prompts:
            return []
        mins = min_tokens(params, len(prompts))
        n = len(self.urls)
        size = -(-len(prompts) // n)
        chunks = [(u, i, i + size) for u, i in zip(self.urls, range(0, len(prompts), size))]

        def run(url: str, lo: int, hi: int) -> list[dict]:
            return self.request(url, "/generate", generate_body(prompts[lo:hi], params, mins[lo:hi]))

        futs = [self._pool.submit(run, *c) for c in chunks]
        return [o for f in futs for o in parse_generate(f.result())]

    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        with self._lock, tempfile.TemporaryDirectory(prefix="relax-weights-") as d:
            save_safetensors(tensors, d)
            self._all("/update_weights_from_disk", {"model_path": d, "weight_version": str(version)})

    def weights_checksum(self) -> str:
        """The servers' checksum (a relax extension); servers must agree."""
        try:
            sums = {r["checksum"] for r in self._all("/weights_checksum")}
        except ServerError as e:
            if e.status == 404:
                raise NotImplementedError(
                    "this server has no /weights_checksum (not a relax engine server)"
                ) from e
            raise
        if len(sums) != 1:
            raise RuntimeError(f"external engines hold different weights: {sorted(sums)}")
        return sums.pop()

    # -- extras ----------------------------------------------------------------------------------
    def connect_dcs(self, init_method: str, world_size: int, rank: int, backend: str = "gloo") -> None:
        """Make server k join the trainer's DCS group as rank ``rank + k`` (returns after the rendezvous,
        so call it concurrently with the sender's ``connect()``)."""
        from urllib.parse import urlparse

        u = urlparse(init_method)
        bodies = [
            {
                "master_address": u.hostname,
                "master_port": u.port,
                "rank_offset": rank + k,
                "world_size": world_size,
                "backend": backend,
                "group_name": "relax_dcs",
                "protocol": "relax_dcs",  # a relax engine server's extension: DCS, not SGLang's group
            }  # fmt: skip
            for k in range(len(self.urls))
        ]
        futs = [
            self._pool.submit(self.request, url, "/init_weights_update_group", b)
            for url, b in zip(self.urls, bodies)
        ]
        for f in futs:
            f.result()

    def pause(self, mode: str = "abort") -> None:
        self._all("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._all("/continue_generation", {})

    def release_memory(self, tags: list[str] | None = None) -> None:
        """``/release_memory_occupation`` on every server (colocate: the trainer uses the GPUs next)."""
        self._all("/release_memory_occupation", memory_request(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._all("/resume_memory_occupation", memory_request(tags))

    def health(self) -> list[bool]:
        ok = []
        for u in self.urls:
            try:
                self.request(u, "/health")
                ok.append(True)
            except (ConnectionError, ServerError):
                ok.append(False)
        return ok
