"""What the Tinker API's routes do, without HTTP: sessions, training clients (an adapter each), sampling
sessions, checkpoints and the futures every long call returns.

Each training client's calls run on a thread of its own, one at a time in the order they came (the SDK sends
``forward_backward`` and ``optim_step`` back to back and waits for both); a call's result, or its error, is
kept under a request id for the client to retrieve (the newest :data:`KEEP_RESULTS` finished ones: a
long run must not keep every result). Checkpoints are directories under ``root`` named by their
``tinker://`` path, in peft's adapter format.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from relax_tinker.adapters import AdamParams, Adapters, lora_config
from relax_tinker.checkpoints import SCHEME, UserError, checkpoint_dir, list_checkpoints
from relax_tinker.sampling import Snapshot
from relax_tinker.sampling_sessions import SamplingSessions
from relax_tinker.wire import ForwardBackwardCall, encode_forward_output

KEEP_RESULTS = 4096
"""Finished calls whose results stay retrievable (older ones are dropped; a poll for one is told so)."""


@dataclass
class TrainingModel:
    """A training client: its adapter (named by ``model_id``) on the base model."""

    model_id: str
    session_id: str
    base_model: str
    rank: int
    user_metadata: dict[str, Any]
    executor: ThreadPoolExecutor
    snapshots: int = 0
    """Sampler snapshots taken (each one's version)."""
    last_request: float = field(default_factory=time.time)


class TinkerService:
    """The API's state and operations on one base model (``model_path``, also served as ``names``)."""

    def __init__(
        self,
        model_path: str,
        root: Path,
        names: tuple[str, ...] = (),
        dtype: str = "float32",
        sampler: str = "process",
        snapshots_in_memory: int = 4,
    ) -> None:
        """``sampler``: where sampling runs (:func:`relax_tinker.sampling.build_engine`);
        ``snapshots_in_memory``: sampling sessions whose adapters stay in memory (older ones wait on disk)."""
        self.model_path, self.root, self.dtype = model_path, Path(root), dtype
        self.names = {model_path, str(Path(model_path).resolve()), *names}
        self.adapters = Adapters(model_path, dtype)
        self.sessions: dict[str, dict[str, Any]] = {}
        self.models: dict[str, TrainingModel] = {}
        self.futures: dict[str, Future] = {}
        self.sampling = SamplingSessions(
            model_path,
            dtype,
            sampler,
            self.adapters,
            self.check_base,
            self._track,
            self.root / ".sampling-snapshots",
            snapshots_in_memory,
        )
        """The sampling sessions (a part of its own: :mod:`relax_tinker.sampling_sessions`)."""

    # -- sessions -----------------------------------------------------------------------------------
    def create_session(self, body: dict[str, Any]) -> str:
        sid = f"relax-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = {"created": time.time(), "beat": time.time(), "tags": body.get("tags", [])}
        return sid

    def heartbeat(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise KeyError(f"unknown session {session_id!r}")
        self.sessions[session_id]["beat"] = time.time()

    # -- futures ------------------------------------------------------------------------------------
    def _track(self, fut: Future) -> str:
        rid = uuid.uuid4().hex
        self.futures[rid] = fut
        if len(self.futures) > KEEP_RESULTS:  # (dicts keep insertion order: the oldest finished go first)
            done = [k for k, f in self.futures.items() if f.done()]
            for k in done[: len(self.futures) - KEEP_RESULTS]:
                del self.futures[k]
        return rid

    def _run(self, model_id: str, fn: Any, *args: Any) -> str:
        """``fn(*args)`` on ``model_id``'s thread, after its earlier calls; its request id."""
        model = self.model(model_id)
        model.last_request = time.time()
        return self._track(model.executor.submit(fn, *args))

    def model(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise UserError(f"unknown model_id {model_id!r} (this server holds {sorted(self.models)})")
        return self.models[model_id]

    # -- training clients ---------------------------------------------------------------------------
    def check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model not in self.names:
            raise UserError(
                f"base_model {base_model!r} is not served here; this server serves {sorted(self.names)} "
                "(start it with --model for another)"
            )

    def create_model(self, body: dict[str, Any]) -> str:
        """A new training client: ``{session_id}:train:{model_seq_id}``, as the SDK names them."""
        self.check_base(body.get("base_model"))
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise UserError(f"optimizer_config.type {opt!r}: this server trains with adamw only")
        lora = body.get("lora_config") or {}
        if not lora.get("rank"):
            raise UserError(
                "lora_config.rank is required: this server trains LoRA adapters, not full weights"
            )
        model_id = f"{body['session_id']}:train:{body.get('model_seq_id', len(self.models))}"
        config = lora_config(
            int(lora["rank"]),
            lora.get("train_mlp", True),
            lora.get("train_attn", True),
            lora.get("train_unembed", True),
        )

        def create() -> dict[str, Any]:
            self.adapters.add(model_id, config, lora.get("seed"))
            return {"model_id": model_id, "type": "create_model"}

        self._new_model(model_id, body, int(lora["rank"]))
        return self._run(model_id, create)

    def _new_model(self, model_id: str, body: dict[str, Any], rank: int) -> None:
        if model_id in self.models:
            raise UserError(f"model {model_id!r} exists already")
        self.models[model_id] = TrainingModel(
            model_id,
            body["session_id"],
            body.get("base_model") or self.model_path,
            rank,
            body.get("user_metadata") or {},
            ThreadPoolExecutor(1, thread_name_prefix=f"relax-tinker-{model_id}"),
        )

    def info(self, model_id: str) -> dict[str, Any]:
        m = self.model(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": "relax-torch",
                "model_name": m.base_model,
                "tokenizer_id": self.model_path,
            },
            "is_lora": True,
            "lora_rank": m.rank,
            "model_name": m.base_model,
        }

    def forward_backward(self, call: ForwardBackwardCall) -> str:
        if not call.data:
            raise UserError("forward_backward with no data")

        def run() -> bytes:
            outputs, metrics = self.adapters.forward(
                call.model_id, call.data, call.loss_fn, call.loss_fn_config, backward=not call.forward_only
            )
            return encode_forward_output(outputs, metrics)

        return self._run(call.model_id, run)

    def optim_step(self, body: dict[str, Any]) -> str:
        raw = body.get("adam_params") or body.get("optim_params") or {}
        if raw.get("type", "adam") not in ("adam", "adamw"):
            raise UserError(f"optimizer {raw.get('type')!r}: this server steps with Adam only")
        known = AdamParams.__dataclass_fields__
        adam = AdamParams(**{k: float(v) for k, v in raw.items() if k in known})
        model_id = body["model_id"]
        return self._run(model_id, lambda: {"metrics": self.adapters.step(model_id, adam)})

    # -- weights and checkpoints --------------------------------------------------------------------
    def _dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.root / model_id / kind / name

    def save_weights(self, body: dict[str, Any]) -> str:
        model_id, name = body["model_id"], body.get("path") or f"{int(time.time())}"
        path = self._dir(model_id, "weights", name)
        if path.exists() and not body.get("overwrite"):
            raise UserError(f"checkpoint weights/{name} of {model_id} exists; save under another name")

        def save() -> dict[str, Any]:
            self.adapters.save(model_id, path, optimizer=True)
            return {"path": f"{SCHEME}{model_id}/weights/{name}", "type": "save_weights"}

        return self._run(model_id, save)

    def save_for_sampler(self, body: dict[str, Any]) -> str:
        """A sampling snapshot of the adapter now; with a ``path`` also written to disk (``sampler_weights``)."""
        model_id, name = body["model_id"], body.get("path")
        model = self.model(model_id)

        def save() -> dict[str, Any]:
            model.snapshots += 1
            sid = f"{model_id}:sample:{model.snapshots}"
            path = None
            if name is not None:
                self.adapters.save(model_id, self._dir(model_id, "sampler_weights", name), optimizer=False)
                path = f"{SCHEME}{model_id}/sampler_weights/{name}"
            snap = Snapshot(
                sid, model.base_model, model.snapshots, self.adapters.state(model_id), model_id, path
            )
            self.sampling.add(snap)
            return {"path": path, "sampling_session_id": sid}

        return self._run(model_id, save)

    def load_weights(self, body: dict[str, Any]) -> str:
        """Into an existing client (``model_id``), or a new one made from the checkpoint (``session_id`` +
        ``model_seq_id``, as the SDK's ``create_training_client_from_state`` asks)."""
        path, optimizer = checkpoint_dir(self.root, body["path"]), bool(body.get("optimizer"))
        model_id = body.get("model_id")
        if model_id is None:
            model_id = f"{body['session_id']}:train:{body.get('model_seq_id', 0)}"
            config = Adapters.read_config(path)
            self._new_model(model_id, {**body, "base_model": body.get("base_model")}, int(config.r))
            self._run(model_id, self.adapters.add, model_id, config, None)

        def load() -> dict[str, Any]:
            self.adapters.load(model_id, path, optimizer)
            return {"path": body["path"], "model_id": model_id, "type": "load_weights"}

        return self._run(model_id, load)

    def checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        self.model(model_id)
        return list_checkpoints(self.root, model_id)

    def training_run(self, model_id: str) -> dict[str, Any]:
        m = self.model(model_id)
        return {
            "training_run_id": model_id,
            "base_model": m.base_model,
            "model_owner": m.session_id,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": m.rank,
            "last_request_time": datetime.fromtimestamp(m.last_request, UTC).isoformat(),
            "user_metadata": {k: str(v) for k, v in m.user_metadata.items()},
        }

    def create_sampling_session(self, body: dict[str, Any]) -> str:
        return self.sampling.create(body, self.root, lambda run_id: self.model(run_id).base_model)

    def close(self) -> None:
        self.sampling.close()
        for m in self.models.values():
            m.executor.shutdown(wait=False, cancel_futures=True)
