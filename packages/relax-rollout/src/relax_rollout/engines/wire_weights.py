"""SGLang's weight-update requests as we send them: the bodies of ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/update_weights_from_disk`` and ``/update_weights_from_tensor``, the
safetensors a disk update loads and the serialized tensors a tensor update carries.

Why apart from :mod:`relax_rollout.engines.wire` (the rest of SGLang's HTTP API as we speak it): the same
reason in a module of its own size — each field name and encoding is written here once, for the ``sglang``
engine, the ``external`` engine and the engine pool alike. Field names follow sgl-project/sglang
``python/sglang/srt/managers/io_struct.py`` (see wire's docstring for the commit read); torch and
safetensors are imported by the functions that need them.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any


def init_group_request(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str,
    protocol: str = "sglang",
) -> dict[str, Any]:
    """SGLang's ``InitWeightsUpdateGroupReqInput``; ``protocol="relax_dcs"`` adds the field that makes our
    engine server join a relax DCS sender instead (SGLang has no such group)."""
    body = {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }
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
    body = {
        "names": list(names),
        "dtypes": [_dtype_name(d) for d in dtypes],
        "shapes": [[int(x) for x in s] for s in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
    }
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
    body = {
        "model_path": model_path,
        "weight_version": str(version),
        "abort_all_requests": abort_all_requests,
        "flush_cache": flush_cache,
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body


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
    pickler.dispatch_table = {
        **ForkingPickler._extra_reducers,  # type: ignore[attr-defined]  # private: typeshed leaves it out
        torch.Tensor: reduce_by_uuid,
        torch.nn.Parameter: reduce_by_uuid,
    }
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
    body = {
        "serialized_named_tensors": payloads,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": str(version),
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body
