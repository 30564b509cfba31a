"""SGLang's side of delta weight sync (#53): a custom weight loader that runs inside each SGLang server.

How it is reached: the server is launched with ``--custom-weight-loader relax_rollout.sglang_delta_loader.load``
(``weight_update="delta"`` of the ``sglang`` engine does that), and the rollout sends each version's buckets
by ``/update_weights_from_tensor`` with ``load_format`` naming this function. SGLang calls ``load(model,
named_tensors)`` in every TP rank's process. Each entry is one bucket: its name is :data:`PREFIX` + a JSON
header (version, base version, index, count, encoding, checksum, the tensors it holds), its tensor the
delta's payload (uint8; pickled inline, so it crosses the HTTP request: no shared-memory handle).

What it does: a :class:`~relax_core.weight_delta.DeltaReceiver` per process keeps the last complete version's
buckets (a host copy of the weights in their wire dtype) and applies a version's deltas to copies; only once
every bucket arrived in order and checked does it hand the buckets that changed to ``model.load_weights``.
A delta on another base, a bucket out of order or twice, a checksum that differs or a version cut short are
refused, the model untouched: it keeps serving its last complete version.

Why a report file and not an error: SGLang calls a custom loader without catching what it raises (the
scheduler would die), and it records the request's ``weight_version`` on any return. So the rollout sends the
buckets with no version, and this loader writes what it holds (``{"version": ..., "refused": ...}``) to the
report path the header names (one per engine and TP rank, on the engine's host, which is the rollout's for
this path); the rollout reads it and sets the version label (``/update_weight_version``) only where the
version was committed, and asks for a full sync where it was refused. A ``load_weights`` that fails on a
committed version (a name the model lacks) is not caught: its weights are half-loaded, so the server stops
and is restarted, as after SGLang's own failed loads.

Imports only numpy, torch and :mod:`relax_core.weight_delta`: it runs in SGLang's environment.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

PREFIX = "relax-delta:"
"""What starts the name of every entry this loader takes (the rest is the bucket's JSON header)."""

logger = logging.getLogger(__name__)
_receiver: Any = None
"""This process's DeltaReceiver (created at the first call)."""
_loaded: dict[int, str] = {}
"""Each bucket's checksum as last handed to the model: a bucket that did not change since is not loaded again
(until a full sync, which loads them all)."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _report(path: str, version: int | None, refused: str | None) -> None:
    """Write what this process holds to ``path`` + its rank, atomically (the rollout reads it)."""
    target = f"{path}.rank{_rank()}"
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": version, "refused": refused, "at": time.time()}, f)
    os.replace(tmp, target)


def _tensors(bucket: Any, layout: list[list[Any]]) -> list[tuple[str, Any]]:
    """A bucket's bytes (uint8) as its named tensors, by the header's ``[name, dtype, shape]`` layout."""
    import torch

    flat = torch.from_numpy(bucket)
    out, start = [], 0
    for name, dtype, shape in layout:
        dt = getattr(torch, dtype)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty(0, dtype=dt).element_size()
        out.append((name, flat[start : start + nbytes].view(dt).view(shape).clone()))
        start += nbytes
    return out


def load(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """Take one request's buckets (see the module docstring); never raises for a delta it refuses."""
    global _receiver
    from relax_core.weight_delta import BucketDelta, DeltaReceiver, DeltaRefused

    if _receiver is None:
        _receiver = DeltaReceiver()
    report: str | None = None
    for name, tensor in named_tensors:
        if not name.startswith(PREFIX):
            logger.error("relax delta loader: an entry %r that is not a relax delta bucket: ignored", name)
            continue
        h = json.loads(name[len(PREFIX) :])
        report = h["report"]
        payload = tensor.detach().cpu().contiguous().numpy().tobytes()
        delta = BucketDelta(
            h["version"],
            h["base"],
            h["index"],
            h["count"],
            h["encoding"],
            h["itemsize"],
            h["nbytes"],
            payload,
            h["checksum"],
        )
        try:
            committed = _receiver.apply(delta)
        except DeltaRefused as e:
            logger.warning("relax delta loader: %s; serving version %s still", e, _receiver.version)
            _report(report, _receiver.version, str(e))
            return
        if committed is not None:  # (the last bucket's header carries the version's layouts and checksums)
            layouts = h["layouts"]
            if h["full"]:  # a full sync loads every bucket (it repairs weights another path wrote)
                _loaded.clear()
            fresh = [i for i, b in enumerate(committed) if _loaded.get(i) != h["checksums"][i]]
            model.load_weights([t for i in fresh for t in _tensors(committed[i], layouts[i])])
            _loaded.update({i: h["checksums"][i] for i in fresh})
    if report is not None:
        _report(report, _receiver.version, None)
