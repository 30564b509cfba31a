"""The sampling sessions of a server: snapshots by id, an engine per adapter configuration, requests sent to
it. A part of its own: it needs the adapters' configurations, the base-model check and the futures table,
nothing else of the service."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
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
    ) -> None:
        self.model_path, self.dtype, self.engine, self.adapters = model_path, dtype, engine, adapters
        self.check_base, self.track = check_base, track
        self.snapshots: dict[str, Snapshot] = {}
        self.samplers: dict[str | None, Sampler] = {}
        """One engine per training client (its adapter's configuration), and one (None) for the base model."""

    def add(self, snap: Snapshot) -> None:
        self.snapshots[snap.session_id] = snap

    def create(self, body: dict[str, Any], root: Path, base_model_of: Callable[[str], str]) -> str:
        """A session from a sampler checkpoint (``model_path``) or on the base model."""
        sid = f"{body['session_id']}:sample:{body.get('sampling_session_seq_id', len(self.snapshots))}"
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

    def snapshot(self, sid: str) -> Snapshot:
        if sid not in self.snapshots:
            raise UserError(f"unknown sampling session {sid!r}")
        return self.snapshots[sid]

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


def _chunk_tokens(chunk: dict[str, Any]) -> list[int]:
    if chunk.get("type", "encoded_text") != "encoded_text":
        raise UserError(
            f"a {chunk.get('type')} chunk: this server samples from text chunks only (see the compatibility table)"
        )
    return [int(t) for t in chunk["tokens"]]
