"""The Critic role: PPO's learned value model as a service of its own on the bus.

Why a role and not a part of the trainer: the critic has its own model, optimizer and schedule, and in
fully-async mode it values samples as they land while the trainer trains older ones — the same place on the
bus as Reference or ActorFwd, so fully-async PPO comes from the architecture (upstream Relax's guide says
its PPO runs in colocate only). Each batch it takes (whole groups, once scored):

1. values every response token with the weights it holds now and writes them (``values``, with
   ``values_version``: the batches it had trained on, so the trainer sees how far they lag its step);
2. computes its targets with the same GAE the Advantages role uses (:func:`~relax_train.algorithms.gae.gae_fields`);
3. keeps the batch until it holds a rollout batch's worth of samples, then trains on it: --critic-epochs passes
   of optimizer steps of --critic-global-batch-size samples, PPO's clipped value loss. Training on whole
   rollout batches makes its version count rollout steps in both modes, as the trainer's does.

Writing the values before training lets the Advantages role and the trainer go on while the critic trains.
Its state (weights, optimizer, version) is saved under ``<--save>/critic/step_<version>`` whenever its
version reaches a checkpoint step (--save-interval, and the run's last step): beside the trainer's checkpoint of
that step, and read back on ``--load`` (:meth:`CriticWorker.load_state`) and by a critic restarted in place.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core import sample
from relax_core.checkpoints import other_run, problem
from relax_core.config import RelaxConfig
from relax_core.resume import RUN_STATE
from relax_core.role import Restart, RoleSpec
from relax_core.sample import REF_LOG_PROBS, REWARD, TOKENS, VALUES, VALUES_VERSION, columns, train_batch
from relax_core.trace import Tracer
from relax_train.algorithms.gae import gae_fields
from relax_train.roles.base import BusLoop, DeviceTurns, set_threads

if TYPE_CHECKING:
    from relax_bus import Bus

logger = logging.getLogger(__name__)

CRITIC_DIR = "critic"
"""The critic's checkpoints, beside the trainer's ``step_*`` under --save: ``critic/step_<version>``."""


class CriticWorker(BusLoop, DeviceTurns):
    """Values each response token, writes the values to the bus, fits them to GAE's returns."""

    phase = "critic"

    @classmethod
    def spec(cls, cfg: RelaxConfig, name: str) -> RoleSpec | None:
        """With --advantage-estimator gae: whole groups once scored (its targets need the rewards; with
        the KL in the reward, Reference's log-probs too). A restart in place loads its newest saved state."""
        if not cfg.uses_critic:
            return None
        a = cfg.algo
        needs = (TOKENS, REWARD, REF_LOG_PROBS) if a.uses_reference and a.kl_in_reward else (TOKENS, REWARD)
        return RoleSpec(
            name,
            needs=needs,
            writes=(VALUES, VALUES_VERSION),
            sampler="group",
            model="critic",
            checkpoint=cfg.critic.critic_checkpoint,  # (None: the policy's trunk with a new value head)
            restart=(Restart.LEASES, Restart.STATE),
        )

    def __init__(
        self,
        cfg: RelaxConfig,
        bus: Bus,
        role: str,
        model_path: str,
        backend: Any = None,
        torch_threads: int | None = None,
    ) -> None:
        """``backend``: a value backend (:class:`~relax_train.backends.value.ValueBackend`); default one of
        --train-backend on ``model_path``."""
        set_threads(torch_threads)
        self.cfg, self.bus, self.consumer = cfg, bus, role
        self.tracer = Tracer(role, cfg.run.trace)
        self.batch_size = cfg.samples_per_rollout
        if backend is None:
            from relax_train.backends.value import build_value_backend

            backend = build_value_backend(cfg.train.train_backend, config=cfg, model_path=model_path)
        self.backend = backend
        self.owns_backend = True
        """Its model is its own (colocate --offload: it hands the devices over like the trainer)."""
        self._lock = threading.Lock()
        """Held while it values, trains or loads: a state load never lands mid-update."""
        self._pending: list[dict[str, Any]] = []
        """Valued samples (with their returns) not trained on yet: a rollout batch's worth trains at once."""
        self.last_update: dict[str, float] = {}
        """The metrics of its last update (``critic/*``), carried on the samples it values next."""

    # -- one batch -----------------------------------------------------------------------------------
    def handle(self, batch) -> None:
        d = train_batch(batch.data)
        with self._lock:
            values = self.backend.compute_values(d)
            version = self.backend.version
            update = dict(self.last_update)
        self.bus.add_fields(
            batch.ids,
            {
                VALUES: values,
                VALUES_VERSION: [version] * len(values),
                sample.CRITIC_UPDATE: [update] * len(values),
            },
        )
        _, returns = gae_fields(self.cfg, d, values)
        keep = (sample.TOKENS, sample.PROMPT_LEN, sample.RESPONSE_LEN, sample.LOSS_MASK)
        for i in range(len(values)):
            row = {k: columns(d)[k][i] for k in keep}
            row[VALUES], row[sample.RETURNS] = values[i], returns[i]
            self._pending.append(row)
        while len(self._pending) >= self.cfg.samples_per_rollout:
            self._train(self._pending[: self.cfg.samples_per_rollout])
            del self._pending[: self.cfg.samples_per_rollout]

    def _train(self, rows: list[dict[str, Any]]) -> None:
        cols = {k: [r[k] for r in rows] for k in rows[0]}
        with self._lock, self.tracer.span("critic_train", n=len(rows), version=self.backend.version):
            metrics = self.backend.train_values(cols)
            version = self.backend.version
        out = {f"critic/{k}": float(v) for k, v in metrics.items()}
        out["critic/version"] = float(version)
        self.last_update = out
        if self._saves_at(version):
            self._save(version)

    # -- state ---------------------------------------------------------------------------------------
    def _root(self, base: str | Path | None = None) -> Path | None:
        base = base if base is not None else self.cfg.train.save
        return Path(base) / CRITIC_DIR if base else None

    def _saves_at(self, version: int) -> bool:
        t = self.cfg.train
        if not t.save:
            return False
        return version == t.num_rollout or bool(t.save_interval and version % t.save_interval == 0)

    def save_state(self, checkpoint: str) -> str:
        """Its state beside the trainer's checkpoint ``checkpoint`` (``.../step_<v>``, written when a signal
        stopped the run): ``.../critic/step_<v>``; the path."""
        ckpt = Path(checkpoint)
        return self._save(_step_of(ckpt), self._root(ckpt.parent))

    def _save(self, version: int, root: Path | None = None) -> str:
        """Its state under ``root`` (default ``<--save>/critic``) as ``step_<version>``, whole or not at all."""
        from relax_core.checkpoints import save_atomically
        from relax_core.resume import CheckpointDir

        root = root if root is not None else self._root()
        if root is None:
            raise ValueError("the critic saves under --save: set --save DIR")
        run_id = self._run_id()

        def write(tmp: Path) -> None:
            self.backend.save_checkpoint(tmp)
            (tmp / RUN_STATE).write_text(json.dumps({"run_id": run_id}))

        with self._lock:
            target = CheckpointDir.for_step(root, version).path
            if target.is_dir() and other_run(target, run_id):  # another run's state of this step: replaced
                shutil.rmtree(target)
            with self.tracer.span("save", version=version):
                save_atomically(target, write)
        return str(target)

    def _run_id(self) -> str | None:
        from relax_core.ownership import read_record

        return read_record(self.cfg.run.output_dir).get("run_id")

    def load_state(self, checkpoint: str | None) -> int:
        """Resume: the state saved for the trainer's checkpoint ``checkpoint`` (``.../step_<v>``: its
        ``critic/step_<v>`` beside it; the newest before it, with a warning, when the run stopped between
        two); None (restarted in place): the newest this run saved under --save. Returns the version
        loaded; 0 when there is none (the critic starts from its initial model, with a warning)."""
        from relax_core.resume import CheckpointDir

        if checkpoint is not None:
            ckpt = Path(checkpoint)
            root, want = self._root(ckpt.parent), _step_of(ckpt)
        else:  # (a restart in place: only this run's own states)
            root, want = self._root(), None
        found = (
            sorted(_saved(root, self._run_id() if checkpoint is None else None)) if root is not None else []
        )
        usable = [v for v in found if want is None or v <= want]
        if not usable:
            logger.warning(
                "critic: no saved state %s under %s: it starts from its initial model",
                f"for step {want}" if want is not None else "",
                root,
            )
            return 0
        v = usable[-1]
        assert root is not None, "states were found under it"
        if want is not None and v != want:
            logger.warning(
                "critic: no state saved for step %d; loading step %d's (the newest before)", want, v
            )
        with self._lock:
            self.backend.load_checkpoint(CheckpointDir.for_step(root, v).path)
            self._pending.clear()
        return int(self.backend.version)

    def close(self) -> None:
        """Close a backend that owns processes (a megatron rank group)."""
        if callable(getattr(self.backend, "close", None)):
            self.backend.close()


def _step_of(checkpoint: Path) -> int:
    """The step of a trainer's checkpoint directory (``step_000004`` -> 4)."""
    name = checkpoint.name
    if not (name.startswith("step_") and name[5:].isdigit()):
        raise ValueError(
            f"{checkpoint}: not a trainer checkpoint (step_<N>): pass the step directory --load resolved"
        )
    return int(name[5:])


def _saved(root: Path, run_id: str | None = None) -> list[int]:
    """The versions of the whole critic states under ``root`` (``run_id``: of that run only)."""
    if not root.is_dir():
        return []
    out = []
    for d in root.glob("step_*"):
        if d.is_dir() and d.name[5:].isdigit() and problem(d) is None and not other_run(d, run_id):
            out.append(int(d.name[5:]))
    return out
