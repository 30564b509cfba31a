"""The engine server's state: the engine, its tokenizer, the pause gate, the requests in flight and the
weight group it joined (its part :class:`~relax_rollout.server.joined_group.JoinedGroup`) — everything the
routes call, and no HTTP.

Why a module of its own: the routes (:mod:`.sglang_routes`, :mod:`.extra_routes`, :mod:`.openai_routes`,
:mod:`.trajectory_routes`) take an :class:`EngineServer` and :mod:`.app` maps paths to them; the state
imports none of them, so it stays unit-testable alone and the package has no import circle.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_core.models import context_length
from relax_rollout import http_api
from relax_rollout.engines.base import (
    OPTIONAL_FEATURES,
    GenerateOutput,
    MemoryReleased,
    ReleasesMemory,
    RolloutEngine,
    SamplingParams,
    TokenDelta,
    answered,
    memory_tags,
    supports,
)
from relax_rollout.server import media as chat_media
from relax_rollout.server import trajectories
from relax_rollout.server.joined_group import JoinedGroup, apply_weights
from relax_rollout.server.metrics import ServerMetrics
from relax_rollout.server.protocol import BadRequest
from relax_rollout.server.response_store import ResponseStore
from relax_rollout.server.streaming import GenerationStream, TokenCount

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_QUEUED_REQUESTS = http_api.THREADS
"""Default of ``--max-queued-requests``: as many generation requests at once as the server had worker
threads before it refused any (256)."""


@dataclass
class _Req:
    rid: str
    aborted: bool = False


@dataclass
class EngineServer:
    """Everything an HTTP handler needs; independent of the transport so it is unit-testable."""

    engine: RolloutEngine
    tokenizer: Any = None
    model_path: str = ""
    served_model_name: str = "default"
    token: str | None = None
    paused: bool = False
    pause_mode: str = "abort"
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _reqs: dict[str, _Req] = field(default_factory=dict)
    session: bool = False
    """A weight-update session is open (``/begin_weight_update`` … ``/end_weight_update``), as SGLang
    requires around ``/update_weights_from_distributed``."""
    recorder: trajectories.TrajectoryRecorder | None = None
    """Agent trajectories of chat sessions (built with the tokenizer)."""
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    """Prometheus metrics (``GET /metrics``)."""
    responses: ResponseStore = field(default_factory=ResponseStore)
    """OpenAI Responses' stored conversations (``previous_response_id``)."""
    media: chat_media.ChatMedia | None = None
    """Images in chat calls (``image_url`` parts): built for a Qwen-VL/Omni model (see ``server.media``)."""
    max_queued_requests: int | None = MAX_QUEUED_REQUESTS
    """Admission control (``--max-queued-requests``): at most this many generation requests
    (:data:`~relax_rollout.server.app.GENERATE_ROUTES`) at once, running or waiting for the engine (a batch
    ``/generate`` counts once); one more is refused at once with HTTP 503, SGLang's error body and ``Retry-After: 1``, and counted in
    ``relax:num_refused_requests_total``. None: no bound (each waits its turn, as before). SGLang's flag of
    the same name bounds its scheduler's waiting queue only (beside ``--max-running-requests``) and refuses
    with 503 "The request queue is full." (0.5.23; 429 before); this server has no running bound of its own,
    so it bounds both together."""
    sampling: tuple[float, float] | None = None
    """(temperature, top_p) every request is sampled at, whatever it asks: an agent run's server
    (``relax_rollout.agents``) samples at --rollout-temperature / --rollout-top-p, the distribution the
    trainer scores the recorded tokens under. None: each request's own."""
    no_media: str = field(default="", init=False)
    """Why chat images are refused (when ``media`` is None)."""
    context_len: int | None = field(default=None, init=False)
    """The model's context (prompt + generated tokens), where the engine's model config says it."""
    vocab_size: int | None = field(default=None, init=False)
    group: JoinedGroup = field(init=False)
    """The weight update group this server joined (``/init_weights_update_group``), if any."""

    def __post_init__(self) -> None:
        self.group = JoinedGroup(self.engine)
        self.metrics.bind(self.served_model_name, lambda: _version_number(self.engine))
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

    def check_ids(self, ids: list[int], where: str) -> None:
        """A 400 naming ``where`` for a token id outside the vocabulary (the model's, else the tokenizer's):
        a tokenizer or an embedding fails on one with an OverflowError or an IndexError, a 500."""
        size = self.vocab_size if self.vocab_size is not None else len(self.tokenizer or ())
        if size and not all(0 <= t < size for t in ids):
            bad = next(t for t in ids if not 0 <= t < size)
            raise BadRequest(where, f"token id {bad} is outside the vocabulary [0, {size})")

    def check_fits(
        self, prompts: list[list[int]], params: list[SamplingParams], max_new_given: list[bool] | None = None
    ) -> list[SamplingParams]:
        """As SGLang validates a request, before any work (the engine failed on these with a 500, or worked
        minutes on a prompt it could not hold): a 400 naming the prompt for token ids outside the vocabulary,
        a prompt that fills the context, or a named ``max_new_tokens`` that does not fit after the prompt; a
        default ``max_new_tokens`` is cut to the room left. Returns the params to generate with (at
        :attr:`sampling`'s temperature and top-p where that is set)."""
        out = list(params)
        for i, (ids, p) in enumerate(zip(prompts, params)):
            where = "input_ids" if len(prompts) == 1 else f"input_ids[{i}]"
            self.check_ids(ids, where)
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
        if self.sampling is not None:  # (an agent run's server: the trainer's temperature and top-p)
            t, top_p = self.sampling
            out = [SamplingParams(**{**p.__dict__, "temperature": t, "top_p": top_p}) for p in out]
        return out

    def check_features(self, params: list[SamplingParams], fields: dict[str, str] | None = None) -> None:
        """A 400 naming the request's field (``fields``: feature → field, default the feature's name) when
        ``params`` ask for what the engine does not implement (top log-probs, stop strings, prompt log-probs):
        never an answer without it (empty lists, a response running past its stop string)."""
        for feature in OPTIONAL_FEATURES:
            if any(getattr(p, feature, None) for p in params) and not supports(self.engine, feature):
                raise BadRequest(
                    (fields or {}).get(feature, feature),
                    f"this server's engine ({type(self.engine).__name__}) does not implement it",
                )
        if any(p.constraint for p in params) and hasattr(type(self.engine), "guide"):
            try:  # (built once: the engine's tokenizer as the grammar engine reads it)
                getattr(self.engine, "guide")  # noqa: B009 - (a property of some engines only)
            except ValueError as e:  # a tokenizer llguidance cannot read: the request asked what cannot be
                raise BadRequest(  # done here (a 500 before)
                    (fields or {}).get("constraint", "constraint"),
                    f"this server's model cannot decode under a constraint ({e})",
                ) from None

    # -- text ------------------------------------------------------------------------------------
    def need_tokenizer(self, field_name: str) -> Any:
        """The tokenizer, or a 400 naming ``field_name`` (a server without one takes and answers ids)."""
        if self.tokenizer is None:
            raise BadRequest(field_name, "this server has no tokenizer; send and read token ids")
        return self.tokenizer

    def decode(self, ids: list[int]) -> str:
        """A response's text, special tokens skipped ("" without a tokenizer)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def token_text(self, token_id: int) -> str:
        """One token's text in log-prob entries, special tokens shown (SGLang's ``batch_decode([[id]])``)."""
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    # -- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        rids: list[str],
        max_new_given: list[bool] | None = None,
        fields: dict[str, str] | None = None,
        mm: list[dict[str, Any] | None] | None = None,
        on_token: Callable[[TokenDelta], None] | None = None,
        streaming: bool = False,
    ) -> list[GenerateOutput]:
        """``fields``: the request's names of the features asked for (see :meth:`check_features`); ``mm``:
        per prompt its media tensors (None for a text prompt; see ``server.media``). ``on_token``: called
        with each response's new tokens (a :class:`TokenDelta` numbered by prompt), token by token from an
        engine that streams, else once per response when it is complete (see :meth:`stream`);
        ``streaming``: the client reads a stream (SGLang's ``is_streaming`` metrics label)."""
        self.check_features(params, fields)
        params = self.check_fits(prompts, params, max_new_given)
        reqs = [_Req(r) for r in rids]
        with self._cond:
            for r in reqs:
                self._reqs[r.rid] = r
        t0, started = time.perf_counter(), False
        self.metrics.queue(len(prompts))
        results: list[GenerateOutput | None] = [None] * len(prompts)
        seen = TokenCount(self.metrics, t0, len(prompts), streaming, on_token)
        try:
            with self._cond:  # SGLang holds new requests while paused, until continue_generation
                self._cond.wait_for(lambda: not self.paused or all(r.aborted for r in reqs))
            self.metrics.start(
                len(prompts), sum(len(p) for p in prompts), time.perf_counter() - t0, streaming
            )
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
                kwargs: dict[str, Any] = {"on_step": self._hook(sub)} if self._hook_ok else {}
                if mm is not None and any(mm[i] is not None for i in live):
                    kwargs["mm"] = [mm[i] for i in live]
                if supports(self.engine, "stream"):
                    kwargs["on_token"] = seen.numbered(live)
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
                    seen.rest(i, o)  # what the engine did not stream (all of it, from one that cannot)
                    results[i] = o
            return answered(results)
        finally:
            made = sum(len(o.token_ids) for o in results if o is not None)
            aborted = sum(o is not None and o.finish_reason == "abort" for o in results)
            self.metrics.finish(len(prompts), made, time.perf_counter() - t0, started, streaming, aborted)
            with self._cond:
                for r in reqs:
                    self._reqs.pop(r.rid, None)

    def stream(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        rids: list[str],
        max_new_given: list[bool] | None = None,
        fields: dict[str, str] | None = None,
        mm: list[dict[str, Any] | None] | None = None,
        on_done: Callable[[list[GenerateOutput] | None], Any] | None = None,
    ) -> GenerationStream:
        """:meth:`generate` read as it goes (a :class:`~relax_rollout.server.streaming.GenerationStream`:
        the token deltas, then the outputs). The request is checked here, so that what is wrong with it is
        an HTTP error, not an event of a stream already begun."""
        if released := getattr(self.engine, "released", None):  # (503: the trainer holds the device)
            raise MemoryReleased(
                f"the engine's memory is released ({sorted(released)}): POST "
                "/resume_memory_occupation before generating"
            )
        self.check_features(params, fields)
        params = self.check_fits(prompts, params, max_new_given)

        def abort(rid: str) -> None:
            self.abort(rid, abort_all=False)

        return GenerationStream(self.generate, abort, prompts, params, rids, on_done, fields=fields, mm=mm)

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
    def update_from_disk(self, model_path: str, version: Any) -> int:
        import torch
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise BadRequest("model_path", f"no *.safetensors files in {model_path!r}")
        from relax_core.checkpoints import enclosing_checkpoint, problem

        # a checkpoint's model/: what its manifest says or nothing (one written before manifests is read as
        # it is: the engine has no --trust-unverified to ask for)
        if (ckpt := enclosing_checkpoint(model_path)) and (wrong := problem(ckpt, trust_unverified=True)):
            raise BadRequest("model_path", f"its checkpoint {ckpt} is not whole: {wrong}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        return apply_weights(
            self.engine, tensors, version, "model_path", "checkpoint does not match the served model"
        )

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


def _version_number(engine: RolloutEngine) -> float:
    """The engine's weight version for ``relax:weight_version`` (NaN when it has none that is a number)."""
    try:
        return float(int(engine.weight_version))
    except (AttributeError, TypeError, ValueError):
        return float("nan")
