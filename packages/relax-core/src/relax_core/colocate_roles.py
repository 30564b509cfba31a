"""The roles of a colocate run, built in this process from the :class:`RolePlan`, and their turns on the
devices (``--offload``) and the cores (:class:`~relax_core.threads.ThreadGovernor`). Apart from the step loop
(:mod:`relax_core.colocate`) so that the loop reads in one short file."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from relax_core import run as shared
from relax_core.checkpoints import latest_checkpoint
from relax_core.config import RelaxConfig
from relax_core.roles import RolePlan, RoleRegistry
from relax_core.threads import ThreadGovernor

if TYPE_CHECKING:
    from relax_bus import DataBus


class ColocateRoles:
    """The roles built from the :class:`RolePlan` in this process and their turns on the devices; closed in
    reverse (a megatron trainer's rank group last), then the Ray its ranks needed."""

    def __init__(
        self, cfg: RelaxConfig, inputs: shared.RunInputs, registry: RoleRegistry | None = None
    ) -> None:
        """``registry``: the role registry (default: the installed roles)."""
        from relax_bus import DataBus

        self.cfg, self.inputs = cfg, inputs
        self.built: list[Any] = []
        """The roles built so far (each its part's class, reached by duck type), closed in reverse."""
        self.plan = RolePlan.from_config(cfg, registry)
        self.ray_started = shared.start_ray_for_ranks(cfg)
        try:
            self._build(DataBus)
        except BaseException:
            self.__exit__()
            raise

    def _build(self, bus_class: type[DataBus]) -> None:
        cfg, inputs, plan = self.cfg, self.inputs, self.plan
        threads = cfg.run.torch_threads or min(2, os.cpu_count() or 1)
        self.threads = ThreadGovernor(threads)
        self.bus_cfg = plan.bus_config()
        self.bus = bus_class(self.bus_cfg)
        teacher = shared.teacher_path(cfg, inputs) if cfg.uses_teacher else None

        def build(name: str, **extra: Any) -> Any:
            args, kwargs = plan.arguments(name, self.bus, inputs, threads, teacher)
            role = plan.role_class(name)(*args, **{**kwargs, **extra})
            self.built.append(role)
            return role

        self.trainer = build(plan.trainer, send_weights=self._publish)  # (weights: straight to the engine)
        self.rollout = build(plan.rollout)
        self.helpers = [build(n, **self._shared_model(n)) for n in plan.loops]
        # --offload: the engine and the roles with models take turns on the devices
        self.offload = shared.offloads(cfg)
        owners = [self.trainer, *(h for h in self.helpers if getattr(h, "owns_backend", False))]
        self.turns = owners if self.offload else []

    def _shared_model(self, name: str) -> dict[str, Any]:
        """A consumer computing with the policy (ActorFwd) uses the trainer's own backend here: its weights.
        With LoRA, the Reference on the policy's checkpoint (no --ref-checkpoint) uses the trainer's base
        view: the same weights with the adapters off, so the base model is held once, not twice."""
        model = self.plan.roles[name].model
        if model == "policy":
            return {"backend": self.trainer.backend}
        same_base = self.plan.model_path(name, self.inputs) == self.inputs.model_path
        if model == "reference" and self.cfg.lora.enabled and same_base:
            return {"backend": self.trainer.backend.base_view()}
        return {}

    def _publish(self, named: Any, version: int) -> None:
        if self.offload:  # the engine's weight memory back first (its KV cache after the trainer left)
            self.rollout.resume_memory(["weights"])
        self.rollout.set_weights(dict(named), version)

    def resume(self) -> int:
        """``--load``: the trainer's checkpoint (and the state saved beside it of the roles that train a model of
        their own: the critic), and the same prompts from there on; the step to start at."""
        self.rollout.reset_journal()  # (the trainer's checkpoints read the data position there)
        if not self.cfg.train.load:
            return 0
        ckpt = latest_checkpoint(self.cfg.train.load, trust_unverified=self.cfg.train.trust_unverified)
        meta = self.trainer.load(ckpt)
        version = int(meta["version"])
        for helper in self._stateful():  # (the critic's state beside it)
            helper.load_state(ckpt)
        if "data" in meta:
            self.rollout.load_data_state(meta["data"])
        self.rollout.seed_journal({}, version)
        self.bus.set_trainer_version(version)
        return version

    def _stateful(self) -> list[Any]:
        """The consumers that train a model of their own (the critic)."""
        stateful = set(self.plan.stateful)
        return [h for n, h in zip(self.plan.loops, self.helpers) if n in stateful]

    def save_states(self, checkpoint: str) -> None:
        """Their state beside the trainer's ``checkpoint`` (one written outside the save schedule)."""
        for helper in self._stateful():
            helper.save_state(checkpoint)

    def engine_turn(self) -> None:  # (the trainer's state waits in host memory)
        if self.offload:
            for r in self.turns:
                r.offload()
            self.rollout.resume_memory()

    def trainer_turn(self) -> None:
        if self.offload:
            self.rollout.release_memory()
            for r in self.turns:
                r.onload()

    def __enter__(self) -> ColocateRoles:
        return self

    def __exit__(self, *exc: Any) -> None:
        for role in reversed(self.built):
            if callable(getattr(role, "close", None)):
                role.close()
        if self.ray_started:
            shared.stop_ray()
