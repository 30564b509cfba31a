"""Which roles a run has and how they connect: the role registry and the run's :class:`RolePlan`.

The registry: the packages that hold roles register them as Python entry points, group ``relax.roles``
(``rollout`` in relax-rollout's pyproject.toml; ``actor``, ``actor_fwd``, ``reference``, ``teacher``,
``critic``, ``advantages`` in relax-train's), and the evaluator the trainer runs under ``relax.evaluators``
(``greedy``, relax-rollout's). relax-core loads them through a :class:`~relax_core.registry.Registry` (:data:`ROLES`), so it names no class
of the packages above it (relax-core depends on neither) and adding a role is one class (with its
:meth:`~relax_core.role.Role.spec`) plus one entry point line. A registry can also be passed in
(:meth:`RoleRegistry.with_role`: a test's role, a notebook's), through
:class:`~relax_core.controller.Controller`.

The plan: each registered class states its :class:`~relax_core.role.RoleSpec` for the run's config (or
None: not in this run); :meth:`RolePlan.from_config` puts them in data order — the rollout first, the roles
computing on its samples after the roles whose fields they need (otherwise in registry order: by package,
then name), the trainer last — and derives the rest: the bus config, the loops, the DCS receivers and each role's constructor
arguments. Both run modes, the placement and the bus read it from there.

Names: one name per role — its registry key, its bus consumer's name (for the roles that consume from the
bus) and the ``bus/consumers/<name>/*`` metrics. ActorFwd, Reference and Teacher are one class
(``ForwardWorker``) under three names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from relax_core.config import RelaxConfig
from relax_core.registry import Registry
from relax_core.role import Restart, RoleSpec, missing_methods

if TYPE_CHECKING:
    from relax_bus import Bus
    from relax_core.run import RunInputs

ROLE_GROUP = "relax.roles"
"""The entry-point group roles are registered under (name: the role's name; value: ``module:Class``)."""
EVALUATOR_GROUP = "relax.evaluators"
"""The entry-point group of evaluator factories (``factory(cfg, model_path, eval_path)(model) -> accuracy``)."""
EVALUATOR = "greedy"
"""The evaluator the trainer runs on ``--eval-data``."""

TRAINER_CONSUMER = "actor"
"""The trainer's bus consumer (its role name, as for every consumer)."""


@dataclass(frozen=True)
class RoleRegistry:
    """Role name -> class, in registry order, and the trainer's evaluator factory (None: none installed).
    A class is ``type[Any]``: its ``spec`` and constructor are reached by duck type, the protocols of
    :mod:`relax_core.role` checked at run time (:func:`~relax_core.role.missing_methods`)."""

    classes: Mapping[str, type[Any]]
    evaluator: Callable[..., Any] | None = None

    @classmethod
    def installed(cls) -> RoleRegistry:
        """The roles and evaluator the installed packages register (entry points; loaded once)."""
        return _installed()

    def with_role(self, name: str, role: type[Any]) -> RoleRegistry:
        """This registry and ``role`` under ``name`` (replacing a role of that name)."""
        return replace(self, classes={**self.classes, name: role})


ROLES = Registry("role", ROLE_GROUP)
"""The installed roles (relax-rollout and relax-train register theirs as entry points)."""
EVALUATORS = Registry("evaluator", EVALUATOR_GROUP)
"""The installed evaluator factories."""


@functools.cache
def _installed() -> RoleRegistry:
    evaluator = EVALUATORS.load(EVALUATOR) if EVALUATOR in EVALUATORS else None
    return RoleRegistry({name: ROLES.load(name) for name in ROLES}, evaluator)


@dataclass
class RolePlan:
    """The roles of one run (their specs, classes and the trainer's evaluator), in data order: the rollout
    first, then the roles computing on its samples (ActorFwd, Advantages, Reference, Teacher; Advantages
    after Reference when the KL is in the reward), the trainer last."""

    roles: dict[str, RoleSpec]
    cfg: RelaxConfig = field(repr=False)
    classes: dict[str, type[Any]] = field(default_factory=dict, repr=False)
    evaluator: Callable[..., Any] | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg: RelaxConfig, registry: RoleRegistry | None = None) -> RolePlan:
        """Every registered role's spec for ``cfg`` (``registry``: default the installed one)."""
        reg = registry if registry is not None else RoleRegistry.installed()
        specs: dict[str, RoleSpec] = {}
        for name, role in reg.classes.items():
            spec: RoleSpec | None = role.spec(cfg, name)
            if spec is None:
                continue
            if spec.name != name:
                raise ValueError(
                    f"{role.__name__}.spec named its role {spec.name!r}; it is registered as {name!r}"
                )
            if missing := missing_methods(role, spec):
                raise TypeError(f"role {name!r} ({role.__name__}, a {spec.part}) lacks {', '.join(missing)}")
            specs[name] = spec
        for part in ("rollout", "trainer"):
            if [s.part for s in specs.values()].count(part) != 1:
                raise ValueError(
                    f"a run needs exactly one {part} role; the registry gives {sorted(specs)} "
                    "(install relax-rollout and relax-train: they register theirs as entry points)"
                )
        ordered = _data_order(list(specs.values()))
        fed = tuple(f for s in ordered if s.feeds_trainer for f in s.writes)
        ordered = [replace(s, needs=(*s.needs, *fed)) if s.part == "trainer" else s for s in ordered]
        names = {s.name for s in ordered}
        return cls(
            {s.name: s for s in ordered},
            cfg,
            {n: c for n, c in reg.classes.items() if n in names},
            reg.evaluator,
        )

    # -- views -------------------------------------------------------------------------------------------
    @property
    def rollout(self) -> str:
        """The rollout role's name."""
        return next(n for n, s in self.roles.items() if s.part == "rollout")

    @property
    def trainer(self) -> str:
        """The trainer role's name (its bus consumer's too)."""
        return next(n for n, s in self.roles.items() if s.part == "trainer")

    @property
    def loops(self) -> list[str]:
        """The bus consumers besides the trainer, in data order (each runs its own loop)."""
        return [n for n, s in self.roles.items() if s.part == "consumer"]

    @property
    def stateful(self) -> list[str]:
        """The consumers that keep a state of their own (:attr:`Restart.STATE`: a model they train, the
        critic's): the drivers save it with each checkpoint and load it on --load and on a restart."""
        return [n for n in self.loops if Restart.STATE in self.roles[n].restart]

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

    def role_class(self, name: str) -> type[Any]:
        """The class role ``name`` is built from."""
        return self.classes[name]

    def bus_config(self) -> Any:
        from relax_bus import BusConfig, ConsumerSpec

        cfg = self.cfg
        consumers = {
            s.consumer: ConsumerSpec(
                required_fields=list(s.needs), sampler=s.sampler, enforce_staleness=s.part == "trainer"
            )
            for s in self.roles.values()
            if s.consumer is not None
        }
        return BusConfig(
            consumers=consumers,
            capacity=cfg.bus_samples,
            max_staleness=cfg.run.max_staleness,
            staleness_policy=cfg.run.staleness_policy,
            group_size=cfg.rollout.n_samples_per_prompt,
        )

    def model_path(self, name: str, inputs: RunInputs, teacher_path: str | None = None) -> str | None:
        """The checkpoint role ``name`` loads (``inputs``: the run's :class:`RunInputs`): its spec's
        ``checkpoint``, else its model kind's (:attr:`RoleSpec.checkpoint`); None for a role without a model."""
        spec = self.roles[name]
        if spec.model is None:
            return None
        if spec.checkpoint is not None:
            return spec.checkpoint
        if spec.model == "reference":
            return inputs.ref_model_path or inputs.model_path
        if spec.model == "teacher":
            return teacher_path
        return inputs.model_path

    def arguments(
        self, name: str, bus: Bus, inputs: RunInputs, threads: int | None, teacher_path: str | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of role ``name``'s constructor, in either mode, by its part: the trainer
        ``(cfg, bus, model, eval data, evaluator=)``, the rollout ``(cfg, bus, model, prompts)``, a consumer
        with a model ``(cfg, bus, name, its model)``, one without ``(cfg, bus)``."""
        cfg, t, spec = self.cfg, {"torch_threads": threads}, self.roles[name]
        if spec.part == "trainer":
            return (cfg, bus, inputs.model_path, inputs.eval_path), {**t, "evaluator": self.evaluator}
        if spec.part == "rollout":
            return (cfg, bus, inputs.model_path, inputs.prompt_path), t
        if spec.model is None:
            return (cfg, bus), {}
        return (cfg, bus, name, self.model_path(name, inputs, teacher_path)), t


def _data_order(specs: list[RoleSpec]) -> list[RoleSpec]:
    """The rollout, then each consumer once every role writing a field it needs is placed (registry order
    among those free to go), the trainer last."""
    first = [s for s in specs if s.part == "rollout"]
    last = [s for s in specs if s.part == "trainer"]
    todo = [s for s in specs if s.part == "consumer"]
    out = list(first)
    while todo:
        writers = {f for s in todo for f in s.writes}
        free = next((s for s in todo if not writers.intersection(s.needs) - set(s.writes)), None)
        if free is None:
            raise ValueError(
                f"roles {[s.name for s in todo]} need each other's fields: no order computes them"
            )
        out.append(free)
        todo.remove(free)
    return out + last


def bus_config(cfg: RelaxConfig) -> Any:
    """The run's :class:`~relax_bus.BusConfig` (its consumers from :class:`RolePlan`)."""
    return RolePlan.from_config(cfg).bus_config()
