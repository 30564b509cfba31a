"""The engine server: state (pause gate, in-flight requests, weight receiver) and the HTTP handler."""

from __future__ import annotations

import inspect
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from relax_core.models import context_length
from relax_rollout import http_api
from relax_rollout.engines.base import (
    OPTIONAL_FEATURES,
    GenerateOutput,
    MemoryReleased,
    ReleasesMemory,
    SamplingParams,
    memory_tags,
    supports,
)
from relax_rollout.http_api import Request, check_bind, is_loopback  # noqa: F401 - importable here too
from relax_rollout.server import extra_routes, protocol, trajectories
from relax_rollout.server import media as chat_media
from relax_rollout.server.metrics import ServerMetrics
from relax_rollout.server.protocol import BadRequest, NotFound

logger = logging.getLogger(__name__)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTROL_PATHS = {
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_tensor",
}
# Relax endpoints (recorded agent trajectories: other agents' conversations, and closing ends a trajectory)
# need the token too; generation, health and model info stay open.
CONTROL_PREFIXES = ("/relax/",)


@dataclass
class _Req:
    rid: str
    aborted: bool = False


@dataclass
class EngineServer:
    """Everything an HTTP handler needs; independent of the transport so it is unit-testable."""

    engine: Any
    tokenizer: Any = None
    model_path: str = ""
    served_model_name: str = "default"
    token: str | None = None
    paused: bool = False
    pause_mode: str = "abort"
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _reqs: dict[str, _Req] = field(default_factory=dict)
    _receiver: Any = None
    _pg: Any = None
    _pending: dict[str, Any] = field(default_factory=dict)
    _group_name: str | None = None
    session: bool = False
    """A weight-update session is open (``/begin_weight_update`` … ``/end_weight_update``), as SGLang
    requires around ``/update_weights_from_distributed``."""
    recorder: trajectories.TrajectoryRecorder | None = None
    """Agent trajectories of chat sessions (built with the tokenizer)."""
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    """Prometheus metrics (``GET /metrics``)."""
    media: chat_media.ChatMedia | None = None
    """Images in chat calls (``image_url`` parts): built for a Qwen-VL/Omni model (see ``server.media``)."""
    no_media: str = field(default="", init=False)
    """Why chat images are refused (when ``media`` is None)."""
    context_len: int | None = field(default=None, init=False)
    """The model's context (prompt + generated tokens), where the engine's model config says it."""
    vocab_size: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        try:
            self._hook_ok = "on_step" in inspect.signature(self.engine.generate).parameters
        except (AttributeError, TypeError, ValueError):
            self._hook_ok = False
        if self.tokenizer is not None and not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = CHATML
        config = getattr(getattr(self.engine, "model", None), "config", None)  # known for in-process engines
        if config is not None:
            vocab = getattr(
                config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None
            )
            self.context_len = context_length(config)
            self.vocab_size = vocab if isinstance(vocab, int) else None
        if self.tokenizer is not None and self.recorder is None:
            self.recorder = trajectories.TrajectoryRecorder(self.tokenizer, self.context_len)
        if self.tokenizer is not None and self.media is None:
            self.media, self.no_media = chat_media.build(self.engine, self.tokenizer, self.model_path, config)

    def check_fits(
        self, prompts: list[list[int]], params: list[SamplingParams], max_new_given: list[bool] | None = None
    ) -> list[SamplingParams]:
        """As SGLang validates a request, before any work (the engine failed on these with a 500, or worked
        minutes on a prompt it could not hold): a 400 naming the prompt for token ids outside the vocabulary,
        a prompt that fills the context, or a named ``max_new_tokens`` that does not fit after the prompt; a
        default ``max_new_tokens`` is cut to the room left. Returns the params to generate with."""
        out = list(params)
        for i, (ids, p) in enumerate(zip(prompts, params)):
            where = "input_ids" if len(prompts) == 1 else f"input_ids[{i}]"
            if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in ids):
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                raise BadRequest(where, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
            ctx = self.context_len
            if ctx is None or len(ids) + p.max_new_tokens <= ctx:
                continue
            if len(ids) >= ctx:
                raise BadRequest(
                    where, f"{len(ids)} prompt tokens fill the model's context of {ctx}: shorten it"
                )
            if max_new_given is None or max_new_given[i]:
                raise BadRequest(
                    where,
                    f"{len(ids)} prompt tokens + max_new_tokens {p.max_new_tokens} exceed the model's context of "
                    f"{ctx} tokens: shorten the prompt or lower max_new_tokens",
                )
            out[i] = SamplingParams(**{**p.__dict__, "max_new_tokens": ctx - len(ids)})
        return out

    def check_features(self, params: list[SamplingParams], fields: dict[str, str] | None = None) -> None:
        """A 400 naming the request's field (``fields``: feature → field, default the feature's name) when
        ``params`` ask for what the engine does not implement (top log-probs, stop strings, prompt log-probs):
        never an answer without it (empty lists, a response running past its stop string)."""
        for feature in OPTIONAL_FEATURES:
            if any(getattr(p, feature) for p in params) and not supports(self.engine, feature):
                raise BadRequest(
                    (fields or {}).get(feature, feature),
                    f"this server's engine ({type(self.engine).__name__}) does not implement it",
                )

    # -- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        rids: list[str],
        max_new_given: list[bool] | None = None,
        fields: dict[str, str] | None = None,
        mm: list[dict[str, Any] | None] | None = None,
    ) -> list[GenerateOutput]:
        """``fields``: the request's names of the features asked for (see :meth:`check_features`); ``mm``:
        per prompt its media tensors (None for a text prompt; see ``server.media``)."""
        self.check_features(params, fields)
        params = self.check_fits(prompts, params, max_new_given)
        reqs = [_Req(r) for r in rids]
        with self._cond:
            for r in reqs:
                self._reqs[r.rid] = r
        t0, started = time.perf_counter(), False
        self.metrics.queue(len(prompts))
        results: list[GenerateOutput | None] = [None] * len(prompts)
        try:
            with self._cond:  # SGLang holds new requests while paused, until continue_generation
                self._cond.wait_for(lambda: not self.paused or all(r.aborted for r in reqs))
            self.metrics.start(len(prompts), sum(len(p) for p in prompts))
            started = True
            groups: dict[SamplingParams, list[int]] = {}
            for i, p in enumerate(params):  # one engine call per distinct params (min_new_tokens may vary)
                groups.setdefault(SamplingParams(**{**p.__dict__, "min_new_tokens": 0}), []).append(i)
            for base, idx in groups.items():
                live = [i for i in idx if not reqs[i].aborted]
                for i in set(idx) - set(live):
                    results[i] = GenerateOutput(
                        [],
                        [],
                        "abort",
                        self.engine.weight_version,
                        top_logprobs=[] if base.top_logprobs else None,
                    )
                if not live:
                    continue
                p = SamplingParams(
                    **{**base.__dict__, "min_new_tokens": [params[i].min_new_tokens for i in live]}
                )
                sub = [reqs[i] for i in live]
                kwargs = {"on_step": self._hook(sub)} if self._hook_ok else {}
                if mm is not None and any(mm[i] is not None for i in live):
                    kwargs["mm"] = [mm[i] for i in live]
                outs = self.engine.generate([prompts[i] for i in live], p, **kwargs)
                for i, r, o in zip(live, sub, outs):
                    if r.aborted and o.finish_reason != "abort" and not self._hook_ok:
                        o.finish_reason = "abort"
                    for feature, got in (
                        ("top_logprobs", o.top_logprobs),
                        ("input_logprobs", o.input_logprobs),
                    ):
                        if getattr(base, feature) and got is None and o.finish_reason != "abort":
                            raise RuntimeError(
                                f"{type(self.engine).__name__} lists {feature} among its features "
                                "but returned none"
                            )
                    results[i] = o
            return results  # type: ignore[return-value]
        finally:
            made = sum(len(o.token_ids) for o in results if o is not None)
            self.metrics.finish(len(prompts), made, time.perf_counter() - t0, started)
            with self._cond:
                for r in reqs:
                    self._reqs.pop(r.rid, None)

    def _hook(self, reqs: list[_Req]):
        def on_step(t: int) -> set[int]:
            with self._cond:  # in_place / retract: in-flight requests wait here, weights may change
                self._cond.wait_for(
                    lambda: not self.paused or self.pause_mode == "abort" or all(r.aborted for r in reqs)
                )
                return {i for i, r in enumerate(reqs) if r.aborted}

        return on_step

    def pause(self, mode: str) -> None:
        with self._cond:
            self.paused, self.pause_mode = True, mode
            if mode == "abort":  # SGLang: abort and return every request being processed
                for r in self._reqs.values():
                    r.aborted = True
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self.paused = False
            self._cond.notify_all()

    def abort(self, rid: str, abort_all: bool) -> int:
        with self._cond:
            hit = [r for r in self._reqs.values() if abort_all or r.rid == rid]
            for r in hit:
                r.aborted = True
            self._cond.notify_all()
            return len(hit)

    # -- weights ---------------------------------------------------------------------------------
    def _next_version(self, requested: Any, field_name: str = "weight_version") -> int:
        if requested is None:
            return self.engine.weight_version + 1
        try:
            return int(requested)
        except (TypeError, ValueError):
            raise BadRequest(field_name, f"must be an integer version (got {requested!r})") from None

    def update_from_disk(self, model_path: str, version: Any) -> int:
        import torch
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise BadRequest("model_path", f"no *.safetensors files in {model_path!r}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        v = self._next_version(version)
        try:
            self.engine.update_weights(tensors, v)
        except KeyError as e:
            raise BadRequest("model_path", f"checkpoint does not match the served model: {e}") from None
        return v

    def init_group(self, body: dict) -> None:
        """``/init_weights_update_group``: join rank 0's group as ``rank_offset`` — SGLang's group
        (:mod:`relax_rollout.engines.weight_group`; each ``/update_weights_from_distributed`` then takes
        its tensors from a broadcast), or with ``"protocol": "relax_dcs"`` (a relax extension) the
        trainer's DCS group, whose sender pushes every version."""
        for key in ("master_address", "master_port", "rank_offset", "world_size"):
            if key not in body:
                raise BadRequest(key, "is required")
        for key in ("master_port", "rank_offset", "world_size"):
            if not isinstance(body[key], int) or isinstance(body[key], bool):
                raise BadRequest(key, f"must be an integer (got {body[key]!r})")
        backend = body.get("backend", "gloo")
        if backend not in ("gloo", "nccl"):
            raise BadRequest("backend", f"must be 'gloo' or 'nccl' (got {backend!r})")
        proto = body.get("protocol", "sglang")
        if proto not in ("sglang", "relax_dcs"):
            raise BadRequest("protocol", f"must be 'sglang' (default) or 'relax_dcs' (got {proto!r})")
        if self._receiver is not None or self._pg is not None:
            raise BadRequest("group_name", "a weight update group is already initialised; destroy it first")
        if not 1 <= body["rank_offset"] < body["world_size"]:
            raise BadRequest(
                "rank_offset",
                f"must be in 1..world_size-1 (rank 0 sends; got {body['rank_offset']} of "
                f"{body['world_size']})",
            )
        name = body.get("group_name", "weight_update_group")
        init = f"tcp://{body['master_address']}:{body['master_port']}"
        if proto == "sglang":
            from relax_rollout.engines.weight_group import new_group

            timeout = protocol._num(body, "timeout_s", "body", float, 300.0, lo=1.0)
            # rendezvous with rank 0 (this server's engine has one rank: tensor parallelism is SGLang's)
            self._pg = new_group(backend, init, body["world_size"], body["rank_offset"], name, timeout)
            self._pending = {}
            self._group_name = name
            return
        from relax_core.dcs import WeightReceiver

        try:
            rcv = WeightReceiver(
                init, body["world_size"], body["rank_offset"], backend=backend, group_name=name
            )
        except ValueError as e:
            raise BadRequest("rank_offset", str(e)) from None
        rcv.connect()  # rendezvous with the trainer's WeightSender
        rcv.start_background(lambda v, t: self.engine.update_weights(t, v))
        self._receiver = rcv
        self._group_name = name

    def check_group(self, group_name: Any) -> None:
        """A request naming a weight update group must name the one this server joined."""
        if group_name is None or (self._receiver is None and self._pg is None):
            return
        if group_name != self._group_name:
            raise BadRequest(
                "group_name",
                f"no weight update group {group_name!r}; this server joined {self._group_name!r}",
            )

    def receive_weights(self, body: dict, apply: bool) -> int | None:
        """SGLang's group: take the tensors ``body`` names from rank 0's broadcast. They are applied with
        the request that carries ``weight_version`` or ``flush_cache`` (``apply``), together with those of
        the requests before it: MoE experts sent one per expert may span buckets and this engine loads
        them fused. Returns the version applied, or None while held."""
        from relax_rollout.engines.weight_group import receive

        names, dtypes, shapes = body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or []
        try:
            got = receive(self._pg, names, dtypes, shapes, body.get("load_format"))
        except ValueError as e:
            raise BadRequest("dtypes", str(e)) from None
        self._pending.update(got)
        if not apply:
            return None
        tensors, self._pending = self._pending, {}
        v = self._next_version(body.get("weight_version"))
        try:
            self.engine.update_weights(tensors, v)
        except KeyError as e:
            raise BadRequest("names", f"weights do not match the served model: {e}") from None
        return v

    def wait_for_version(self, version: Any, timeout_s: float) -> int:
        """DCS pushes the weights itself (a background receiver); this waits until ``version`` is applied."""
        if self._receiver is None:
            raise BadRequest("group_name", "no weight update group: call /init_weights_update_group first")
        want = self._next_version(version)
        deadline = time.monotonic() + timeout_s
        while self.engine.weight_version < want:
            self._receiver.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight version {want} not received within {timeout_s}s")
            time.sleep(0.01)
        return self.engine.weight_version

    def destroy_group(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self._pg is not None:
            from relax_rollout.engines.weight_group import destroy_group

            destroy_group(self._pg)
            self._pg, self._pending = None, {}

    # -- device memory (colocate: the trainer uses the device between rollouts) --------------------
    def memory(self, body: Any, release: bool) -> None:
        """``/release_memory_occupation`` / ``/resume_memory_occupation``: ``tags`` (default all) of
        ``weights``, ``kv_cache``, ``cuda_graph``."""
        if not isinstance(self.engine, ReleasesMemory):
            raise BadRequest(
                "tags", f"this server's engine ({type(self.engine).__name__}) cannot release its memory"
            )
        tags = body.get("tags") if isinstance(body, dict) else None
        try:
            tags = memory_tags(tags)
        except ValueError as e:
            raise BadRequest("tags", str(e).partition(": ")[2]) from None
        (self.engine.release_memory if release else self.engine.resume_memory)(tags)


# -- routes: (state, body) -> (status, json) ----------------------------------------------------------
def _health(s: EngineServer, _: dict):
    return 200, None


def _model_info(s: EngineServer, _: dict):
    return 200, {
        "model_path": s.model_path,
        "tokenizer_path": s.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(s.engine.weight_version),
    }


def _weight_version(s: EngineServer, _: dict):
    return 200, {"weight_version": str(s.engine.weight_version)}


def _checksum(s: EngineServer, _: dict):
    return 200, {"checksum": s.engine.weights_checksum(), "weight_version": str(s.engine.weight_version)}


def _decode(s: EngineServer, ids: list[int]) -> str:
    return s.tokenizer.decode(ids, skip_special_tokens=True) if s.tokenizer is not None else ""


def _token_text(s: EngineServer, token_id: int) -> str:
    """One token's text in log-prob entries, special tokens shown (SGLang's ``batch_decode([[id]])``)."""
    return s.tokenizer.decode([token_id]) if s.tokenizer is not None else ""


def _chat_logprob(s: EngineServer, token_id: int, logprob: float) -> dict:
    """OpenAI's ``{token, logprob, bytes}``; ``bytes`` are the UTF-8 of the token's text (as SGLang for a
    tokenizer that is not byte-level; a byte-level token that is part of a character shows U+FFFD)."""
    text = _token_text(s, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _generate(s: EngineServer, body: dict):
    # (a text far longer than the context is refused before tokenizing it: a 10 MB prompt held the server)
    req = protocol.parse_generate(body, s.tokenizer, s.context_len and s.context_len * CHARS_PER_TOKEN_MAX)
    if req.return_routed_experts and getattr(s.engine, "routing", None) is None:
        raise BadRequest(
            "return_routed_experts",
            "this server records no routed experts: start it with --enable-return-routed-experts "
            "on a Mixture-of-Experts model",
        )
    t0 = time.perf_counter()
    outs = s.generate(req.prompts, req.params, req.rids, req.max_new_given, GENERATE_FIELDS)
    dt = time.perf_counter() - t0
    start = req.routed_experts_start_len if req.return_routed_experts else None
    text_of = (lambda t: _token_text(s, t)) if req.return_text_in_logprobs else None
    keep = req.no_stop_trim or [False] * len(outs)
    firsts = req.logprob_start_len or [-1] * len(outs)
    res = [
        protocol.generate_response(
            o,
            p,
            rid,
            len(x),
            req.return_logprob,
            protocol.response_text(lambda ids: _decode(s, ids), o, k),
            dt,
            start,
            text_of,
            x,
            first,
        )
        for o, p, rid, x, k, first in zip(outs, req.params, req.rids, req.prompts, keep, firsts)
    ]
    if req.stream:  # (SGLang numbers a batch's chunks by "index")
        return 200, protocol.EventStream([r if req.single else {**r, "index": i} for i, r in enumerate(res)])
    return 200, res[0] if req.single else res


GENERATE_FIELDS = {
    "top_logprobs": "top_logprobs_num",
    "stop": "sampling_params.stop",
    "input_logprobs": "logprob_start_len",
}


def _update_from_disk(s: EngineServer, body: dict):
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("model_path", "is required (a directory of *.safetensors)")
    if body.get("abort_all_requests"):
        s.abort("", abort_all=True)
    v = s.update_from_disk(path, body.get("weight_version"))
    return 200, {
        "success": True,
        "message": f"Succeeded to update model weights. Weight version {v}.",
        "num_paused_requests": 0,
    }


def _init_group(s: EngineServer, body: dict):
    s.init_group(body)
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


def _refused(message: str):
    """SGLang's answer to a weight request it does not carry out: HTTP 400, ``success`` false."""
    return 400, {"success": False, "message": message}


def _begin_update(s: EngineServer, body: dict):
    if s.session:
        return _refused("a weight-update session is already open; call end_weight_update() first")
    s.session = True
    return 200, {"success": True, "message": "Success"}


def _end_update(s: EngineServer, body: dict):
    if not s.session:
        return _refused("no weight-update session is open; call begin_weight_update() first")
    s.session = False
    return 200, {"success": True, "message": "Success"}


def _update_from_tensor(s: EngineServer, body: dict):
    """SGLang's ``/update_weights_from_tensor`` hands CUDA IPC handles to an engine on the same GPUs; this
    server's engine runs in another process on the CPU, where such handles do not exist."""
    return _refused(
        "update_weights_from_tensor is not supported by the relax engine server (its tensors are CUDA IPC "
        "handles, for an SGLang engine on the sender's GPUs): use /update_weights_from_disk or "
        "/update_weights_from_distributed"
    )


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise BadRequest(key, f"must be a boolean (got {v!r})")
    return v


def _update_from_distributed(s: EngineServer, body: dict):
    """SGLang's ``UpdateWeightsFromDistributedReqInput``: ``names``, ``dtypes``, ``shapes``,
    ``group_name``, ``flush_cache``, ``abort_all_requests``, ``weight_version``, ``load_format``,
    ``torch_empty_cache`` (cache knobs have nothing to act on here); ``load_format``:
    ``flattened_bucket`` or per-tensor broadcasts."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if names is not None and not isinstance(names, list):
        raise BadRequest("names", "must be a list of parameter names")
    if names is not None and (len(dtypes or []) != len(names) or len(shapes or []) != len(names)):
        raise BadRequest("dtypes", "names, dtypes and shapes must have the same length")
    flags = {
        k: _flag(body, k, d)
        for k, d in (("flush_cache", True), ("abort_all_requests", False), ("torch_empty_cache", False))
    }
    s.check_group(body.get("group_name"))
    if not s.session:  # SGLang 0.5.23 refuses it outside a session, before joining the broadcast
        return _refused(
            "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
        )
    if flags["abort_all_requests"]:
        s.abort("", abort_all=True)
    if s._pg is not None:  # SGLang's group: this request's tensors come now, from rank 0's broadcast
        v = s.receive_weights(body, body.get("weight_version") is not None or flags["flush_cache"])
        if v is None:
            return 200, {"success": True, "message": "Succeeded to update parameter online."}
    else:
        timeout = protocol._num(body, "timeout_s", "body", float, 300.0, lo=0.0)
        v = s.wait_for_version(body.get("weight_version"), timeout)
    return 200, {"success": True, "message": f"Succeeded to update parameter online. Weight version {v}."}


def _destroy_group(s: EngineServer, body: dict):
    s.check_group(body.get("group_name"))
    s.destroy_group()
    return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


def _pause(s: EngineServer, body: dict):
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        raise BadRequest("mode", f"must be one of 'abort', 'retract', 'in_place' (got {mode!r})")
    s.pause(mode)
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


def _continue(s: EngineServer, body: dict):
    s.resume()
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


def _abort(s: EngineServer, body: dict):
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str):
        raise BadRequest("rid", f"must be a string (got {rid!r})")
    if not isinstance(abort_all, bool):
        raise BadRequest("abort_all", f"must be a boolean (got {abort_all!r})")
    if not rid and not abort_all:
        raise BadRequest("rid", "give a request id, or abort_all: true")
    s.abort(rid, abort_all)
    return 200, None


def _release_memory(s: EngineServer, body: dict):
    s.memory(body, release=True)
    return 200, None


def _resume_memory(s: EngineServer, body: dict):
    s.memory(body, release=False)
    return 200, None


def _models(s: EngineServer, _: dict):
    card = {
        "id": s.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "relax",
        "root": s.served_model_name,
    }
    return 200, {"object": "list", "data": [card]}


def _chat(s: EngineServer, body: dict, req: Request):
    """OpenAI chat. With a session (``X-Relax-Session`` or ``user``) the prompt continues the session's
    recorded token ids (see ``trajectories``), and the call is recorded. ``n`` choices are sampled together
    (each with its own seed when one is given); ``stream`` answers in server-sent events. ``image_url``
    parts (``data:`` URLs) are served for a Qwen-VL/Omni model (``server.media``), outside sessions only: a
    recorded trajectory holds token ids, not the media tensors a trainer would need with them."""
    if s.tokenizer is None or s.recorder is None:
        raise BadRequest("messages", "this server has no tokenizer, so no chat template")
    chat = protocol.parse_chat(body)
    session = trajectories.session_name(req.headers.get(trajectories.SESSION_HEADER), body)
    if session is not None and chat.n > 1:
        raise BadRequest("n", "a session's call extends one trajectory: n must be 1 (send n calls instead)")
    if chat.images and s.media is None:
        raise BadRequest(chat.images[0].where, f"'image_url' parts need a multimodal model; {s.no_media}")
    if chat.images and session is not None:
        raise BadRequest(
            chat.images[0].where,
            "images are not recorded in agent sessions (X-Relax-Session "
            "or 'user'): send calls with images without one",
        )
    params, min_new = protocol.parse_sampling(chat.sampling)
    params = SamplingParams(
        **{**params.__dict__, "min_new_tokens": min_new, "top_logprobs": chat.top_logprobs}
    )
    every = protocol.per_choice(params, chat.n)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    given = [protocol.max_new_given(chat.sampling)] * chat.n
    recorded, mm = None, None
    if session is None:
        if chat.images:
            prompt, tensors = s.media.prompt(chat.messages, chat.images)
            mm = [tensors] * chat.n
        else:
            prompt = trajectories.render_prompt(s.tokenizer, chat.messages)
        rids = [f"{rid}-{i}" for i in range(chat.n)]
        outs = s.generate([prompt] * chat.n, every, rids, given, CHAT_FIELDS, mm)
    else:
        with s.recorder.turn(session, chat.messages) as turn:
            # the session's recorded ids + the template's suffix: the model sees exactly its own tokens
            prompt = turn.prompt_ids
            outs = s.generate([prompt], every, [rid], given, CHAT_FIELDS)
            recorded = turn.record(outs[0], _reply(s, outs[0]))
    choices = []
    for i, out in enumerate(outs):
        choice = {
            "index": i,
            "message": {"role": "assistant", "content": _reply(s, out)},
            "finish_reason": out.finish_reason,
            "logprobs": None,
            "token_ids": list(out.token_ids),  # extension (vLLM's name): the exact sampled tokens
            "matched_stop": protocol.matched_stop(out),  # extension (SGLang's): the stop string or token
        }
        if chat.logprobs:  # every generated token, the stop string's included (as SGLang)
            tops = out.top_logprobs or [[]] * len(out.token_ids)
            choice["logprobs"] = {
                "content": [
                    {**_chat_logprob(s, t, lp), "top_logprobs": [_chat_logprob(s, a, alp) for a, alp in top]}
                    for t, lp, top in zip(out.token_ids, out.log_probs, tops)
                ]
            }
        choices.append(choice)
    n_out = sum(len(out.token_ids) for out in outs)
    res = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": s.served_model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": n_out,
            "total_tokens": len(prompt) + n_out,
        },
        "prompt_token_ids": prompt,  # extension: what the trainer should record as the prompt
        "weight_version": str(outs[0].weight_version),  # extension, as in SGLang's meta_info
    }
    if recorded:  # extension: which trajectory of the session this call extended
        res["relax_trajectory"] = {k: recorded[k] for k in ("session", "index", "num_calls")}
    return 200, (protocol.chat_stream(res, chat.include_usage) if chat.stream else res)


CHAT_FIELDS = {"top_logprobs": "top_logprobs", "stop": "stop"}


def _reply(s: EngineServer, out: GenerateOutput) -> str:
    """A choice's text: cut before its stop string (OpenAI's and SGLang's ``stop``)."""
    return protocol.response_text(lambda ids: _decode(s, ids), out)


def _recorder(s: EngineServer) -> trajectories.TrajectoryRecorder:
    if s.recorder is None:
        raise NotFound("this server has no tokenizer, so it serves no chat and records no trajectories")
    return s.recorder


def _trajectory_list(s: EngineServer, body: dict, req: Request):
    return 200, {"object": "list", "data": _recorder(s).sessions()}


def _trajectory_get(s: EngineServer, body: dict, req: Request):
    return 200, _recorder(s).get(req.params["session"], trajectories.parse_index(req.query))


def _trajectory_close(s: EngineServer, body: dict, req: Request):
    return 200, _recorder(s).close(req.params["session"], trajectories.parse_close(body))


ROUTES = {
    ("GET", "/health"): _health,
    ("GET", "/health_generate"): _health,
    ("GET", "/get_model_info"): _model_info,
    ("GET", "/model_info"): _model_info,
    ("GET", "/get_weight_version"): _weight_version,
    ("GET", "/weights_checksum"): _checksum,
    ("POST", "/generate"): _generate,
    ("POST", "/update_weights_from_disk"): _update_from_disk,
    ("POST", "/init_weights_update_group"): _init_group,
    ("POST", "/update_weights_from_distributed"): _update_from_distributed,
    ("POST", "/destroy_weights_update_group"): _destroy_group,
    ("POST", "/begin_weight_update"): _begin_update,
    ("POST", "/end_weight_update"): _end_update,
    ("POST", "/update_weights_from_tensor"): _update_from_tensor,
    ("POST", "/pause_generation"): _pause,
    ("POST", "/continue_generation"): _continue,
    ("POST", "/abort_request"): _abort,
    ("POST", "/release_memory_occupation"): _release_memory,
    ("POST", "/resume_memory_occupation"): _resume_memory,
    ("GET", "/v1/models"): _models,
    ("POST", "/v1/completions"): extra_routes.completions,
    ("POST", "/tokenize"): extra_routes.tokenize,
    ("POST", "/v1/tokenize"): extra_routes.tokenize,
    ("POST", "/detokenize"): extra_routes.detokenize,
    ("POST", "/v1/detokenize"): extra_routes.detokenize,
    ("GET", "/server_info"): extra_routes.server_info,
    ("GET", "/flush_cache"): extra_routes.flush_cache,
    ("POST", "/flush_cache"): extra_routes.flush_cache,
    ("GET", "/metrics"): extra_routes.metrics,
}
# Routes that also read headers, path or query parameters: (method, full-match pattern, route(s, body, req)).
REQUEST_ROUTES = [
    ("POST", re.compile(r"/v1/chat/completions"), _chat),
    ("GET", re.compile(r"/relax/trajectories"), _trajectory_list),
    ("GET", re.compile(r"/relax/trajectories/(?P<session>[^/]+)"), _trajectory_get),
    ("POST", re.compile(r"/relax/trajectories/(?P<session>[^/]+)/close"), _trajectory_close),
]


def _match(method: str, path: str) -> tuple[Any, dict[str, str] | None]:
    """(route, None) for a plain route, (route, path parameters) for a request route, (None, None)."""
    route = ROUTES.get((method, path))
    if route is not None:
        return route, None
    for m, pattern, fn in REQUEST_ROUTES:
        hit = pattern.fullmatch(path) if m == method else None
        if hit:
            return fn, {k: unquote(v) for k, v in hit.groupdict().items()}
    return None, None


CHARS_PER_TOKEN_MAX = 64
"""More characters per token than any tokenizer averages: a text longer than this many per context token
cannot fit, whatever it tokenizes to."""


def error_body(code: int, message: str, kind: str, exc: BaseException | None) -> dict:
    """SGLang's error body (``ErrorResponse``); a payload error names its field (``param``)."""
    if isinstance(exc, (BadRequest, NotFound)):
        return exc.body()
    body = {"object": "error", "message": message, "type": kind, "code": code}
    if isinstance(exc, http_api.BodyError):
        body["param"] = exc.field
    return body


def make_server(state: EngineServer, host: str = "127.0.0.1", port: int = 0) -> http_api.Served:
    """Bind (port 0 = any free port); a non-loopback host needs ``state.token``. Serve with
    ``serve_forever()`` (in a thread, or the main thread), stop with ``shutdown()``."""
    check_bind(host, state.token, "engine server (--host / --token)")

    def resolve(method: str, path: str):
        route, params = _match(method, path)
        if route is None:
            return None, {}
        if params is None:
            return (lambda body, req: route(state, body)), {}
        return (lambda body, req: route(state, body, req)), params

    api = http_api.JsonApi(
        "engine server",
        resolve,
        error_body,
        errors=[
            (BadRequest, 400),
            (NotFound, 404),
            (TimeoutError, 504),
            # colocate: the trainer holds the device; try again after the step
            (MemoryReleased, 503),
        ],
        token=state.token,
        protected=lambda path: path in CONTROL_PATHS or path.startswith(CONTROL_PREFIXES),
    )
    return http_api.Served(api, host, port)
