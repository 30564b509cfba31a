"""ActorFwd, Reference and Teacher: one class, the frozen forward roles.

The three differ only in the weights they hold and the bus field they write (``FORWARD_FIELDS``); each reads
scored samples from the bus, computes per-token log-probs and writes them back. ActorFwd also joins the
trainer's weight broadcast (DCS), so it computes with the latest weights, never with half-loaded ones.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.role import Restart, RoleSpec
from relax_core.sample import TOKENS, train_batch
from relax_core.trace import Tracer
from relax_core.weight_audit import WeightAudit
from relax_core.weight_sync import WeightSubscriber
from relax_train.roles.base import BusLoop, DeviceTurns, set_threads

if TYPE_CHECKING:
    from relax_bus import Bus

FORWARD_FIELDS = {
    "actor_fwd": sample.LOG_PROBS,
    "reference": sample.REF_LOG_PROBS,
    "teacher": sample.TEACHER_LOG_PROBS,
}
"""Frozen forward roles and the bus field each writes: ActorFwd (latest trainer weights, the proximal
policy), Reference (the starting policy, for KL) and Teacher (another, possibly larger model, for on-policy
distillation; same tokenizer)."""


class ForwardWorker(BusLoop, DeviceTurns):
    """ActorFwd (proximal-policy log-probs with the latest trainer weights) or Reference (frozen)."""

    phase = "forward"

    @classmethod
    def spec(cls, cfg: RelaxConfig, name: str) -> RoleSpec | None:
        """ActorFwd runs where the trainer's π_prox cannot come from its training forward (several optimizer
        steps per batch, or the inexact proximal policy); Reference where a KL uses it (its log-probs go to
        the trainer for a KL loss, to Advantages for a KL in the reward); Teacher for distillation."""
        if name not in FORWARD_FIELDS:
            raise ValueError(f"ForwardWorker role must be one of {sorted(FORWARD_FIELDS)}, got {name!r}")
        a, writes = cfg.algo, (FORWARD_FIELDS[name],)
        if name == "actor_fwd":
            if not a.use_actor_fwd or cfg.prox_from_training_forward:
                return None
            return RoleSpec(
                name,
                needs=(TOKENS,),
                writes=writes,
                feeds_trainer=True,
                receives_weights=True,
                model="policy",
                restart=(Restart.LEASES, Restart.WEIGHTS),
            )
        if name == "reference" and a.uses_reference:
            return RoleSpec(
                name,
                needs=(TOKENS,),
                writes=writes,
                feeds_trainer=a.use_kl_loss,
                model="reference",
                restart=(Restart.LEASES,),
            )
        if name == "teacher" and cfg.uses_teacher:
            return RoleSpec(
                name,
                needs=(TOKENS,),
                writes=writes,
                feeds_trainer=True,
                model="teacher",
                restart=(Restart.LEASES,),
            )
        return None

    def __init__(
        self,
        cfg: RelaxConfig,
        bus: Bus,
        role: str,
        model_path: str,
        backend: Any = None,
        torch_threads: int | None = None,
    ) -> None:
        set_threads(torch_threads)
        if role not in FORWARD_FIELDS:
            raise ValueError(f"ForwardWorker role must be one of {sorted(FORWARD_FIELDS)}, got {role!r}")
        self.cfg, self.bus, self.consumer = cfg, bus, role
        self.tracer = Tracer(role, cfg.run.trace)
        self.field = FORWARD_FIELDS[role]
        self.batch_size = cfg.train.micro_batch_size
        self.owns_backend = backend is None
        """False for ActorFwd in colocate mode, which computes with the trainer's own backend."""
        if backend is None:
            from relax_train.backends import build_backend

            backend = build_backend(
                cfg.train.train_backend, config=cfg, model_path=model_path, trainable=False
            )
        self.backend = backend
        if role == "teacher":  # another model: the student's recorded MoE routing (R3) does not apply to it
            self.backend.routing = None
        self._weights_lock = threading.Lock()
        """Held by a forward pass and by a weight load: a forward never reads half-loaded weights."""
        self.audit = WeightAudit(cfg.run.output_dir, role) if cfg.run.verify_weight_sync else None
        self.weights = WeightSubscriber(cfg.run, self._load_weights, lambda: self.backend.version, role)

    def heartbeat(self) -> dict[str, Any]:
        """The loop's progress, and why the last weights could not be loaded, if they could not."""
        return {**super().heartbeat(), "error": self.weights.load_error}

    def handle(self, batch) -> None:
        with self._weights_lock:  # (the receiver thread loads new weights only between two forwards)
            lp = self.backend.compute_log_probs(train_batch(batch.data))
            version = self.backend.version
        self.bus.add_fields(batch.ids, {self.field: lp, sample.VERSION_OF[self.field]: [version] * len(lp)})

    def _load_weights(self, version: int, tensors: dict[str, Any]) -> None:
        with self._weights_lock:
            self.backend.load_weights(tensors, version)
            if self.audit is not None:  # (--verify-weight-sync: what it holds now, as the trainer sums it)
                from relax_core.dcs import checksum

                self.audit.log(version, checksum(self.backend.named_weights()))

    def connect_dcs(self, init_method: str, world_size: int, rank: int) -> None:
        """Join the trainer's weight broadcast; called again when the health manager re-forms the group."""
        self.weights.connect_dcs(init_method, world_size, rank)

    def wait_weights(self, version: int, timeout_s: float = 300.0) -> int:
        """Block until weights of ``version`` (or newer) are loaded: a restarted role must not compute
        with its start-up weights."""
        return self.weights.wait(version, timeout_s)

    def weight_version(self) -> int:
        """The version of the weights held now."""
        return self.backend.version

    def close(self) -> None:
        """Leave the weight broadcast; close a backend that owns processes (a megatron rank group)
        unless it is the trainer's (ActorFwd in colocate shares it)."""
        self.weights.close()
        if self.owns_backend and callable(getattr(self.backend, "close", None)):
            self.backend.close()
