"""Which roles a run has and how they connect, stated once.

A run's topology — which roles run, the class each is built from, the bus consumer each reads through
and the fields it needs, the fields it writes, which roles receive weights over DCS and which model each
loads — follows from the config alone. It was written out in five places (the role registry, the bus
config, the fields a restarted consumer must not compute twice, the list of loops, the DCS receivers)
and in both run modes' constructors; :meth:`RolePlan.from_config` now says it once, and colocate, fully
async and the bus read it from there.

Names: one name per role — its registry key, its bus consumer's name (for the roles that consume from
the bus) and the ``bus/consumers/<name>/*`` metrics. ActorFwd, Reference and Teacher are one class
(``ForwardWorker``) under three names. (The trainer's consumer was ``actor_train`` before relax-core 0.6:
:data:`RENAMED_CONSUMERS` restores a bus snapshot written then.)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from relax_core.config import RelaxConfig

REGISTRY: dict[str, str] = {
    "rollout": "relax_rollout.worker:RolloutWorker",
    "actor": "relax_train.roles.actor:ActorWorker",
    "actor_fwd": "relax_train.roles.forward:ForwardWorker",
    "reference": "relax_train.roles.forward:ForwardWorker",
    "teacher": "relax_train.roles.forward:ForwardWorker",
    "advantages": "relax_train.roles.advantages:AdvantagesWorker",
}
"""Role name -> ``"module:Class"``, imported when built (relax-core depends on neither package)."""

TRAINER_CONSUMER = "actor"
"""The trainer's bus consumer (its role name, as for every consumer)."""

RENAMED_CONSUMERS = {"actor_train": TRAINER_CONSUMER}
"""Old consumer name -> new, for bus snapshots in checkpoints written under the old names."""


def role_class(name: str) -> type:
    module, _, attr = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class RoleSpec:
    name: str
    needs: tuple[str, ...] = ()
    """Bus fields a sample must have before this role's consumer gets it (empty: not a bus consumer)."""
    writes: tuple[str, ...] = ()
    """Bus fields this role writes (a restarted consumer must not compute them twice)."""
    sampler: str = "in_order"
    """The consumer's sampler (``group``: whole prompt groups)."""
    receives_weights: bool = False
    """A DCS receiver: gets every policy version the trainer publishes."""
    model: str | None = None
    """Which model it loads: ``policy``, ``reference`` or ``teacher`` (None: no model)."""

    @property
    def consumer(self) -> str | None:
        """Its bus consumer: the role's own name, for a role that reads samples from the bus."""
        return self.name if self.needs else None


@dataclass
class RolePlan:
    """The roles of one run, in data order: the rollout first, then the roles computing on its samples
    (ActorFwd, Reference, Teacher, then Advantages), the trainer last."""

    roles: dict[str, RoleSpec]
    cfg: RelaxConfig = field(repr=False)

    @classmethod
    def from_config(cls, cfg: RelaxConfig) -> RolePlan:
        a = cfg.algo
        specs = [RoleSpec("rollout", receives_weights=True, model="policy")]  # (writes the sample itself)
        train_needs = ["advantages"]
        # the exact proximal policy's log-probs, from the trainer's own weights (from its training forward
        # when each batch is one optimizer step: no role then)
        if a.use_actor_fwd and not cfg.prox_from_training_forward:
            specs.append(
                RoleSpec(
                    "actor_fwd",
                    needs=("tokens",),
                    writes=("log_probs",),
                    receives_weights=True,
                    model="policy",
                )
            )
            train_needs.append("log_probs")
        if a.uses_reference:
            specs.append(
                RoleSpec("reference", needs=("tokens",), writes=("ref_log_probs",), model="reference")
            )
            if a.use_kl_loss:
                train_needs.append("ref_log_probs")
        if cfg.uses_teacher:
            specs.append(
                RoleSpec("teacher", needs=("tokens",), writes=("teacher_log_probs",), model="teacher")
            )
            train_needs.append("teacher_log_probs")
        # KL in the reward: advantages wait for the reference log-probs; KL as a loss: the trainer does (the
        # KL in the reward counts the model's tokens only: loss_mask, written with the sample)
        adv_needs = ("reward", "ref_log_probs") if a.uses_reference and a.kl_in_reward else ("reward",)
        specs.append(RoleSpec("advantages", needs=adv_needs, writes=("advantages",), sampler="group"))
        specs.append(RoleSpec("actor", needs=tuple(train_needs), sampler="group", model="policy"))
        return cls({s.name: s for s in specs}, cfg)

    # -- views -------------------------------------------------------------------------------------------
    @property
    def loops(self) -> list[str]:
        """The roles that run a bus-consumer loop besides the trainer, in data order."""
        return [n for n, s in self.roles.items() if s.consumer is not None and n != "actor"]

    @property
    def receivers(self) -> list[str]:
        """DCS receivers in rank order (rank 0 is the trainer)."""
        return [n for n, s in self.roles.items() if s.receives_weights]

    @property
    def consumers(self) -> list[str]:
        """The bus consumers, in data order (the trainer's last)."""
        return [s.consumer for s in self.roles.values() if s.consumer is not None]

    @property
    def outputs(self) -> dict[str, list[str]]:
        """Bus-consumer loop -> the fields it writes."""
        return {n: list(self.roles[n].writes) for n in self.loops}

    def bus_config(self) -> Any:
        from relax_bus import BusConfig, ConsumerSpec

        cfg = self.cfg
        consumers = {
            s.consumer: ConsumerSpec(
                required_fields=list(s.needs), sampler=s.sampler, enforce_staleness=s.name == "actor"
            )
            for s in self.roles.values()
            if s.consumer is not None
        }
        return BusConfig(
            consumers=consumers,
            capacity=max(cfg.run.bus_capacity, cfg.samples_per_rollout),
            max_staleness=cfg.run.max_staleness,
            staleness_policy=cfg.run.staleness_policy,
            group_size=cfg.rollout.n_samples_per_prompt,
        )

    def model_path(self, name: str, inputs: Any, teacher_path: str | None = None) -> str | None:
        """The checkpoint role ``name`` loads (``inputs``: the run's :class:`RunInputs`)."""
        model = self.roles[name].model
        if model == "reference":
            return inputs.ref_model_path or inputs.model_path
        if model == "teacher":
            return teacher_path
        return inputs.model_path if model == "policy" else None

    def arguments(
        self, name: str, bus: Any, inputs: Any, threads: int | None, teacher_path: str | None = None
    ) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` of role ``name``'s constructor, in either mode."""
        cfg, t = self.cfg, {"torch_threads": threads}
        if name == "actor":
            return (cfg, bus, inputs.model_path, inputs.eval_path), t
        if name == "rollout":
            return (cfg, bus, inputs.model_path, inputs.prompt_path), t
        if name == "advantages":
            return (cfg, bus), {}
        return (cfg, bus, name, self.model_path(name, inputs, teacher_path)), t


def bus_config(cfg: RelaxConfig) -> Any:
    """The run's :class:`~relax_bus.BusConfig` (its consumers from :class:`RolePlan`)."""
    return RolePlan.from_config(cfg).bus_config()
