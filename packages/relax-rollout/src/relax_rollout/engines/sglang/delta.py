"""The rollout's side of delta weight sync to SGLang servers (``weight_update="delta"``, #53).

Each version's weights, in buckets of one dtype, go to every engine as their deltas against the version
the engines hold (:class:`~relax_core.weight_delta.DeltaSender`), by ``/update_weights_from_tensor`` with
SGLang's custom loader :func:`relax_rollout.sglang_delta_loader.load` (the payload pickled inline: it
crosses the HTTP request, so the engine needs no shared memory with this process). Full versions go when a
delta cannot: the first, when the set of engines changed (one joined or came back: it holds the
checkpoint's weights, not the last version), after an engine refused one, and every ``full_every``.

The loader cannot fail a request (SGLang does not catch what it raises), so it reports what it holds in a
file per engine and TP rank under :attr:`SGLangDeltas.report_dir` (this path is for engines on the rollout's
host); :meth:`SGLangDeltas.held` reads it.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_core.weight_delta import DeltaSender
from relax_rollout.sglang_delta_loader import PREFIX

logger = logging.getLogger(__name__)
LOADER = "relax_rollout.sglang_delta_loader.load"
"""What ``--custom-weight-loader`` and each request's ``load_format`` name."""


class SGLangDeltas:
    """The delta codec of one engine set: what it sent last, and where the engines report."""

    def __init__(self, bucket_bytes: int, full_every: int = 50) -> None:
        self.bucket_bytes = bucket_bytes
        self.codec = DeltaSender(full_every=full_every)
        self.report_dir = Path(tempfile.mkdtemp(prefix="relax-sglang-delta-"))
        weakref.finalize(self, shutil.rmtree, self.report_dir, True)  # (gone with the engine)
        self.urls: tuple[str, ...] = ()
        """The engines the last version went to (another set: the next version goes full)."""
        self.last_sent = 0
        """Bytes of the last version's payloads (one engine's)."""

    def report(self, url: str) -> str:
        """The report path of the engine at ``url`` (the loader adds ``.rank<r>``)."""
        return str(self.report_dir / url.replace("://", "_").replace(":", "_").replace("/", "_"))

    def entries(
        self, named: list[tuple[str, Any]], version: int, urls: list[str]
    ) -> list[tuple[dict[str, Any], Any]]:
        """Version ``version``'s buckets as the loader's entries (header as name, payload as tensor), the
        report path left for :meth:`body` to fill per engine."""
        import torch

        from relax_rollout.engines import weight_group as wg

        if tuple(urls) != self.urls:
            self.codec.ask_full()
            self.urls = tuple(urls)
        parts = wg.buckets(named, self.bucket_bytes)
        flats = [wg.flatten(p, "cpu").numpy() for p in parts]
        deltas = self.codec.encode(version, flats, [p[0][1].element_size() for p in parts])
        self.last_sent = sum(len(d.payload) for d in deltas)
        layouts = [[[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in p] for p in parts]
        out = []
        for d in deltas:
            h: dict[str, Any] = {
                "version": d.version,
                "base": d.base_version,
                "index": d.index,
                "count": d.count,
                "encoding": d.encoding,
                "itemsize": d.itemsize,
                "nbytes": d.nbytes,
                "checksum": d.checksum,
            }
            if d.index == d.count - 1:
                full = all(x.base_version is None for x in deltas)  # (a full sync: every bucket loaded)
                h |= {"layouts": layouts, "checksums": [x.checksum for x in deltas], "full": full}
            out.append((h, torch.frombuffer(bytearray(d.payload), dtype=torch.uint8)))
        return out

    def send(
        self,
        named: list[tuple[str, Any]],
        version: int,
        urls: list[str],
        servers: Any,
        session: Callable[[list[str]], Any],
        update_all: Callable[..., None],
        fresh: Any = False,
    ) -> dict[str, str]:
        """Version ``version`` to the engines at ``urls`` inside ``session(urls)`` (generation paused) by
        ``update_all(path, body, urls)``, then each engine's label set where its loader committed the
        version; ``{url: why}`` of those that refused it (they serve their last complete version; the next
        version goes full). ``fresh`` (truthy): an engine among them holds no version of ours (restarted): full."""
        if fresh:
            self.codec.ask_full()
        entries = self.entries(named, version, urls)
        flush = servers.may_flush
        refused: dict[str, str] = {}
        with session(urls) as opened:
            for u in opened:
                for old in self.report_dir.glob(Path(self.report(u)).name + ".rank*"):
                    old.unlink()  # (what it held before: only this version's report counts)
            update_all(
                "/update_weights_from_tensor", lambda u: self.body(entries, u, servers.tp_size, flush), opened
            )
            for u in opened:
                held, why = self.held(u, servers.tp_size)
                if held == version:
                    servers.call(
                        u,
                        "/update_weight_version",
                        {"new_version": str(version), "abort_all_requests": False},
                    )
                else:
                    refused[u] = f"holds version {held}: {why}"
        if refused:
            self.codec.ask_full()
            logger.warning(
                "weight version %d (delta) refused by %s; the next version goes full", version, refused
            )
        return refused

    def body(
        self, entries: list[tuple[dict[str, Any], Any]], url: str, tp_size: int, flush: bool
    ) -> dict[str, Any]:
        """``/update_weights_from_tensor``'s request for the engine at ``url`` (no ``weight_version``: the
        label is set once the loader says it committed)."""
        report = self.report(url)
        named = [(PREFIX + json.dumps({**h, "report": report}), t) for h, t in entries]
        payload = base64.b64encode(pickle.dumps(named)).decode()
        return {
            "serialized_named_tensors": [payload] * tp_size,
            "load_format": LOADER,
            "flush_cache": flush,
            "abort_all_requests": False,
        }

    def held(self, url: str, tp_size: int) -> tuple[int | None, str | None]:
        """(the version the engine at ``url`` holds, why it refused the last one or None), from its reports
        (every TP rank must hold the same version; a rank that did not report holds nothing known)."""
        versions, refused = set(), None
        for rank in range(tp_size):
            path = Path(f"{self.report(url)}.rank{rank}")
            if not path.is_file():
                return None, f"TP rank {rank} wrote no report ({path})"
            r = json.loads(path.read_text())
            versions.add(r["version"])
            refused = refused or r["refused"]
        return (versions.pop() if len(versions) == 1 else None), refused


def loader_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for SGLang's processes with the source trees of relax-core and relax-rollout on its
    ``PYTHONPATH`` when they run from a checkout (SGLang in a venv of its own, as on a CPU: it imports the
    loader from there); nothing added where they are installed packages (SGLang's environment is then
    theirs, or must install them: ``pip install relax-rollout``)."""
    import os

    import relax_core
    import relax_rollout

    roots = [str(Path(str(m.__file__)).resolve().parents[1]) for m in (relax_core, relax_rollout)]
    roots = [r for r in dict.fromkeys(roots) if Path(r).name == "src"]
    if not roots:
        return dict(env)
    old = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    return {**env, "PYTHONPATH": os.pathsep.join([*roots, *([old] if old else [])])}


def delta_launch(
    weight_update: str, server_args: dict[str, Any], env: dict[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The launch flags and environment of SGLang servers: with ``weight_update="delta"`` our loader
    registered (``--custom-weight-loader``) and importable (:func:`loader_env`); as given otherwise."""
    if weight_update != "delta":
        return server_args, env
    return {
        **server_args,
        "custom_weight_loader": server_args.get("custom_weight_loader", [LOADER]),
    }, loader_env(env)
