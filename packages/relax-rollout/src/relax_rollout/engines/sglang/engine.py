"""The ``sglang`` rollout engine: SGLang servers launched and supervised here, driven over HTTP as one pool.

Why: SGLang is the GPU inference engine; running it as ``python -m sglang.launch_server`` processes (one
per ``tp_size`` GPUs) keeps its CUDA state, crashes and memory out of the rollout role. It is tested
against the real SGLang (the version uv.lock pins) running on a CPU (:mod:`relax_rollout.engines.sglang_cpu`,
``pytest -m real_sglang``); our engine server (``relax_rollout.server``, through ``launch_cmd``) stands in
only for what a CPU SGLang cannot do (memory release, R3's routed experts) or be made to do on cue.

An :class:`SGLangEngine` composes the engine processes (:mod:`~relax_rollout.engines.processes`: engine
``k`` on GPUs ``[k*tp, (k+1)*tp)``, here or on another node with ``gpus_per_node``, ready once
``/health_generate`` answers 200), an :class:`~relax_rollout.engines.pool.EnginePool` of their servers
(requests split over them and re-issued when one fails), SGLang's API (:mod:`~relax_rollout.engines.wire`)
and the weight updates (:mod:`~relax_rollout.engines.sglang.weights`, ``self.weights``); what the three
share — the slots, the pool, the lock, the pause state, the way to call the servers — is one
:class:`~relax_rollout.engines.sglang.state.SGLangServers` (``self.servers``). What it adds:

- **Supervision** (:mod:`~relax_rollout.engines.sglang.lifecycle`, ``self.lifecycle``). A background
  thread polls the processes every ``poll_interval_s``. An engine whose process exited (or that the pool
  marked failed: reset connections, 5xx, time-outs) is killed (its whole process group) and relaunched on
  the same GPUs, at most ``max_restarts`` times; it rejoins the pool only after loading the current
  weights. Past the bound it stays ``failed`` and the pool no longer uses it.
- **Generation.** ``rid`` per prompt (for ``abort(rid)``); the tokenizer's EOS ids given at construction
  are added to ``stop_token_ids``, so generation stops where the in-process engine's would. With
  ``record_routing`` the servers start with ``--enable-return-routed-experts`` and replies carry
  ``extra["routed_experts"]``, ``[prompt + generated - 1, layers, top_k]``. Media for VL/Omni models go in
  SGLang's ``image_data``, ``video_data`` and ``audio_data`` (``media=``, one dict per prompt), the prompt
  ids holding the model's media placeholders as SGLang's processor expects them (one per item).
- **LoRA adapters** (``lora``: ``adapter_config.json``'s fields, ``--lora-sync-mode adapter``;
  :mod:`~relax_rollout.engines.sglang.lora`, ``self.adapters``): the servers launch with LoRA enabled and
  keep the base model; :meth:`update_weights` takes the adapter's tensors and loads them as a new versioned
  adapter, which new requests then select; an old version is unloaded once no request uses it.
- **Control.** ``pause(mode)`` (``abort`` returns in-flight requests aborted, ``retract``/``in_place`` hold
  them; new requests wait), ``resume()``, ``abort(rid)`` / ``abort()``. A restarted engine is paused again
  when the others are.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
import secrets
import tempfile
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_rollout.engines.base import GenerateOutput, SamplingParams, TokenDelta, memory_request
from relax_rollout.engines.checkpoint import checkpoint_config, model_routing, served_prefix
from relax_rollout.engines.pool import EnginePool
from relax_rollout.engines.processes import (
    EngineProcess,
    Launcher,
    fill_template,
    flag_args,
    launch_command,
    place_engines,
    stop_processes,
)
from relax_rollout.engines.sglang.delta import delta_launch
from relax_rollout.engines.sglang.lifecycle import SGLangLifecycle, log_pool_failure
from relax_rollout.engines.sglang.lora import Adapter, SGLangAdapters, lora_server_args
from relax_rollout.engines.sglang.state import SGLangServers
from relax_rollout.engines.sglang.weights import SGLangWeights
from relax_rollout.engines.wire import abort_request, media_fields, parse_reply, pause_request

if TYPE_CHECKING:
    from relax_rollout.engines.wire import RoutingInfo

logger = logging.getLogger(__name__)

WEIGHT_UPDATES = ("disk", "tensor", "distributed", "delta")
INSTALL_HINT = "the sglang engine needs `pip install 'relax-rollout[sglang]'` (and a GPU)"


def _weights_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """An engine method that is ``method`` of its :class:`SGLangWeights` (``self.weights``), with the
    same signature and docstring."""

    @functools.wraps(method)
    def call(self: SGLangEngine, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.weights, method.__name__)(*args, **kwargs)

    return call


def _checked(
    model_path: str | None,
    launch_cmd: list[str] | None,
    python: str | None,
    num_engines: int,
    tp_size: int,
    weight_update: str,
    max_restarts: int,
) -> tuple[str, dict[str, Any] | None]:
    """The arguments checked before anything starts: the model path, and the served checkpoint's config.json
    (None: not local)."""
    if launch_cmd is None and python is None and importlib.util.find_spec("sglang") is None:
        raise ValueError(f"SGLang is not installed: {INSTALL_HINT}")
    if not model_path:
        raise ValueError("the sglang engine needs model_path (an HF checkpoint directory or hub id)")
    served = checkpoint_config(model_path)
    if launch_cmd is None and (served or {}).get("model_type") == "qwen3_omni_moe_thinker":
        raise ValueError(
            f"{model_path} is a Qwen3-Omni thinker saved alone, which SGLang does not serve (it registers "
            "Qwen3-Omni as the whole model only): give the whole checkpoint to SGLang with --sglang-model-path "
            "and keep the thinker for the trainer (--hf-checkpoint)"
        )
    if num_engines < 1 or tp_size < 1:
        raise ValueError(f"num_engines and tp_size must be ≥ 1 (got {num_engines}, {tp_size})")
    if weight_update not in WEIGHT_UPDATES:
        raise ValueError(f"weight_update must be one of {WEIGHT_UPDATES} (got {weight_update!r})")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be ≥ 0 (got {max_restarts})")
    return model_path, served


def _check_weights_reach_nodes(weight_update: str, weights_dir: str | None) -> None:
    """Engines on other nodes take weights from disk (a directory every node sees) or a broadcast."""
    if weight_update == "tensor":
        raise ValueError(
            "weight_update='tensor' hands CUDA tensors to engines on the trainer's node; engines on "
            "other nodes take weights from disk or a broadcast: use weight_update='disk' or "
            "'distributed'"
        )
    if weights_dir is None and weight_update == "disk":
        raise ValueError(
            "engines on other nodes load each weight version from the directory this node writes it "
            "to: give weights_dir, on a filesystem every node sees at the same path"
        )


def _port(base_port: int | None, k: int) -> int | None:
    return None if base_port is None else base_port + k


def _shared_paths(servers: SGLangServers, model_path: str) -> list[str]:
    """What an engine on another node must see at the same path: the weights directory, the model."""
    return ([str(servers.pool.weights_root)] if servers.weight_update == "disk" else []) + (
        [model_path] if os.path.exists(model_path) else []
    )


def _routing(model_path: str, record_routing: bool, env: dict[str, str]) -> RoutingInfo | None:
    """The MoE layout to record expert ids of (``record_routing``); warns of what makes the servers' replies
    other than the engine promises."""
    routing = model_routing(model_path) if record_routing else None
    if record_routing and routing is None:
        logger.warning(
            "record_routing: %s is not a Mixture-of-Experts model; no experts recorded", model_path
        )
    if "SGLANG_RETURN_ORIGINAL_LOGPROB" in {**os.environ, **env}:
        logger.warning(
            "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang then returns log-probs before the "
            "temperature, not of the distribution sampled from"
        )
    return routing


class SGLangEngine:
    """``num_engines`` SGLang servers of ``tp_size`` GPUs each as one
    :class:`~relax_rollout.engines.base.RolloutEngine` (see the module docstring).

    ``launch_cmd``: a command template replacing ``python -m sglang.launch_server ...`` (placeholders
    ``{port}``, ``{host}``, ``{model_path}``, ``{tp_size}``, ``{dtype}``, ``{engine_index}``, ``{token}``), e.g.
    our engine server for tests. ``server_args``: extra launch flags (``sglang_server_args``; an ``api_key`` there is also
    the bearer token of every request). ``base_port``: engine ``k`` listens on ``base_port + k`` (default: a
    free port per launch). ``gpu_ids``: the GPUs to split (default ``CUDA_VISIBLE_DEVICES``, else
    ``0 .. num_engines*tp_size - 1``). ``log_dir``: default a new temporary directory (``self.log_dir``).
    ``weight_update``: ``disk`` or ``tensor`` (colocated), the path of :meth:`update_weights`.
    ``gpus_per_node``: spread the engines over the nodes of the Ray cluster this process is connected to,
    this node's GPUs first, then ``gpus_per_node`` GPUs of each other node with GPUs
    (:mod:`relax_rollout.engines.processes`); an engine on another node binds that node's address and
    requires a token (one is made when none is given); weights then go through ``weights_dir``, which
    every node must see at the same path. ``lora``: serve LoRA adapters of this configuration
    (``adapter_config.json``'s fields, :func:`relax_core.lora.peft_config_dict`): updates carry the
    adapter, not the weights (:mod:`relax_rollout.engines.sglang.lora`)."""

    features = frozenset({"top_logprobs", "stop", "constraint", "stream"})
    """SGLang's ``top_logprobs_num``, ``stop`` and its grammar backend (``json_schema``, ``regex``,
    ``structural_tag``: :func:`~relax_rollout.engines.constrained.sglang_constraint`), passed on; without
    "constraint" for servers launched with ``grammar_backend: none``."""

    def __init__(
        self,
        model_path: str | None = None,
        num_engines: int = 1,
        tp_size: int = 1,
        mem_fraction_static: float | None = None,
        dtype: str = "auto",
        server_args: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
        base_port: int | None = None,
        launch_cmd: list[str] | None = None,
        startup_timeout_s: float = 900.0,
        max_restarts: int = 3,
        log_dir: str | None = None,
        *,
        gpu_ids: list[int | str] | None = None,
        python: str | None = None,
        env: dict[str, str] | None = None,
        token: str | None = None,
        eos_token_ids: list[int] | None = None,
        record_routing: bool = False,
        weight_update: str = "disk",
        request_timeout_s: float = 600.0,
        poll_interval_s: float = 1.0,
        shutdown_grace_s: float = 15.0,
        weights_dir: str | None = None,
        gpus_per_node: int | None = None,
        bucket_bytes: int = 512 << 20,
        lora: dict[str, Any] | None = None,
        **_ignored: Any,  # pad_token_id, ...: the servers own their model and tokenizer
    ) -> None:
        model_path, served = _checked(
            model_path, launch_cmd, python, num_engines, tp_size, weight_update, max_restarts
        )
        self.model_path, self.num_engines, self.tp_size = model_path, num_engines, tp_size
        self.prefix = served_prefix(served)
        """Put before every weight name of an update (``thinker.`` when serving a whole Qwen3-Omni)."""
        self.mem_fraction_static, self.dtype, self.host = mem_fraction_static, dtype, host
        self.server_args = dict(server_args or {})
        if lora is not None:
            self.server_args = lora_server_args(lora, self.server_args)
        flag_args(self.server_args)  # reject reserved flags now, not in a child process
        self.launch_cmd, self.python, self.env = launch_cmd, python, dict(env or {})
        self.server_args, self.env = delta_launch(weight_update, self.server_args, self.env)
        self.startup_timeout_s, self.max_restarts = startup_timeout_s, max_restarts
        self.poll_interval_s, self.shutdown_grace_s = poll_interval_s, shutdown_grace_s
        self.request_timeout_s = request_timeout_s
        self.bucket_bytes = bucket_bytes
        """``weight_update="distributed"``: at most this many bytes a broadcast (one dtype each)."""
        self.token = token or self.server_args.get("api_key") or self.server_args.get("--api-key")
        if str(self.server_args.get("grammar_backend", self.server_args.get("--grammar-backend"))) == "none":
            self.features = self.features - {"constraint"}
        self.eos_token_ids = tuple(eos_token_ids or ())
        self.deterministic = bool(
            self.server_args.get("enable_deterministic_inference")
            or self.server_args.get("--enable-deterministic-inference")
        )
        """SGLang honours a request's ``sampling_seed`` only with ``--enable-deterministic-inference``."""
        self._warned_seed = False
        self.routing = _routing(model_path, record_routing, self.env)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="relax-sglang-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        places = place_engines(num_engines, tp_size, gpu_ids, gpus_per_node)
        slots = [
            EngineProcess(k, gpus, self.log_dir / f"engine{k}.log", _port(base_port, k), node=node)
            for k, (node, gpus) in enumerate(places)
        ]
        if any(slot.node is not None for slot in slots):
            _check_weights_reach_nodes(weight_update, weights_dir)
            if self.token is None:  # they listen on their node's address, not loopback
                self.token = secrets.token_urlsafe(24)
                self.server_args["api_key"] = self.token
        self._inflight: set[str] = set()
        self._assemble(slots, weight_update, weights_dir, lora)
        try:
            self.lifecycle.start()
        except BaseException:
            self.close()
            raise

    def _assemble(
        self,
        slots: list[EngineProcess],
        weight_update: str,
        weights_dir: str | None,
        lora: dict[str, Any] | None,
    ) -> None:
        """The engine's parts, each owning its state: servers, adapters, launcher, lifecycle, weights."""
        pool = EnginePool(
            token=self.token,
            timeout_s=self.request_timeout_s,
            join_timeout_s=max(60.0, self.request_timeout_s / 10),
            weights_dir=weights_dir,
            on_failure=log_pool_failure,
        )
        executor = ThreadPoolExecutor(max_workers=max(4, 2 * len(slots)), thread_name_prefix="relax-sglang")
        self.servers = SGLangServers(
            slots=slots,
            pool=pool,
            executor=executor,
            weight_update=weight_update,
            tp_size=self.tp_size,
            token=self.token,
            request_timeout_s=self.request_timeout_s,
        )
        """The servers and the state the engine shares with its lifecycle and weight updates
        (:mod:`relax_rollout.engines.sglang.state`); every request goes through ``servers.call``."""
        self.pauses = pool.pauses
        """Each engine's pause for each weight update (the pool's: every path records there)."""
        s = self.servers
        self.adapters: SGLangAdapters | None = None
        """The LoRA adapter versions the servers hold (with ``lora``; :mod:`~relax_rollout.engines.sglang.lora`)."""
        if lora is not None:
            self.adapters = SGLangAdapters(s, lora, lambda v: self.weights.check_version(v))
        self.launcher = Launcher(
            self._command,
            self.host,
            self.env,
            self.token,
            s.lock,
            lambda: s.closed,
            s.stop,
            functools.partial(_shared_paths, s, self.model_path),
        )
        self.launcher.spans_nodes = any(slot.node is not None for slot in s.slots)
        self._finalizer = weakref.finalize(self, stop_processes, self.launcher.procs, 5.0)
        self.lifecycle = SGLangLifecycle(
            s,
            self.launcher,
            startup_timeout_s=self.startup_timeout_s,
            poll_interval_s=self.poll_interval_s,
            max_restarts=self.max_restarts,
            shutdown_grace_s=self.shutdown_grace_s,
            restore=None if self.adapters is None else self.adapters.restore,
        )
        """Start-up, supervision and restarts (:mod:`relax_rollout.engines.sglang.lifecycle`)."""
        self.weights = SGLangWeights(
            s,
            prefix=self.prefix,
            bucket_bytes=self.bucket_bytes,
            rejoin=self.lifecycle.join,
            restart_later=self.lifecycle.restart_later,
        )
        """The weight updates (:mod:`relax_rollout.engines.sglang.weights`)."""

    # -- launching (the launcher's command and shared paths) ---------------------------------------
    def _command(self, slot: EngineProcess, port: int, host: str) -> list[str]:
        """The command line of ``slot``'s engine: ``launch_cmd`` filled in, else SGLang's own."""
        if self.launch_cmd is not None:
            return fill_template(
                self.launch_cmd,
                port=port,
                host=host,
                model_path=self.model_path,
                tp_size=self.tp_size,
                dtype=self.dtype,
                engine_index=slot.index,
                token=self.token or "",
            )
        return launch_command(
            self.model_path,
            host,
            port,
            self.tp_size,
            self.dtype,
            self.mem_fraction_static,
            self.server_args,
            self.routing is not None,
            self.python,
        )

    # -- introspection ----------------------------------------------------------------------------
    @property
    def pool(self) -> EnginePool:
        """The pool the serving engines are members of (``servers.pool``)."""
        return self.servers.pool

    @property
    def weight_update(self) -> str:
        """How :meth:`update_weights` reaches the engines: ``disk``, ``tensor`` or ``distributed``."""
        return self.servers.weight_update

    @weight_update.setter
    def weight_update(self, mode: str) -> None:
        self.servers.weight_update = mode

    def engines(self) -> list[dict[str, Any]]:
        """Every engine slot: index, gpus, url, state, pid, restarts, error, member_id, log_path, pids."""
        return self.servers.describe()

    @property
    def urls(self) -> list[str]:
        """The URLs of the engines serving now."""
        return [m.url for m in self.pool.membership.active()]

    def inflight_rids(self) -> set[str]:
        """Request ids sent by :meth:`generate` and not answered yet (what :meth:`abort` can target)."""
        with self.servers.lock:
            return set(self._inflight)

    # -- RolloutEngine ----------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.pool.weight_version

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        rids: list[str] | None = None,
        media: list[dict[str, Any] | None] | None = None,
        mm: list[dict[str, Any] | None] | None = None,
        return_routed_experts: bool | None = None,
        on_token: Callable[[TokenDelta], None] | None = None,
    ) -> list[GenerateOutput]:
        """One output per prompt, re-issued on other engines when one fails. ``rids``: request ids (default
        fresh ones; see :meth:`inflight_rids`); ``media`` (alias ``mm``): per prompt None or a dict of
        ``image_data``/``video_data``/``audio_data`` items; ``return_routed_experts``: default
        ``record_routing``; ``on_token``: each response's tokens as SGLang streams them (the engine's
        "stream" feature; :mod:`~relax_rollout.engines.wire_stream`)."""
        if not prompts:
            return []
        rids = list(rids) if rids is not None else [uuid.uuid4().hex for _ in prompts]
        if len(rids) != len(prompts) or len(set(rids)) != len(rids):
            raise ValueError(f"rids must be {len(prompts)} distinct request ids (got {rids!r})")
        fields = [
            {"rid": r, **m}
            for r, m in zip(rids, media_fields(media if media is not None else mm, len(prompts)))
        ]
        routed = self.routing is not None if return_routed_experts is None else return_routed_experts
        if self.eos_token_ids:
            stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.eos_token_ids)))
            params = dataclasses.replace(params, stop_token_ids=stops)
        if params.seed is not None and not self.deterministic:  # SGLang would drop it without a word
            if not self._warned_seed:
                self._warned_seed = True
                logger.warning(
                    "SGLang ignores sampling seeds unless launched with --enable-deterministic-inference "
                    "(sglang_server_args: {enable_deterministic_inference: true}): generation is not "
                    "reproducible; the seeds are not sent"
                )
            params = dataclasses.replace(params, seed=None)
        routing = self.routing
        common: dict[str, Any] = {"return_routed_experts": True} if routed else {}
        adapter: Adapter | None = None
        if self.adapters is not None:
            adapter = self.adapters.acquire()
            if adapter is not None:
                common["lora_path"] = adapter.name

        def parse(reply: Any, chunk: list[list[int]]) -> list[GenerateOutput]:
            outs = parse_reply(reply, chunk, routing)
            if self.adapters is None:
                return outs
            # every token came from the adapter the request named, whatever SGLang's label says now
            version = 0 if adapter is None else adapter.version
            return [dataclasses.replace(o, weight_version=version, token_versions=None) for o in outs]

        with self.servers.lock:
            self._inflight.update(rids)
        try:
            return self.pool.generate(
                prompts, params, fields=fields, common=common or None, parse=parse, on_token=on_token
            )
        finally:
            with self.servers.lock:
                self._inflight.difference_update(rids)
            if self.adapters is not None:
                self.adapters.release(adapter)

    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Push ``tensors`` as ``version`` (disk by default, see ``weight_update``) and check the engines. MoE
        experts go as checkpoints name them, one per expert: SGLang's loaders skip fused names without an
        error (:mod:`relax_rollout.engines.expert_names`). Serving LoRA (``lora``): ``tensors`` are the
        adapter's (:mod:`relax_core.lora`'s wire format), loaded as a new adapter by value whatever
        ``weight_update`` says (:mod:`relax_rollout.engines.sglang.lora`)."""
        if self.adapters is not None:
            self.adapters.update(tensors, version)
            return
        self.weights.update(tensors, version)

    def weights_checksum(self) -> str:
        """The engines' checksum: ``/weights_checksum`` of our engine server (the trainer's
        :func:`relax_core.dcs.checksum` of the same weights), else SGLang's own ``/weights_checker``
        (``sglang:`` + its digest over its fused parameters; engines must agree)."""
        try:
            return self.pool.weights_checksum()
        except NotImplementedError:
            pass
        sums = {
            m.url: (r or {}).get("per_engine_checksum")
            for m, r in self.servers.call_all("/weights_checker", {"action": "checksum"})
        }
        if len(set(sums.values())) != 1 or None in sums.values():
            raise RuntimeError(f"SGLang engines hold different weights: {sums}")
        return f"sglang:{next(iter(sums.values()))}"

    # -- control ----------------------------------------------------------------------------------
    def pause(self, mode: str = "abort") -> None:
        """``/pause_generation`` on every engine (``abort``, ``retract`` or ``in_place``)."""
        body = pause_request(mode)
        with self.servers.lock:
            self.servers.paused = mode
        self.servers.call_all("/pause_generation", body)

    def resume(self) -> None:
        """``/continue_generation`` on every engine."""
        with self.servers.lock:
            self.servers.paused = None
        self.servers.call_all("/continue_generation", {})

    pause_generation, continue_generation = pause, resume

    def abort(self, rid: str | None = None) -> None:
        """Abort request ``rid`` wherever it runs (an engine that does not hold it ignores it), or every
        request with ``rid=None``; aborted requests come back with finish reason ``abort``."""
        self.servers.call_all("/abort_request", abort_request(rid))

    # -- device memory (colocate) -----------------------------------------------------------------
    def release_memory(self, tags: list[str] | None = None) -> None:
        """``/release_memory_occupation`` on every engine: give the GPU memory of ``tags`` (default all:
        weights, KV cache, CUDA graphs) back while the trainer runs. The servers must run with
        ``--enable-memory-saver`` (:func:`relax_rollout.engine_factory.sglang_kwargs` adds it when the run
        offloads)."""
        self.servers.call_all("/release_memory_occupation", memory_request(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """``/resume_memory_occupation`` on every engine; released weights hold garbage until the next
        weight update, so resume ``weights``, update, then the rest (what the colocate loop does)."""
        self.servers.call_all("/resume_memory_occupation", memory_request(tags))

    # -- weights (self.weights, where each is documented) ----------------------------------------
    check_weight_version = _weights_method(SGLangWeights.check_version)
    update_weights_from_disk = _weights_method(SGLangWeights.from_disk)
    update_weights_from_tensor = _weights_method(SGLangWeights.from_tensor)
    connect_dcs = _weights_method(SGLangWeights.connect_dcs)
    update_weights_from_distributed = _weights_method(SGLangWeights.from_distributed)
    destroy_weights_update_group = _weights_method(SGLangWeights.leave_trainer_group)

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop supervising and end every engine process group (SIGTERM, SIGKILL after
        ``shutdown_grace_s``)."""
        s = self.servers
        with s.lock:
            if s.closed:
                return
            s.closed = True
            procs = list(self.launcher.procs)
        s.stop.set()
        self.lifecycle.wait_stopped()
        stop_processes(procs, self.shutdown_grace_s)
        self.weights.close()  # its engines are gone: only this side of the group is left
        self.launcher.release_nodes()
        with s.lock:
            for slot in s.slots:
                slot.state = "stopped" if slot.state != "failed" else slot.state
        s.pool.close()
        s.executor.shutdown(wait=False, cancel_futures=True)
        self._finalizer.detach()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
