"""The sampling sessions of a server: snapshots by id, an engine per adapter configuration, requests sent to
it. A part of its own: it needs the adapters' configurations, the base-model check and the futures table,
nothing else of the service.

A cookbook RL loop saves a sampling snapshot every step and keeps using only the latest, but any old session
may still be sampled. So the last ``keep`` snapshots' adapters stay in memory and older ones are written to
``spill_dir`` and read back when a request names them: memory stays bounded over a run of thousands of steps
(a rank-32 adapter of every linear layer of Qwen3-8B is 87M parameters: 350 MB in fp32), and every session
stays exact.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

from relax_tinker.adapters import Adapters
from relax_tinker.checkpoints import UserError, checkpoint_dir, parse_path
from relax_tinker.sampling import SampleParams, Sampler, Snapshot, build_engine


class SamplingSessions:
    def __init__(
        self,
        model_path: str,
        dtype: str,
        engine: str,
        adapters: Adapters,
        check_base: Callable[[str | None], None],
        track: Callable[[Future], str],
        spill_dir: Path,
        keep: int = 4,
    ) -> None:
        """``keep``: sessions whose adapters stay in memory; older ones wait in ``spill_dir``."""
        self.model_path, self.dtype, self.engine, self.adapters = model_path, dtype, engine, adapters
        self.check_base, self.track = check_base, track
        self.spill_dir, self.keep = spill_dir, keep
        self.snapshots: dict[str, Snapshot] = {}
        """Sessions whose weights are in memory, the least recently used first."""
        self.spilled: dict[str, tuple[Snapshot, Path]] = {}
        """Older sessions: the snapshot without its adapter, and the file holding the adapter."""
        self.made = 0
        self._lock = threading.Lock()
        self.samplers: dict[str | None, Sampler] = {}
        """One engine per training client (its adapter's configuration), and one (None) for the base model."""

    def add(self, snap: Snapshot) -> None:
        with self._lock:
            self.made += 1
            self._hold(snap)

    def _hold(self, snap: Snapshot) -> None:
        """In memory as the most recent; the least recently used adapter beyond ``keep`` to disk."""
        self.snapshots.pop(snap.session_id, None)
        self.snapshots[snap.session_id] = snap
        held = [sid for sid, s in self.snapshots.items() if s.adapter is not None]
        for sid in held[: max(0, len(held) - self.keep)]:
            self._spill(self.snapshots.pop(sid))

    def _spill(self, snap: Snapshot) -> None:
        from safetensors.torch import save_file

        assert snap.adapter is not None
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        path = self.spill_dir / f"{snap.session_id.replace(':', '_').replace('/', '_')}.safetensors"
        save_file({k: v.contiguous() for k, v in snap.adapter.items()}, str(path))
        self.spilled[snap.session_id] = (replace(snap, adapter=None), path)

    def create(self, body: dict[str, Any], root: Path, base_model_of: Callable[[str], str]) -> str:
        """A session from a sampler checkpoint (``model_path``) or on the base model."""
        sid = f"{body['session_id']}:sample:{body.get('sampling_session_seq_id', self.made)}"
        if body.get("model_path"):
            from safetensors.torch import load_file

            path = checkpoint_dir(root, body["model_path"])
            run_id = parse_path(body["model_path"])[0]
            adapter = load_file(str(path / "adapter_model.safetensors"))
            self.add(Snapshot(sid, base_model_of(run_id), 0, adapter, run_id, body["model_path"]))
        else:
            self.check_base(body.get("base_model"))
            self.add(Snapshot(sid, body.get("base_model") or self.model_path, 0))
        return sid

    def describe(self, sid: str) -> Snapshot:
        """The session's snapshot as held, its adapter perhaps on disk: what it is, not weights to sample
        with (a metadata request reads no spilled adapter back, and evicts none)."""
        with self._lock:
            if sid in self.snapshots:
                return self.snapshots[sid]
            if sid in self.spilled:
                return self.spilled[sid][0]
        raise UserError(f"unknown sampling session {sid!r}")

    def snapshot(self, sid: str) -> Snapshot:
        """The session's snapshot with its adapter in memory (read back from disk if it was spilled); a
        request holds this object, so a later spill cannot take its weights away mid-batch."""
        from safetensors.torch import load_file

        with self._lock:
            if sid in self.snapshots:
                snap = self.snapshots[sid]
            elif sid in self.spilled:
                bare, path = self.spilled.pop(sid)
                snap = replace(bare, adapter=load_file(str(path)))
                path.unlink(missing_ok=True)
            else:
                raise UserError(f"unknown sampling session {sid!r}")
            self._hold(snap)
            return snap

    def _sampler(self, snap: Snapshot) -> Sampler:
        if snap.model_id not in self.samplers:
            lora = None
            if snap.model_id is not None:
                c = self.adapters.config(snap.model_id)
                lora = {"r": c.r, "lora_alpha": c.lora_alpha, "target_modules": sorted(c.target_modules)}
            self.samplers[snap.model_id] = Sampler(
                build_engine(self.engine, self.model_path, lora, self.dtype)
            )
        return self.samplers[snap.model_id]

    def sample(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        """A request id and the sequence ids of its ``num_samples`` samples."""
        snap = self.snapshot(body["sampling_session_id"])
        tokens = [t for c in body["prompt"]["chunks"] for t in _chunk_tokens(c)]
        n = int(body.get("num_samples", 1))
        params = SampleParams.from_api(body.get("sampling_params") or {})
        fut = self._sampler(snap).submit(snap, tokens, n, params, bool(body.get("prompt_logprobs")))
        rid = self.track(fut)
        return rid, [f"{rid}:{i}" for i in range(n)]

    def close(self) -> None:
        for s in self.samplers.values():
            s.close()
        shutil.rmtree(self.spill_dir, ignore_errors=True)


def _chunk_tokens(chunk: dict[str, Any]) -> list[int]:
    if chunk.get("type", "encoded_text") != "encoded_text":
        raise UserError(
            f"a {chunk.get('type')} chunk: this server samples from text chunks only (see the compatibility table)"
        )
    return [int(t) for t in chunk["tokens"]]
