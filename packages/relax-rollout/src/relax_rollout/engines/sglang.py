"""The ``sglang`` rollout engine: SGLang servers launched and supervised here, driven over HTTP as one pool.

Why: SGLang is the GPU inference engine; running it as ``python -m sglang.launch_server`` processes (one
per ``tp_size`` GPUs) keeps its CUDA state, crashes and memory out of the rollout role. It is tested
against the real SGLang (the version uv.lock pins) running on a CPU (:mod:`relax_rollout.engines.sglang_cpu`,
``pytest -m real_sglang``); our engine server (``relax_rollout.server``, through ``launch_cmd``) stands in
only for what a CPU SGLang cannot do (memory release, R3's routed experts) or be made to do on cue.

An :class:`SGLangEngine` is process supervision composed with an
:class:`~relax_rollout.engines.pool.EnginePool` of its servers:

- **Launch.** Engine ``k`` runs on GPUs ``[k*tp, (k+1)*tp)`` of ``CUDA_VISIBLE_DEVICES`` (or of
  ``gpu_ids``), in its own session (process group), its stdout/stderr appended to ``log_dir/engine{k}.log``.
  Ready means ``GET /health_generate`` answers 200: SGLang answers 503 while starting, then runs a
  one-token generation, so a 200 proves the scheduler serves. A process that exits during start-up fails
  the start at once with its log's tail. With ``gpus_per_node`` the engines past this node's GPUs run on
  the other nodes of the Ray cluster, started and supervised through a launcher actor there
  (:mod:`relax_rollout.engines.nodes`).
- **Supervision.** A background thread polls the processes every ``poll_interval_s``. An engine whose
  process exited (or that the pool marked failed: reset connections, 5xx, time-outs) is killed (its whole
  process group: SGLang's scheduler and detokenizer processes included) and relaunched on the same GPUs,
  at most ``max_restarts`` times; it rejoins the pool only after loading the current weights (see below).
  Past the bound it stays ``failed`` and the pool no longer uses it. Requests it held are re-issued on the
  other engines by the pool, so none is lost.
- **Generation.** ``/generate`` with ``input_ids``, ``rid`` (one per prompt, for ``abort(rid)``),
  ``return_logprob``; tokens and log-probs are read from ``meta_info.output_token_logprobs``
  (``[logprob, token_id, text]``, which includes the stop token), ``finish_reason.type`` and
  ``weight_version``. The tokenizer's EOS ids given at construction are added to ``stop_token_ids``, so
  generation stops where the in-process engine's would. Routed experts (R3): with ``record_routing`` the
  servers start with ``--enable-return-routed-experts`` and requests carry ``return_routed_experts``; the
  reply's base64 int32 ``meta_info.routed_experts`` becomes ``extra["routed_experts"]``,
  ``[prompt + generated - 1, layers, top_k]``. Media for VL/Omni models go in SGLang's ``image_data``,
  ``video_data`` and ``audio_data`` (``media=``, one dict per prompt); the prompt ids must then hold the
  model's media placeholders as SGLang's processor expects them (one per item, not expanded).
- **Control.** ``pause(mode)`` (``/pause_generation``: ``abort`` returns in-flight requests aborted,
  ``retract``/``in_place`` hold them; new requests wait) and ``resume()`` (``/continue_generation``);
  ``abort(rid)`` / ``abort()`` (``/abort_request`` with ``rid`` or ``abort_all``). A restarted engine is
  paused again when the others are.
- **Weights.** ``update_weights(tensors, version)``: through disk by default (the pool writes safetensors
  once, every engine loads them with ``/update_weights_from_disk``; the directory is kept so a restarted
  engine loads it before serving); with ``weight_update="distributed"`` over SGLang's weight group, no
  disk: this process is rank 0 of a group with every engine (``/init_weights_update_group``, formed at
  the first update and again whenever the engines changed) and broadcasts ``bucket_bytes`` buckets, each
  announced by ``/update_weights_from_distributed`` (``load_format="flattened_bucket"``; NCCL from CUDA
  tensors, gloo from host memory; :mod:`relax_rollout.engines.weight_group`), inside a weight-update
  session (``/begin_weight_update`` … ``/end_weight_update``, which SGLang 0.5.23 requires) with
  generation paused in ``retract`` mode, so no request decodes on half-updated weights. A restarted engine then waits,
  out of the pool, for the next update, which re-forms the group with it; an engine failing mid-broadcast
  is marked failed and the update retried once on the others. With ``weight_update="tensor"`` through
  ``/update_weights_from_tensor`` (colocated trainer: SGLang's ``serialized_named_tensors``, one base64
  ``ForkingPickler`` payload per TP rank, CUDA tensors travelling as IPC handles). A caller that
  broadcasts itself: ``connect_dcs`` (engine ``k`` joins ``/init_weights_update_group`` as ranks
  ``rank + k*tp ...``), then ``update_weights_from_distributed`` (names, dtypes, shapes) while it
  broadcasts. ``update_weights_from_disk(path, version)`` loads a checkpoint directory. After every
  update each engine's ``/model_info`` ``weight_version`` must equal the new version, else
  :class:`WeightVersionMismatch` names the engines. Weights that came as tensors, or from a caller's
  broadcast, cannot be given to a restarted engine: an engine that dies after such an update is left
  failed, saying so. An engine that does not carry out an update — HTTP 400 included, SGLang's answer to
  every failed load, after which its weights may be half-loaded — is failed and restarted; the update
  goes on with the others, and raises :class:`WeightUpdateFailed` when none took it.

SGLang's receiver takes each request's tensors from a ``broadcast(src=0)`` on the group, which is not
relax DCS's protocol (a store header, then buckets): a trainer's DCS ``WeightSender`` reaches SGLang through
the rollout role, which broadcasts on with ``weight_update="distributed"``; our engine server can also join
DCS itself (``connect_dcs(..., protocol="relax_dcs")``). Request and reply field names follow sgl-project/sglang
``python/sglang/srt/managers/io_struct.py`` (read at commit 001067fffe33, after v0.5.x, cross-checked with
the v0.5.x dataclasses), ``entrypoints/http_server.py`` (routes, reply bodies; ``/health`` and
``/health_generate`` answer 503 while the server starts), ``server_args.py`` (launch flags) and
``sampling/sampling_params.py``; the tests hold the field sets.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from relax_rollout.engines.base import GenerateOutput, SamplingParams, memory_request
from relax_rollout.engines.expert_names import unfuse_experts
from relax_rollout.engines.external import ServerError, http_json, matched_stop, model_info, top_logprobs
from relax_rollout.engines.pool import EnginePool, Member, PoolError

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
MEDIA_FIELDS = ("image_data", "video_data", "audio_data")
# launch flags the engine sets itself; server_args may not override them
RESERVED_FLAGS = {
    "--model-path",
    "--model",
    "--host",
    "--port",
    "--tp-size",
    "--tensor-parallel-size",
    "--tp",
}
WEIGHT_UPDATES = ("disk", "tensor", "distributed")
INSTALL_HINT = "the sglang engine needs `pip install 'relax-rollout[sglang]'` (and a GPU)"


class EngineStartError(RuntimeError):
    """An engine process exited or did not become ready during start-up (the message has its log's tail)."""


class WeightVersionMismatch(RuntimeError):
    """After a weight update, some engines report another ``weight_version`` than the one pushed."""


@dataclass(frozen=True)
class RoutingInfo:
    """What a routed-experts reply is reshaped with (from the model's ``config.json``; None: unknown)."""

    num_layers: int | None
    top_k: int | None


# -- requests (pure functions: what goes on the wire) ----------------------------------------------------
def flag_args(server_args: dict[str, Any]) -> list[str]:
    """``{"context_length": 32768, "enable_metrics": True}`` → ``--context-length 32768 --enable-metrics``:
    True is a bare flag, False/None leave it out, lists give several values, dicts are passed as JSON."""
    out: list[str] = []
    for key, value in server_args.items():
        flag = key if key.startswith("--") else "--" + key.replace("_", "-")
        if flag in RESERVED_FLAGS:
            raise ValueError(f"sglang_server_args may not set {flag}: the engine sets it (one per engine)")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def launch_command(
    model_path: str,
    host: str,
    port: int,
    tp_size: int = 1,
    dtype: str = "auto",
    mem_fraction_static: float | None = None,
    server_args: dict[str, Any] | None = None,
    record_routing: bool = False,
    python: str | None = None,
) -> list[str]:
    """``python -m sglang.launch_server`` for one engine (flags of SGLang's ``server_args.py``)."""
    cmd = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
           "--host", host, "--port", str(port), "--tp-size", str(tp_size), "--dtype", dtype]  # fmt: skip
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    extra = dict(server_args or {})
    if record_routing:
        extra.setdefault("enable_return_routed_experts", True)
    return cmd + flag_args(extra)


def fill_template(template: list[str], **values: Any) -> list[str]:
    """``launch_cmd`` with ``{port}``, ``{host}``, ``{model_path}``, ``{tp_size}``, ``{dtype}``,
    ``{engine_index}`` filled in."""
    try:
        return [str(part).format(**values) for part in template]
    except (KeyError, IndexError) as e:
        raise ValueError(f"launch_cmd has an unknown placeholder {e}; known: {sorted(values)}") from None


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


def init_group_request(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str,
    protocol: str = "sglang",
) -> dict[str, Any]:  # fmt: skip
    """SGLang's ``InitWeightsUpdateGroupReqInput``; ``protocol="relax_dcs"`` adds the field that makes our
    engine server join a relax DCS sender instead (SGLang has no such group)."""
    body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}  # fmt: skip
    if protocol != "sglang":
        body["protocol"] = protocol
    return body


def distributed_update_request(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    version: int | None,
    group_name: str,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    load_format: str | None = None,
) -> dict[str, Any]:
    """SGLang's ``UpdateWeightsFromDistributedReqInput`` (``weight_version`` is a string there; None leaves
    the engine's version as it is: every bucket but the last of an update)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
    body = {"names": list(names), "dtypes": [_dtype_name(d) for d in dtypes],
            "shapes": [[int(x) for x in s] for s in shapes], "group_name": group_name,
            "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}  # fmt: skip
    if version is not None:
        body["weight_version"] = str(version)
    if load_format is not None:
        body["load_format"] = load_format
    return body


def tensor_metadata(named_tensors: Iterable[tuple[str, Any]]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of ``named_tensors``, as ``/update_weights_from_distributed`` wants them."""
    names, dtypes, shapes = [], [], []
    for name, t in named_tensors:
        names.append(name)
        dtypes.append(_dtype_name(t.dtype))
        shapes.append(list(t.shape))
    return names, dtypes, shapes


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")  # SGLang resolves it with getattr(torch, name)


def disk_update_request(
    model_path: str,
    version: int,
    abort_all_requests: bool = False,
    flush_cache: bool = True,
    load_format: str | None = None,
) -> dict[str, Any]:
    """SGLang's ``UpdateWeightFromDiskReqInput``."""
    body = {"model_path": model_path, "weight_version": str(version), "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache}  # fmt: skip
    if load_format is not None:
        body["load_format"] = load_format
    return body


def _on_device(named: list[tuple[str, Any]], device: Any) -> list[tuple[str, Any]]:
    """``named`` with every tensor on ``device`` (itself where it is there already), the copies finished
    before the engine maps them: a copy between GPUs runs on a stream, and an IPC handle is handed over
    at once."""
    out = [(n, t if device is None or t.device == device else t.to(device)) for n, t in named]
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return out


def serialize_named_tensors(named_tensors: list[tuple[str, Any]]) -> str:
    """One TP rank's entry of ``serialized_named_tensors``: base64 of a ``ForkingPickler`` dump of the
    ``(name, tensor)`` list, CUDA tensors travelling as IPC handles (the engine must be on this node).

    The handle names its GPU by UUID, not by index, as SGLang's ``monkey_patch_torch_reductions`` does on
    both sides: the engine's ``CUDA_VISIBLE_DEVICES`` differs from the sender's, so an index would open
    another GPU's memory (SGLang's receiver maps a UUID back to its own index). Host tensors are refused:
    their shared-memory handles are file descriptors, which cannot cross an HTTP request into an unrelated
    process."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions

    host = [n for n, t in named_tensors if not t.is_cuda]
    if host:
        raise ValueError(
            f"weight_update='tensor' hands CUDA IPC handles to SGLang; {len(host)} tensors are in host memory "
            f"({', '.join(host[:3])}{', …' if len(host) > 3 else ''}): use weight_update='distributed' or 'disk'"
        )

    def reduce_by_uuid(t: Any) -> Any:
        rebuild, args = reductions.reduce_tensor(t)
        if t.is_cuda:  # (SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX: torch's rebuild_cuda_tensor signature)
            args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
        return rebuild, args

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table = {**ForkingPickler._extra_reducers, torch.Tensor: reduce_by_uuid,
                              torch.nn.Parameter: reduce_by_uuid}  # fmt: skip
    pickler.dump(list(named_tensors))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def tensor_update_request(
    named_tensors: list[tuple[str, Any]],
    version: int,
    devices: list[Any] | int = 1,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
    load_format: str | None = None,
) -> dict[str, Any]:
    """SGLang's ``UpdateWeightsFromTensorReqInput``: one serialized entry per TP rank (rank ``r`` reads
    entry ``r`` and loads the whole tensors into its shard).

    ``devices``: the CUDA device of each TP rank of the engine (as this process numbers them): rank ``r``'s
    entry holds tensors on ``devices[r]`` (copied there where they live elsewhere), so each rank maps
    memory of its own GPU instead of every rank reading rank 0's across the bus. An int: that many ranks,
    the tensors where they are (one GPU per engine, or a caller that placed them)."""
    named = list(named_tensors)
    if isinstance(devices, int):
        payloads = [serialize_named_tensors(named)] * devices
    else:
        payloads = [serialize_named_tensors(_on_device(named, d)) for d in devices]
    body = {"serialized_named_tensors": payloads, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests, "weight_version": str(version)}  # fmt: skip
    if load_format is not None:
        body["load_format"] = load_format
    return body


def pause_request(mode: str = "abort") -> dict[str, Any]:
    """SGLang's ``PauseGenerationReqInput``."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES} (got {mode!r})")
    return {"mode": mode}


def abort_request(rid: str | None = None) -> dict[str, Any]:
    """SGLang's ``AbortReq``: one request id, or every request."""
    return {"abort_all": True} if rid is None else {"rid": rid}


# -- replies -----------------------------------------------------------------------------------------
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


def _version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):  # SGLang's default weight_version is "default"
        return 0


def parse_reply(
    results: Any, prompts: list[list[int]], routing: RoutingInfo | None = None, routed_start: int = 0
) -> list[GenerateOutput]:
    """A batch ``/generate`` reply as our outputs: tokens and log-probs from
    ``meta_info.output_token_logprobs`` (checked against ``output_ids`` when both are there),
    ``finish_reason.type``, ``weight_version``, and ``extra`` = ``rid``, ``cached_tokens`` and (when the
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
        version = _version(meta.get("weight_version"))
        outs.append(GenerateOutput(token_ids, log_probs, str(kind or "abort"), version, extra,
                                   top_logprobs(meta), matched_stop(meta)))  # fmt: skip
    return outs


def checkpoint_config(model_path: str) -> dict[str, Any] | None:
    """``model_path/config.json``; None for a path that is not a local directory (a hub id)."""
    cfg_file = Path(model_path) / "config.json"
    return json.loads(cfg_file.read_text()) if cfg_file.is_file() else None


def served_prefix(cfg: dict[str, Any] | None) -> str:
    """What the served checkpoint (its ``config.json``) puts before the trainer's weight names: ``thinker.``
    for a whole Qwen3-Omni model (SGLang serves Qwen3-Omni only as the whole model,
    ``Qwen3OmniMoeForConditionalGeneration``, whose loader reads the hub's ``thinker.*`` names; the trainer
    holds the thinker alone)."""
    arch = (cfg or {}).get("architectures") or []
    return "thinker." if "Qwen3OmniMoeForConditionalGeneration" in arch else ""


def model_routing(model_path: str) -> RoutingInfo | None:
    """The MoE shape from ``model_path/config.json`` (or its ``text_config``): None for a dense model,
    unknown fields for a path that is not a local directory (a hub id)."""
    cfg = checkpoint_config(model_path)
    if cfg is None:
        return RoutingInfo(None, None)
    nested = [cfg.get("text_config") or {}, (cfg.get("thinker_config") or {}).get("text_config") or {}]
    for c in (cfg, *nested):
        k = c.get("num_experts_per_tok") or c.get("moe_topk")
        if k:
            return RoutingInfo(c.get("num_hidden_layers"), int(k))
    return None


# -- processes ---------------------------------------------------------------------------------------
def _failures(futs: list[tuple[Any, Any]]) -> list[tuple[Any, Exception]]:
    """The engines that did not carry out a weight request sent to several, ``(key, future)`` each, with
    their errors. SGLang answers a weight update it could not finish with HTTP 400 ``{"success": false}``
    after it may have loaded part of it (a broadcast that stopped midway; a disk load whose roll-back
    re-reads the new directory), so a refusal is that engine's failure like a 5xx, a reset connection or a
    time-out: it must not serve until it is restarted with weights known to be whole."""
    failed: list[tuple[Any, Exception]] = []
    for key, f in futs:
        try:
            f.result()
        except (ServerError, OSError) as e:
            failed.append((key, e))
    return failed


def _in_thread(fn: Callable[[], Any], name: str) -> Future:
    """``fn()`` in a daemon thread of its own, as a future: a collective stuck for want of a peer can be
    left behind (it ends at its group's time-out) without holding up a pool's worker."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 — handed to the caller through the future
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def _until_done_or_refused(local: Future, requests: list[Future]) -> bool:
    """Wait for ``local`` (this process's part of a collective) unless one of the engines' ``requests``
    fails first: an engine that refused never joins, and the collective would wait for it until the
    group's time-out. True when ``local`` was left waiting."""
    while not local.done():
        pending = [f for f in requests if not f.done()]
        wait([local, *pending], return_when=FIRST_COMPLETED)
        if not local.done() and _failures([(None, f) for f in requests if f.done()]):
            return True
    return False


def _abort_collectives(pg: Any) -> None:
    """Release a collective left waiting on ``pg``: NCCL's kernels would hold the GPU until the time-out
    (torch's abort is NCCL-only; a gloo collective ends at its time-out in the thread left behind)."""
    if pg is None:
        return
    try:
        import torch.distributed.distributed_c10d as c10d

        if "nccl" in str(c10d.get_backend(pg)).lower():
            c10d._abort_process_group(pg)
    except Exception as e:  # noqa: BLE001 — best effort: the group is dropped either way
        logger.debug("aborting the weight group's collectives: %s", e)


class WeightUpdateFailed(PoolError):
    """No engine took a weight update (each one's error is in the message); they are restarted with the
    last weights that loaded everywhere, and the engine's version stays the previous one."""


@dataclass
class _WeightGroup:
    """The group ``weight_update="distributed"`` broadcasts on: this process is rank 0, engine ``i`` of
    ``urls`` ranks ``1 + i*tp_size ...``."""

    pg: Any
    name: str
    urls: tuple[str, ...]
    backend: str


class _GroupBroken(RuntimeError):
    """A weight-group rendezvous or broadcast failed (an engine died or refused): re-form and retry."""


@dataclass
class EngineProcess:
    """One supervised engine slot: its GPUs stay the same across restarts."""

    index: int
    gpus: list[str]
    log_path: Path
    fixed_port: int | None = None
    proc: subprocess.Popen | None = None
    url: str | None = None
    member_id: str | None = None
    state: str = "starting"
    """starting, running, restarting, waiting (restarted, joins with the next weight update), failed,
    stopped"""
    restarts: int = 0
    error: str | None = None
    """Why it last failed (kept after a successful restart)."""
    pids: list[int] = field(default_factory=list)
    node: Any = None
    """The :class:`~relax_rollout.engines.nodes.NodeGPUs` of another node it runs on; None: this node."""

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "gpus": self.gpus, "url": self.url, "state": self.state,
                "node_id": self.node.node_id if self.node is not None else None,
                "pid": self.proc.pid if self.proc else None, "restarts": self.restarts, "error": self.error,
                "member_id": self.member_id, "log_path": str(self.log_path), "pids": list(self.pids)}  # fmt: skip


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("0.0.0.0", "") else "127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: the group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` is left."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every process group, wait up to ``grace_s`` for the leaders to exit and their groups to
    empty, SIGKILL what is left, and reap the leaders. Processes on other nodes
    (:class:`~relax_rollout.engines.nodes.RemoteProcess`) are stopped the same way by their node's launcher."""
    for p in procs:
        if getattr(p, "remote", False):
            p.stop(grace_s)
    procs = [p for p in procs if not getattr(p, "remote", False)]
    live = [p for p in procs if p.poll() is None or group_alive(p.pid)]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None or group_alive(p.pid) for p in live):
        time.sleep(0.05)
    for p in live:
        if p.poll() is None or group_alive(p.pid):
            _signal_group(p, signal.SIGKILL)
    for p in live:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("engine process %d did not exit after SIGKILL", p.pid)


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


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
    (:mod:`relax_rollout.engines.nodes`); an engine on another node binds that node's address and
    requires a token (one is made when none is given); weights then go through ``weights_dir``, which
    every node must see at the same path."""

    features = frozenset({"top_logprobs", "stop"})
    """SGLang's ``top_logprobs_num`` and ``stop``, passed on."""

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
        **_ignored: Any,  # pad_token_id, ...: the servers own their model and tokenizer
    ) -> None:
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
        self.model_path, self.num_engines, self.tp_size = model_path, num_engines, tp_size
        self.prefix = served_prefix(served)
        """Put before every weight name of an update (``thinker.`` when serving a whole Qwen3-Omni)."""
        self.mem_fraction_static, self.dtype, self.host = mem_fraction_static, dtype, host
        self.server_args = dict(server_args or {})
        flag_args(self.server_args)  # reject reserved flags now, not in a child process
        self.launch_cmd, self.python, self.env = launch_cmd, python, dict(env or {})
        self.startup_timeout_s, self.max_restarts = startup_timeout_s, max_restarts
        self.poll_interval_s, self.shutdown_grace_s = poll_interval_s, shutdown_grace_s
        self.weight_update, self.request_timeout_s = weight_update, request_timeout_s
        self.bucket_bytes = bucket_bytes
        """``weight_update="distributed"``: at most this many bytes a broadcast (one dtype each)."""
        self.token = token or self.server_args.get("api_key") or self.server_args.get("--api-key")
        self.eos_token_ids = tuple(eos_token_ids or ())
        self.deterministic = bool(
            self.server_args.get("enable_deterministic_inference")
            or self.server_args.get("--enable-deterministic-inference")
        )
        """SGLang honours a request's ``sampling_seed`` only with ``--enable-deterministic-inference``."""
        self._warned_seed = False
        self.routing: RoutingInfo | None = None
        if record_routing:
            self.routing = model_routing(model_path)
            if self.routing is None:
                logger.warning(
                    "record_routing: %s is not a Mixture-of-Experts model; no experts recorded", model_path
                )
        if "SGLANG_RETURN_ORIGINAL_LOGPROB" in {**os.environ, **self.env}:
            logger.warning("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang then returns log-probs before the "
                           "temperature, not of the distribution sampled from")  # fmt: skip
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="relax-sglang-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        places = self._places(gpu_ids, gpus_per_node)
        self.slots = [
            EngineProcess(
                k,
                gpus,
                self.log_dir / f"engine{k}.log",
                None if base_port is None else base_port + k,
                node=node,
            )  # fmt: skip
            for k, (node, gpus) in enumerate(places)
        ]
        self._launchers: dict[str, Any] = {}
        if any(slot.node is not None for slot in self.slots):
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
            if self.token is None:  # they listen on their node's address, not loopback
                self.token = secrets.token_urlsafe(24)
                self.server_args["api_key"] = self.token
        self._lock = threading.RLock()
        self._closed = False
        self._paused: str | None = None
        self._group: str | None = None
        self._wg: _WeightGroup | None = None  # weight_update="distributed": the group, formed lazily
        self._wg_lock = threading.Lock()
        self._inflight: set[str] = set()
        self._stop = threading.Event()
        self._procs: list[subprocess.Popen] = []  # every process ever started (for the finalizer)
        self._finalizer = weakref.finalize(self, stop_processes, self._procs, 5.0)
        self._exec = ThreadPoolExecutor(
            max_workers=max(4, 2 * num_engines), thread_name_prefix="relax-sglang"
        )
        self.pool = EnginePool(
            token=self.token, timeout_s=request_timeout_s, join_timeout_s=max(60.0, request_timeout_s / 10),
            weights_dir=weights_dir, on_failure=self._on_pool_failure,
        )  # fmt: skip
        self._start()
        self._initial_version = self.pool.weight_version  # what a fresh engine reports
        self._supervisor = threading.Thread(
            target=self._supervise, name="relax-sglang-supervisor", daemon=True
        )
        self._supervisor.start()

    # -- start-up ---------------------------------------------------------------------------------
    def _places(
        self, gpu_ids: list[int | str] | None, gpus_per_node: int | None
    ) -> list[tuple[Any, list[str]]]:
        """(node or None for this one, GPUs) of every engine: node by node, ``tp_size`` GPUs each."""
        need = self.num_engines * self.tp_size
        if gpu_ids is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is None or not visible.strip():
                gpu_ids = list(range(need if gpus_per_node is None else gpus_per_node))
            else:
                gpu_ids = [g.strip() for g in visible.split(",") if g.strip()]
        gpus = [str(g) for g in gpu_ids]
        if gpus_per_node is None:
            if len(gpus) < need:
                raise ValueError(
                    f"{self.num_engines} engines × {self.tp_size} GPUs need {need} GPUs; only {len(gpus)} "
                    f"visible ({','.join(gpus)}): lower the engines, or spread them over a Ray cluster's nodes "
                    "(gpus_per_node)"
                )
            return [(None, gpus[k * self.tp_size : (k + 1) * self.tp_size]) for k in range(self.num_engines)]
        from relax_rollout.engines.nodes import cluster_gpus

        nodes = cluster_gpus(gpus_per_node, gpus)
        places = [
            (None if n.node_id is None else n, n.gpus[i : i + self.tp_size])
            for n in nodes
            for i in range(0, len(n.gpus) - self.tp_size + 1, self.tp_size)
        ]
        if len(places) < self.num_engines:
            raise ValueError(
                f"{self.num_engines} engines × {self.tp_size} GPUs need {need} GPUs; the Ray cluster's "
                f"{len(nodes)} nodes give {len(places) * self.tp_size} ({gpus_per_node} per node at most, this "
                "node's visible ones): add nodes or lower the engines"
            )
        return places[: self.num_engines]

    def _start(self) -> None:
        try:
            for slot in self.slots:
                self._launch(slot)
            futs = [self._exec.submit(self._wait_ready, slot, self.startup_timeout_s) for slot in self.slots]
            errors = []
            for slot, f in zip(self.slots, futs):
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 — reported all together below
                    errors.append(f"engine {slot.index}: {e}")
            if errors:
                raise EngineStartError("SGLang engines failed to start:\n" + "\n".join(errors))
            for slot in self.slots:
                self._join(slot)
        except BaseException:
            self.close()
            raise

    def _command(self, slot: EngineProcess, port: int, host: str) -> list[str]:
        if self.launch_cmd is not None:
            return fill_template(self.launch_cmd, port=port, host=host, model_path=self.model_path,
                                 tp_size=self.tp_size, dtype=self.dtype, engine_index=slot.index,
                                 token=self.token or "")  # fmt: skip
        return launch_command(self.model_path, host, port, self.tp_size, self.dtype,
                              self.mem_fraction_static, self.server_args, self.routing is not None,
                              self.python)  # fmt: skip

    def _launch(self, slot: EngineProcess) -> None:
        if slot.node is not None:
            self._launch_remote(slot)
            return
        port = slot.fixed_port if slot.fixed_port is not None else _free_port(self.host)
        cmd = self._command(slot, port, self.host)
        env = {**os.environ, **self.env, "CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)}
        with self._lock:
            if self._closed:
                raise EngineStartError("the engine is closed")
            with open(slot.log_path, "ab") as log:
                log.write(self._header(slot, cmd).encode())
                log.flush()
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)  # fmt: skip
            self._procs.append(proc)
            connect = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
            slot.proc, slot.url, slot.member_id = proc, f"http://{connect}:{port}", None
            slot.pids.append(proc.pid)
        logger.info(
            "engine %d: started pid %d on GPUs %s, %s", slot.index, proc.pid, ",".join(slot.gpus), slot.url
        )

    def _header(self, slot: EngineProcess, cmd: list[str]) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        where = f" on node {slot.node.node_id} ({slot.node.ip})" if slot.node is not None else ""
        shown = " ".join("***" if self.token and part == self.token else part for part in cmd)
        return (f"=== {stamp} relax: launch #{len(slot.pids) + 1} of engine {slot.index}{where} on GPUs "
                f"{','.join(slot.gpus)}: {shown}\n")  # fmt: skip

    def _launch_remote(self, slot: EngineProcess) -> None:
        """``_launch`` on another node, through its :class:`~relax_rollout.engines.nodes.NodeLauncher`."""
        import ray

        from relax_rollout.engines.nodes import RemoteProcess, launcher_on

        node = slot.node
        launcher = self._launchers.get(node.node_id)
        if launcher is None:
            launcher = self._launchers[node.node_id] = launcher_on(node)
        ip = ray.get(launcher.ip.remote(), timeout=120)
        shared = ([str(self.pool.weights_root)] if self.weight_update == "disk" else []) + (
            [self.model_path] if os.path.exists(self.model_path) else []
        )
        missing = ray.get(launcher.missing.remote(shared), timeout=60)
        if missing:
            raise EngineStartError(
                f"node {node.node_id} ({ip}) does not see {', '.join(missing)}: the model and the weights "
                "directory must be at the same paths on every node (a shared filesystem)"
            )
        port = slot.fixed_port or ray.get(launcher.free_port.remote(ip), timeout=60)
        cmd = self._command(slot, port, ip)
        env = {**self.env, "CUDA_VISIBLE_DEVICES": ",".join(slot.gpus)}
        with self._lock:
            if self._closed:
                raise EngineStartError("the engine is closed")
            pid = ray.get(
                launcher.start.remote(cmd, env, str(slot.log_path), self._header(slot, cmd)), timeout=120
            )
            proc = RemoteProcess(launcher, node, pid)
            self._procs.append(proc)
            slot.proc, slot.url, slot.member_id = proc, f"http://{ip}:{port}", None
            slot.pids.append(pid)
        logger.info("engine %d: started pid %d on node %s, GPUs %s, %s", slot.index, pid, node.node_id,
                    ",".join(slot.gpus), slot.url)  # fmt: skip

    def _tail(self, slot: EngineProcess, lines: int = 30) -> str:
        """The end of an engine's log, read on its node."""
        launcher = self._launchers.get(slot.node.node_id) if slot.node is not None else None
        if launcher is None:
            return _log_tail(slot.log_path, lines)
        import ray

        try:
            return ray.get(launcher.tail.remote(str(slot.log_path), lines), timeout=30)
        except Exception as e:  # noqa: BLE001 — a report, not a failure of its own
            return f"(no log from node {slot.node.node_id}: {e})"

    def _wait_ready(self, slot: EngineProcess, timeout_s: float) -> None:
        """Until ``/health_generate`` answers 200 (``/health`` for a server without it)."""
        deadline = time.monotonic() + timeout_s
        path = "/health_generate"
        assert slot.proc is not None and slot.url is not None
        while True:
            if self._stop.is_set():
                raise EngineStartError("the engine is closing")
            rc = slot.proc.poll()
            if rc is not None:
                raise EngineStartError(
                    f"process {slot.proc.pid} exited with code {rc} during start-up; the end of "
                    f"{slot.log_path}:\n{self._tail(slot)}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStartError(
                    f"not ready after {timeout_s:.0f}s ({slot.url}{path}); the end of {slot.log_path}:\n"
                    f"{self._tail(slot)}"
                )
            try:
                http_json(slot.url, path, None, self.token, min(30.0, max(1.0, left)))
                return
            except ServerError as e:
                if e.status == 404 and path != "/health":
                    path = "/health"
                    continue
                if e.status < 500:
                    raise EngineStartError(f"{slot.url}{path} answered HTTP {e.status}: {e}") from None
            except OSError:  # not listening yet (refused), or the probe timed out
                pass
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    def _join(self, slot: EngineProcess) -> None:
        assert slot.url is not None
        member = self.pool.add(slot.url, kind="startup", handle=slot.index, protected=True)
        with self._lock:
            slot.member_id, slot.state = member.id, "running"  # error: why it last failed, if ever
            paused = self._paused
        if paused is not None:  # the others are paused: so is a newcomer
            self._call(slot.url, "/pause_generation", pause_request(paused))

    # -- supervision ------------------------------------------------------------------------------
    def _on_pool_failure(self, member: Member) -> None:
        logger.warning("engine %s (%s) failed in the pool: %s", member.id, member.url, member.error)

    def _supervise(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            for slot in self.slots:
                try:
                    self._check(slot)
                except Exception:  # noqa: BLE001 — the supervisor must keep running
                    logger.exception("engine %d: supervision failed", slot.index)

    def _check(self, slot: EngineProcess) -> None:
        with self._lock:
            if self._closed or slot.state != "running" or slot.proc is None:
                return
            rc = slot.proc.poll()
            member = self.pool.get(slot.member_id) if slot.member_id else None
            if rc is not None:
                reason = f"process {slot.proc.pid} exited with code {rc}"
            elif member is not None and member.state == "failed":
                reason = f"unhealthy ({member.error})"
            else:
                return
            slot.state, slot.error = "restarting", reason
        logger.warning(
            "engine %d: %s; the end of %s:\n%s",
            slot.index,
            reason,
            slot.log_path,
            self._tail(slot, 10),
        )
        if member is not None:
            self.pool.mark_failed(member.id, reason)
        threading.Thread(target=self._restart, args=(slot, member), name=f"relax-sglang-restart-{slot.index}",
                         daemon=True).start()  # fmt: skip

    def _restart(self, slot: EngineProcess, old: Member | None) -> None:
        while True:
            if slot.proc is not None:
                stop_processes([slot.proc], self.shutdown_grace_s)  # the rest of its process group too
            with self._lock:
                if self._closed:
                    slot.state = "stopped"
                    return
                if slot.restarts >= self.max_restarts:
                    slot.state = "failed"
                    slot.error = f"{slot.error}; not restarted again (max_restarts={self.max_restarts})"
                    logger.error("engine %d failed for good: %s", slot.index, slot.error)
                    return
                slot.restarts += 1
            try:
                self._launch(slot)
                self._wait_ready(slot, self.startup_timeout_s)
                if self.pool.weights_path is None and self.pool.weight_version != self._initial_version:
                    if self.weight_update == "distributed":  # the next update re-forms the group with it
                        with self._lock:
                            slot.state = "waiting"
                        if old is not None:
                            try:
                                self.pool.retire(old.id)
                            except PoolError:
                                pass
                        logger.info("engine %d restarted (%d/%d) at %s; it serves after the next weight "
                                    "update", slot.index, slot.restarts, self.max_restarts, slot.url)  # fmt: skip
                        return
                    raise PoolError(
                        f"the current weights (version {self.pool.weight_version}) came over NCCL or as tensors "
                        "and cannot be given to a restarted engine; it rejoins after the next update from disk "
                        "(update_weights with weight_update='disk', or update_weights_from_disk)"
                    )
                self._join(slot)
            except Exception as e:  # noqa: BLE001 — try again within the bound
                with self._lock:
                    slot.error = f"restart {slot.restarts} failed: {e}"
                    closed = self._closed
                logger.warning("engine %d: %s", slot.index, slot.error)
                if closed or isinstance(e, PoolError) and "cannot be given" in str(e):
                    if slot.proc is not None:
                        stop_processes([slot.proc], self.shutdown_grace_s)
                    with self._lock:
                        slot.state = "stopped" if closed else "failed"
                    return
                continue
            if old is not None:
                try:
                    self.pool.retire(old.id, replaced_by=slot.member_id)
                except PoolError:
                    pass
            logger.info(
                "engine %d restarted (%d/%d) at %s", slot.index, slot.restarts, self.max_restarts, slot.url
            )
            return

    # -- introspection ----------------------------------------------------------------------------
    def engines(self) -> list[dict[str, Any]]:
        """Every engine slot: index, gpus, url, state, pid, restarts, error, member_id, log_path, pids."""
        with self._lock:
            return [s.to_dict() for s in self.slots]

    @property
    def urls(self) -> list[str]:
        """The URLs of the engines serving now."""
        return [m.url for m in self.pool.active()]

    def inflight_rids(self) -> set[str]:
        """Request ids sent by :meth:`generate` and not answered yet (what :meth:`abort` can target)."""
        with self._lock:
            return set(self._inflight)

    # -- HTTP helpers -----------------------------------------------------------------------------
    def _call(self, url: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        return http_json(url, path, body, self.token, timeout_s or self.request_timeout_s, 1, 0.1)

    def _all(
        self, path: str, body: Any | Callable[[int, Member], Any] = None, timeout_s: float | None = None
    ) -> list[tuple[Member, Any]]:
        """``path`` on every active engine concurrently (``body(i, member)`` for a per-engine body); raises
        the first error after all answered."""
        members = self.pool.active()
        if not members:
            raise PoolError(f"no active SGLang engine for {path}: {self.engines()}")
        futs = [
            (m, self._exec.submit(self._call, m.url, path, body(i, m) if callable(body) else body, timeout_s))
            for i, m in enumerate(members)
        ]
        out, error = [], None
        for m, f in futs:
            try:
                out.append((m, f.result()))
            except Exception as e:  # noqa: BLE001 — re-raised after every engine answered
                error = error or e
                logger.warning("engine %s (%s): %s failed: %s", m.id, m.url, path, e)
        if error is not None:
            raise error
        return out

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
    ) -> list[GenerateOutput]:
        """One output per prompt, re-issued on other engines when one fails. ``rids``: request ids (default
        fresh ones; see :meth:`inflight_rids`); ``media`` (alias ``mm``): per prompt None or a dict of
        ``image_data``/``video_data``/``audio_data`` items; ``return_routed_experts``: default
        ``record_routing``."""
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
                logger.warning("SGLang ignores sampling seeds unless launched with --enable-deterministic-inference "
                               "(sglang_server_args: {enable_deterministic_inference: true}): generation is not "
                               "reproducible; the seeds are not sent")  # fmt: skip
            params = dataclasses.replace(params, seed=None)
        routing = self.routing

        def parse(reply: Any, chunk: list[list[int]]) -> list[GenerateOutput]:
            return parse_reply(reply, chunk, routing)

        with self._lock:
            self._inflight.update(rids)
        try:
            return self.pool.generate(prompts, params, fields=fields,
                                      common={"return_routed_experts": True} if routed else None, parse=parse)  # fmt: skip
        finally:
            with self._lock:
                self._inflight.difference_update(rids)

    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Push ``tensors`` as ``version`` (disk by default, see ``weight_update``) and check the engines. MoE
        experts go as checkpoints name them, one per expert: SGLang's loaders skip fused names without an
        error (:mod:`relax_rollout.engines.expert_names`)."""
        if self.weight_update == "tensor":
            self.update_weights_from_tensor(list(tensors.items()), version)
            return
        if self.weight_update == "distributed":
            self._update_distributed(self._served_names(tensors.items()), version)
            return
        self.pool.update_weights(dict(self._served_names(tensors.items())), version)
        self.check_weight_version(version)

    def _served_names(self, named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The trainer's tensors as the served checkpoint names them: MoE experts one per expert
        (:mod:`relax_rollout.engines.expert_names`), under :attr:`prefix`."""
        p = self.prefix
        return [(n if n.startswith(p) else p + n, t) for n, t in unfuse_experts(named)]

    def weights_checksum(self) -> str:
        """The engines' checksum: ``/weights_checksum`` of our engine server (the trainer's
        :func:`relax_core.dcs.checksum` of the same weights), else SGLang's own ``/weights_checker``
        (``sglang:`` + its digest over its fused parameters; engines must agree)."""
        try:
            return self.pool.weights_checksum()
        except NotImplementedError:
            pass
        sums = {m.url: (r or {}).get("per_engine_checksum") for m, r in
                self._all("/weights_checker", {"action": "checksum"})}  # fmt: skip
        if len(set(sums.values())) != 1 or None in sums.values():
            raise RuntimeError(f"SGLang engines hold different weights: {sums}")
        return f"sglang:{next(iter(sums.values()))}"

    # -- control ----------------------------------------------------------------------------------
    def pause(self, mode: str = "abort") -> None:
        """``/pause_generation`` on every engine (``abort``, ``retract`` or ``in_place``)."""
        body = pause_request(mode)
        with self._lock:
            self._paused = mode
        self._all("/pause_generation", body)

    def resume(self) -> None:
        """``/continue_generation`` on every engine."""
        with self._lock:
            self._paused = None
        self._all("/continue_generation", {})

    pause_generation, continue_generation = pause, resume

    def abort(self, rid: str | None = None) -> None:
        """Abort request ``rid`` wherever it runs (an engine that does not hold it ignores it), or every
        request with ``rid=None``; aborted requests come back with finish reason ``abort``."""
        self._all("/abort_request", abort_request(rid))

    # -- device memory (colocate) -----------------------------------------------------------------
    def release_memory(self, tags: list[str] | None = None) -> None:
        """``/release_memory_occupation`` on every engine: give the GPU memory of ``tags`` (default all:
        weights, KV cache, CUDA graphs) back while the trainer runs. The servers must run with
        ``--enable-memory-saver`` (:func:`engine_kwargs` adds it when the run offloads)."""
        self._all("/release_memory_occupation", memory_request(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """``/resume_memory_occupation`` on every engine; released weights hold garbage until the next
        weight update, so resume ``weights``, update, then the rest (what the colocate loop does)."""
        self._all("/resume_memory_occupation", memory_request(tags))

    # -- weights ----------------------------------------------------------------------------------
    def check_weight_version(self, version: int) -> None:
        """Every serving engine's ``/model_info`` must report ``weight_version`` == ``version``."""
        wrong = []
        members = self.pool.active()
        if not members:
            raise PoolError(f"no active SGLang engine to check weight version {version}: {self.engines()}")
        futs = [(m, self._exec.submit(model_info, m.url, self.token, self.request_timeout_s)) for m in members]
        for m, f in futs:
            got = f.result().get("weight_version")
            if str(got) != str(version):
                wrong.append(f"{m.id} ({m.url}) holds {got!r}")
        if wrong:
            raise WeightVersionMismatch(
                f"weight version {version} expected after the update, but " + "; ".join(wrong)
            )

    def _update_all(self, path: str, body: Any, urls: list[str] | None = None) -> None:
        """A weight update on every engine (or on ``urls``): one that fails it (refused, 5xx, died, timed
        out; see :func:`_failures`) is marked failed, the supervisor restarts it, and the others go on;
        :class:`WeightUpdateFailed` when none took it."""
        urls = [m.url for m in self.pool.active()] if urls is None else urls
        failed = self._each(urls, path, body)
        if urls and len(failed) == len(urls):
            raise WeightUpdateFailed(f"{path}: no engine took the update ({'; '.join(failed.values())})")
        if not self.pool.active():
            raise PoolError(f"{path}: no engine left serving: {self.engines()}")

    def _each(self, urls: Iterable[str], path: str, body: Any) -> dict[str, str]:
        """``path`` on each of ``urls`` concurrently (``body``: the same for all, or a function of the url);
        those that fail it are marked failed (restarted by the supervisor): ``{url: why}``."""
        futs = [(url, self._exec.submit(self._call, url, path, body(url) if callable(body) else body))
                for url in urls]  # fmt: skip
        failed = {url: f"{path} failed: {type(e).__name__}: {e}" for url, e in _failures(futs)}
        for url, why in failed.items():
            self._engine_failed(url, why)
        return failed

    @contextlib.contextmanager
    def _session(self, urls: list[str], pause: bool) -> Iterator[list[str]]:
        """A weight-update session on every engine of ``urls``; yields those that opened it.

        SGLang (0.5.23) loads ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` only
        between ``/begin_weight_update`` and ``/end_weight_update`` (HTTP 400 otherwise). With ``pause``,
        generation is first paused in ``retract`` mode (running requests go back to the queue, their KV
        cache freed, and go on with the new weights after ``/continue_generation``), unless the caller
        paused already: SGLang releases its update lock between two requests, so a bucketed update would
        otherwise let requests decode on half-updated weights under the old version label, and its cache
        flush fails while requests run."""
        paused = pause and self._paused is None
        failed: dict[str, str] = {}
        try:
            if paused:
                failed |= self._each(urls, "/pause_generation", pause_request("retract"))
            opened = [u for u in urls if u not in failed]
            failed |= self._each(opened, "/begin_weight_update", {})
            opened = [u for u in opened if u not in failed]
            try:
                yield opened
            finally:
                self._each(opened, "/end_weight_update", {})
        finally:
            if paused:
                self._each([u for u in urls if u not in failed], "/continue_generation", {})

    def _updated(self, version: int, path: str | None) -> None:
        self.check_weight_version(version)
        self.pool.adopt_weights(version, path)

    def update_weights_from_disk(
        self, model_path: str, version: int, abort_all_requests: bool = False
    ) -> None:
        """Every engine loads the checkpoint directory ``model_path`` (readable by them) as ``version``; a
        restarted engine loads it too (the directory is the caller's and is never deleted)."""
        self._update_all(
            "/update_weights_from_disk", disk_update_request(model_path, version, abort_all_requests)
        )
        self._updated(version, model_path)

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], version: int, flush_cache: bool = True,
        load_format: str | None = None,
    ) -> None:  # fmt: skip
        """Colocated: ``/update_weights_from_tensor`` with ``named_tensors`` (CUDA IPC handles; MoE experts one
        per expert, see :mod:`relax_rollout.engines.expert_names`)."""
        named = self._served_names(named_tensors)
        bodies: dict[tuple[Any, ...], dict[str, Any]] = {}  # engines on the same GPUs share one payload

        def body(url: str) -> dict[str, Any]:
            devices = self._rank_devices(url)
            key = tuple(devices) if isinstance(devices, list) else (devices,)
            if key not in bodies:
                bodies[key] = tensor_update_request(named, version, devices, flush_cache, load_format=load_format)
            return bodies[key]

        with self._session([m.url for m in self.pool.active()], pause=False) as opened:
            self._update_all("/update_weights_from_tensor", body, opened)
        self._updated(version, None)

    def _rank_devices(self, url: str) -> list[Any] | int:
        """The CUDA device, in this process's numbering, of each TP rank of the engine at ``url``: its
        slot's GPUs (physical ids) looked up in ``CUDA_VISIBLE_DEVICES``. ``tp_size`` (tensors left where
        they are) for an engine that is not one of our slots (added from outside) or without CUDA."""
        import torch

        slot = next((s for s in self.slots if s.url == url), None)
        if slot is None or not torch.cuda.is_available():
            return self.tp_size
        visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        return [torch.device("cuda", visible.index(g) if g in visible else int(g)) for g in slot.gpus]

    def connect_dcs(
        self,
        init_method: str,
        world_size: int,
        rank: int = 1,
        backend: str = "nccl",
        group_name: str = "relax_dcs",
        protocol: str = "sglang",
    ) -> None:
        """Engine ``i`` (in order) joins the trainer's weight group as ranks ``rank + i*tp_size ...``
        (``/init_weights_update_group``); returns after the rendezvous, so call it concurrently with the
        sender's (:func:`relax_rollout.engines.weight_group.new_group` at rank 0). ``protocol="relax_dcs"``:
        our engine servers join a relax DCS ``WeightSender`` instead (``group_name`` must be the sender's)."""
        u = urlparse(init_method)
        if not u.hostname or not u.port:
            raise ValueError(f"init_method must look like 'tcp://HOST:PORT' (got {init_method!r})")
        n = len(self.pool.active())
        if rank < 1 or rank + n * self.tp_size > world_size:
            raise ValueError(
                f"{n} engines × {self.tp_size} ranks from rank {rank} do not fit a group of {world_size}"
            )
        self._all("/init_weights_update_group", lambda i, m: init_group_request(
            u.hostname, u.port, rank + i * self.tp_size, world_size, group_name, backend, protocol))  # fmt: skip
        self._group = group_name

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        """``/update_weights_from_distributed`` on every engine while the trainer broadcasts (call it
        concurrently with the broadcast), then the version check."""
        if self._group is None:
            raise PoolError("no weight update group: call connect_dcs first")
        body = distributed_update_request(names, dtypes, shapes, version, self._group, flush_cache,
                                          abort_all_requests, load_format)  # fmt: skip
        with self._session([m.url for m in self.pool.active()], pause=False) as opened:
            self._update_all("/update_weights_from_distributed", body, opened)
        self._updated(version, None)

    def destroy_weights_update_group(self) -> None:
        """Leave the trainer's weight group (``/destroy_weights_update_group``)."""
        if self._group is None:
            return
        self._all("/destroy_weights_update_group", {"group_name": self._group})
        self._group = None

    # -- weights over SGLang's group (weight_update="distributed") ------------------------------------
    def _update_distributed(self, named: list[tuple[str, Any]], version: int) -> None:
        """Broadcast ``named`` to every serving engine (and every restarted one waiting for weights) on the
        weight group, bucket by bucket (``flattened_bucket``; the version goes with the last bucket). The
        group is re-formed when the engines changed; an engine that fails meanwhile is marked failed (the
        supervisor restarts it) and the update is retried once on the others."""
        from relax_rollout.engines import weight_group as wg

        if not named:
            raise ValueError("a weight update needs at least one tensor")
        device = named[0][1].device
        if device.type == "cuda" and self._gpu_shared(device):
            device = type(device)("cpu")  # NCCL refuses two ranks on one GPU: send from host memory over gloo
        backend = "nccl" if device.type == "cuda" else "gloo"
        parts = wg.buckets(named, self.bucket_bytes)
        with self._wg_lock:
            for attempt in (1, 2):
                members = {m.url: m for m in self.pool.active()}
                waiting = [s for s in self.slots if s.state == "waiting" and s.url not in members]
                urls = (*members, *(s.url for s in waiting))
                if not urls:
                    raise PoolError(f"no engine to update: {self.engines()}")
                try:
                    group = self._form_group(urls, backend)
                    flush = self._paused != "in_place"  # SGLang cannot flush a cache requests still use
                    with self._session(list(group.urls), pause=True) as opened:
                        if len(opened) < len(group.urls):  # one left: the broadcast would wait for it
                            self._drop_group()
                            raise _GroupBroken("an engine did not open the weight-update session")
                        for i, bucket in enumerate(parts):
                            last = i == len(parts) - 1
                            body = distributed_update_request(*tensor_metadata(bucket), version if last else None,
                                                              group.name, flush_cache=last and flush,
                                                              load_format=wg.FLATTENED)  # fmt: skip
                            self._on_group(group, "/update_weights_from_distributed", lambda _i, b=body: b,
                                           lambda g=group, b=bucket: wg.send(g.pg, b, wg.FLATTENED, device))  # fmt: skip
                    break
                except _GroupBroken as e:
                    if attempt == 2 or not self.pool.active():
                        raise PoolError(f"weight version {version} could not be broadcast: {e}") from None
                    logger.warning("weight version %d: %s; re-forming the group without it", version, e)
        # the pool takes the version first (restarted engines are admitted at it), the check covers them too:
        # when a refusal had failed every engine, only restarted ones hold the new weights
        self.pool.adopt_weights(version, None)
        for slot in waiting:  # restarted engines hold the new weights now: they serve again
            try:
                self._join(slot)
            except Exception as e:  # noqa: BLE001 — restarted again, within max_restarts
                logger.warning("engine %d did not rejoin after the update: %s", slot.index, e)
                self._restart_later(slot, f"rejoin after weight version {version} failed: {e}")
        self.check_weight_version(version)

    def _gpu_shared(self, device: Any) -> bool:
        """Whether CUDA ``device`` of this process is one an engine on this node runs on (colocated)."""
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        gpu = visible[index] if index < len(visible) else str(index)
        return any(gpu in slot.gpus for slot in self.slots if slot.node is None)

    def _form_group(self, urls: tuple[str, ...], backend: str) -> _WeightGroup:
        """The current group if it holds exactly ``urls``; else a new one (the old one destroyed)."""
        from relax_rollout.engines import weight_group as wg

        if self._wg is not None and self._wg.urls == urls and self._wg.backend == backend:
            return self._wg
        self._drop_group()
        if all(slot.node is None for slot in self.slots):
            master = "127.0.0.1"
        else:  # engines on other nodes reach this one's address
            import ray

            master = ray.util.get_node_ip_address()
        port = _free_port(master)
        name = f"relax_weights_{uuid.uuid4().hex[:8]}"
        world = 1 + len(urls) * self.tp_size
        group = _WeightGroup(None, name, urls, backend)
        timeout = min(self.request_timeout_s, 300.0)

        def join(i: int) -> dict[str, Any]:
            return init_group_request(master, port, 1 + i * self.tp_size, world, name, backend)

        def host() -> None:
            group.pg = wg.new_group(backend, f"tcp://{master}:{port}", world, 0, name, timeout)

        self._on_group(group, "/init_weights_update_group", join, host)
        self._wg = group
        logger.info(
            "weight group %s formed with %d engines (%s, world size %d)", name, len(urls), backend, world
        )
        return group

    def _on_group(
        self, group: _WeightGroup, path: str, body: Callable[[int], Any], local: Callable[[], None]
    ) -> None:
        """``path`` on every engine of ``group`` while this process does its part (``local``: a rendezvous
        or a broadcast). An engine that fails it (refused, died, 5xx; see :func:`_failures`) is marked
        failed and :class:`_GroupBroken` raised, naming it."""
        futs = [(url, self._exec.submit(self._call, url, path, body(i))) for i, url in enumerate(group.urls)]
        mine = _in_thread(local, "relax-weight-group")
        stuck = _until_done_or_refused(mine, [f for _, f in futs])
        local_error = mine.exception() if not stuck else TimeoutError(
            "abandoned: an engine refused, so the collective can never complete"
        )
        if stuck:  # every member must join a collective: one that refused leaves the others waiting in it
            done = [(u, f) for u, f in futs if f.done()]
            failed = _failures(done)
            failed += [(u, TimeoutError(f"left waiting in {path} after a peer refused")) for u, f in futs
                       if not f.done()]  # fmt: skip
            _abort_collectives(group.pg)
        else:
            failed = _failures(futs)
        for url, e in failed:
            self._engine_failed(url, f"{path} failed: {type(e).__name__}: {e}")
        if not failed and local_error is None:
            return
        if group is self._wg:  # its members' state is unknown now: a fresh group next time
            self._drop_group()
        elif group.pg is not None:
            from relax_rollout.engines.weight_group import destroy_group

            destroy_group(group.pg)
        why = "; ".join(f"{u}: {e}" for u, e in failed) or f"{type(local_error).__name__}: {local_error}"
        raise _GroupBroken(f"{path} on the weight group failed ({why})")

    def _engine_failed(self, url: str, reason: str) -> None:
        m = self.pool.find(url)
        if m is not None and m.state == "active":
            self.pool.mark_failed(m.id, reason)  # the supervisor restarts it
            return
        for slot in self.slots:  # a restarted engine that was waiting for weights: restart it again
            if slot.url == url and slot.state == "waiting":
                self._restart_later(slot, reason)

    def _restart_later(self, slot: EngineProcess, reason: str) -> None:
        """Restart an engine that is not in the pool (it was waiting for weights) from a thread."""
        with self._lock:
            slot.state, slot.error = "restarting", reason
        threading.Thread(target=self._restart, args=(slot, None), daemon=True,
                         name=f"relax-sglang-restart-{slot.index}").start()  # fmt: skip

    def _drop_group(self) -> None:
        """Leave the weight group: engines still serving destroy their side, this process its own."""
        from relax_rollout.engines import weight_group as wg

        group, self._wg = self._wg, None
        if group is None:
            return
        live = {m.url for m in self.pool.active()} | {s.url for s in self.slots if s.state == "waiting"}
        futs = [
            self._exec.submit(
                self._call, url, "/destroy_weights_update_group", {"group_name": group.name}, 30.0
            )
            for url in group.urls
            if url in live
        ]
        for f in futs:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 — a fresh group is formed either way
                logger.warning("leaving weight group %s: %s", group.name, e)
        if group.pg is not None:
            wg.destroy_group(group.pg)

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop supervising and end every engine process group (SIGTERM, SIGKILL after
        ``shutdown_grace_s``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._procs)
        self._stop.set()
        supervisor = getattr(self, "_supervisor", None)
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=self.poll_interval_s + 5)
        stop_processes(procs, self.shutdown_grace_s)
        group, self._wg = self._wg, None
        if group is not None and group.pg is not None:  # its engines are gone: only this side is left
            from relax_rollout.engines.weight_group import destroy_group

            destroy_group(group.pg)
        if self._launchers:
            import ray

            for launcher in self._launchers.values():
                try:
                    ray.kill(launcher)
                except Exception:  # noqa: BLE001 — Ray already down: the actor went with it
                    pass
        with self._lock:
            for slot in self.slots:
                slot.state = "stopped" if slot.state != "failed" else slot.state
        self.pool.close()
        self._exec.shutdown(wait=False, cancel_futures=True)
        self._finalizer.detach()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def engine_kwargs(cfg: Any) -> dict[str, Any]:
    """The :class:`SGLangEngine` arguments a ``RelaxConfig`` sets besides the model and its dtype
    (``--rollout-num-gpus``, ``--rollout-num-gpus-per-engine``, ``--sglang-mem-fraction-static``,
    ``--sglang-server-args``, ``--sglang-model-path``, ``--sglang-weight-update``, ``--sglang-python``,
    ``--sglang-env``; on several nodes, ``gpus_per_node`` from
    ``--actor-num-gpus-per-node``)."""
    r = cfg.rollout
    server_args = dict(r.sglang_server_args)
    if cfg.run.mode == "colocate" and cfg.run.offload is not False:  # SGLang on GPUs: offload by default
        server_args.setdefault("enable_memory_saver", True)  # what /release_memory_occupation needs
    out = {
        "num_engines": max(1, r.rollout_num_gpus // r.rollout_num_gpus_per_engine),
        "tp_size": r.rollout_num_gpus_per_engine,
        "mem_fraction_static": r.sglang_mem_fraction_static,
        "server_args": server_args,
        "weight_update": r.sglang_weight_update,
        "python": r.sglang_python,
        "env": dict(r.sglang_env),
    }
    t = cfg.train
    if t.actor_num_nodes > 1 and t.actor_num_gpus_per_node and r.rollout_num_gpus > t.actor_num_gpus_per_node:
        # more engines than the rollout's node holds: the rest on the cluster's other nodes, which load each
        # weight version from the run's output directory (on a filesystem every node sees)
        out["gpus_per_node"] = t.actor_num_gpus_per_node
        if r.sglang_weight_update == "disk":
            out["weights_dir"] = str(Path(cfg.run.output_dir).absolute() / "engine_weights")
    if r.sglang_model_path:  # (Qwen3-Omni: the whole model; the trainer's --hf-checkpoint is its thinker)
        out["model_path"] = r.sglang_model_path
    return out
