"""SGLang's native routes of the engine server: health and model info, ``/generate``, the weight updates
(from disk, over a weight group, the session around them), pause / continue / abort and device memory.

Why a module of its own: these are the routes the rollout manager, the ``sglang`` and ``external`` engines
and the engine pool call, each answering in SGLang 0.5.23's shapes (``sglang.srt.entrypoints.http_server``);
the OpenAI routes (:mod:`relax_rollout.server.openai_routes`) serve agents and benchmarks. Both are thin:
they parse a request (:mod:`relax_rollout.server.protocol`), call the server's state
(:class:`~relax_rollout.server.state.EngineServer`) and shape its answer; ``app.ROUTES`` maps paths to them.
Each takes ``(EngineServer, body)`` and returns ``(status, out)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from relax_rollout.engines.base import GenerateOutput, TokenDelta
from relax_rollout.http_api import EventStream
from relax_rollout.server import protocol
from relax_rollout.server.protocol import BadRequest
from relax_rollout.server.streaming import TextDeltas, stop_token_ids

if TYPE_CHECKING:
    from relax_rollout.server.state import EngineServer
    from relax_rollout.server.streaming import GenerationStream

CHARS_PER_TOKEN_MAX = 64
"""More characters per token than any tokenizer averages: a text longer than this many per context token
cannot fit, whatever it tokenizes to."""


def health(s: EngineServer, _: dict):
    return 200, None


def model_info(s: EngineServer, _: dict):
    return 200, {
        "model_path": s.model_path,
        "tokenizer_path": s.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(s.engine.weight_version),
    }


def weight_version(s: EngineServer, _: dict):
    return 200, {"weight_version": str(s.engine.weight_version)}


def checksum(s: EngineServer, _: dict):
    return 200, {"checksum": s.engine.weights_checksum(), "weight_version": str(s.engine.weight_version)}


def generate(s: EngineServer, body: dict):
    # (a text far longer than the context is refused before tokenizing it: a 10 MB prompt held the server)
    req = protocol.parse_generate(body, s.tokenizer, s.context_len and s.context_len * CHARS_PER_TOKEN_MAX)
    if req.return_routed_experts and getattr(s.engine, "routing", None) is None:
        raise BadRequest(
            "return_routed_experts",
            "this server records no routed experts: start it with --enable-return-routed-experts "
            "on a Mixture-of-Experts model",
        )
    t0 = time.perf_counter()
    kind = next((p.constraint.kind for p in req.params if p.constraint is not None), None)
    fields = {**GENERATE_FIELDS, "constraint": f"sampling_params.{kind}"} if kind else GENERATE_FIELDS
    start = req.routed_experts_start_len if req.return_routed_experts else None
    text_of = s.token_text if req.return_text_in_logprobs else None
    keep = req.no_stop_trim or [False] * len(req.prompts)
    firsts = req.logprob_start_len or [-1] * len(req.prompts)

    def reply(outs: list, dt: float) -> list[dict]:
        return [
            protocol.generate_response(
                o,
                p,
                rid,
                len(x),
                req.return_logprob,
                protocol.response_text(s.decode, o, k),
                dt,
                start,
                text_of,
                x,
                first,
            )
            for o, p, rid, x, k, first in zip(outs, req.params, req.rids, req.prompts, keep, firsts)
        ]

    if req.stream:  # token by token: the reply so far at each token, then the whole reply (.streaming)
        stream = s.stream(req.prompts, req.params, req.rids, req.max_new_given, fields)
        return 200, EventStream(generate_events(s, req, stream, reply), on_close=stream.close)
    outs = s.generate(req.prompts, req.params, req.rids, req.max_new_given, fields)
    res = reply(outs, time.perf_counter() - t0)
    return 200, res[0] if req.single else res


GENERATE_FIELDS = {
    "top_logprobs": "top_logprobs_num",
    "stop": "sampling_params.stop",
    "input_logprobs": "logprob_start_len",
}


def generate_events(
    s: EngineServer,
    req: protocol.GenerateRequest,
    stream: GenerationStream,
    reply: Callable[[list[GenerateOutput], float], list[dict]],
) -> Iterator[dict]:
    """SGLang's ``/generate`` stream: per delta, the reply of that prompt so far (``text`` as far as it
    can be shown, ``output_ids``, ``meta_info`` with ``completion_tokens``, ``finish_reason`` null and,
    with ``return_logprob``, the log-probs so far); then each prompt's whole reply (``reply(outputs,
    latency)``, the non-streamed replies). A batch's chunks carry their prompt's ``index``."""
    texts = [
        TextDeltas(s.decode, () if keep else p.stop, stop_token_ids(s.engine, p))
        for p, keep in zip(req.params, req.no_stop_trim or [False] * len(req.prompts))
    ]
    lps: list[list[float]] = [[] for _ in req.prompts]
    for item in stream:
        if isinstance(item, TokenDelta):
            i = item.index
            texts[i].add(item.token_ids)
            lps[i].extend(item.log_probs)
            meta: dict[str, Any] = {
                "id": req.rids[i],
                "finish_reason": None,
                "prompt_tokens": len(req.prompts[i]),
                "completion_tokens": len(texts[i].tokens),
                "cached_tokens": 0,
                "e2e_latency": stream.elapsed,
            }
            if req.return_logprob:
                txt = s.token_text if req.return_text_in_logprobs else (lambda _: None)
                meta["output_token_logprobs"] = [[lp, t, txt(t)] for lp, t in zip(lps[i], texts[i].tokens)]
            chunk = {"text": texts[i].sent, "output_ids": list(texts[i].tokens), "meta_info": meta}
            yield chunk if req.single else {**chunk, "index": i}
            continue
        for i, r in enumerate(reply(item, stream.elapsed)):
            yield r if req.single else {**r, "index": i}


def update_from_disk(s: EngineServer, body: dict):
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


def init_group(s: EngineServer, body: dict):
    s.group.join(body)
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


def _refused(message: str):
    """SGLang's answer to a weight request it does not carry out: HTTP 400, ``success`` false."""
    return 400, {"success": False, "message": message}


def begin_update(s: EngineServer, body: dict):
    if s.session:
        return _refused("a weight-update session is already open; call end_weight_update() first")
    s.session = True
    return 200, {"success": True, "message": "Success"}


def end_update(s: EngineServer, body: dict):
    if not s.session:
        return _refused("no weight-update session is open; call begin_weight_update() first")
    s.session = False
    return 200, {"success": True, "message": "Success"}


def update_from_tensor(s: EngineServer, body: dict):
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


def update_from_distributed(s: EngineServer, body: dict):
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
    s.group.check(body.get("group_name"))
    if not s.session:  # SGLang 0.5.23 refuses it outside a session, before joining the broadcast
        return _refused(
            "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
        )
    if flags["abort_all_requests"]:
        s.abort("", abort_all=True)
    if s.group.receives_broadcast:  # SGLang's group: this request's tensors come now, from rank 0's broadcast
        v = s.group.receive(body, body.get("weight_version") is not None or flags["flush_cache"])
        if v is None:
            return 200, {"success": True, "message": "Succeeded to update parameter online."}
    else:
        timeout = protocol._num(body, "timeout_s", "body", float, 300.0, lo=0.0)
        v = s.group.wait_for_version(body.get("weight_version"), timeout)
    return 200, {"success": True, "message": f"Succeeded to update parameter online. Weight version {v}."}


def destroy_group(s: EngineServer, body: dict):
    s.group.check(body.get("group_name"))
    s.group.leave()
    return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


def pause(s: EngineServer, body: dict):
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        raise BadRequest("mode", f"must be one of 'abort', 'retract', 'in_place' (got {mode!r})")
    s.pause(mode)
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


def continue_generation(s: EngineServer, body: dict):
    s.resume()
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


def abort(s: EngineServer, body: dict):
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str):
        raise BadRequest("rid", f"must be a string (got {rid!r})")
    if not isinstance(abort_all, bool):
        raise BadRequest("abort_all", f"must be a boolean (got {abort_all!r})")
    if not rid and not abort_all:
        raise BadRequest("rid", "give a request id, or abort_all: true")
    s.abort(rid, abort_all)
    return 200, None


def release_memory(s: EngineServer, body: dict):
    s.memory(body, release=True)
    return 200, None


def resume_memory(s: EngineServer, body: dict):
    s.memory(body, release=False)
    return 200, None
