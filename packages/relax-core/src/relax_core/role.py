"""The Role interface: what the drivers call on a role, and what they must know about it (its spec).

Why: a run's roles (rollout, ActorFwd, Reference, Teacher, Advantages, the trainer) are driven by two
drivers — colocate (:mod:`relax_core.colocate`, the roles in this process) and fully async
(:mod:`relax_core.async_run`, each a Ray actor). The drivers decide what to do with a role from its
:class:`RoleSpec` alone — its part in the run, the bus fields it reads and writes, whether it receives
weights, which model it loads and the steps a restarted copy must redo — never from its name, so that a
new role is one class plus one registry entry (:mod:`relax_core.roles`). The methods they call are named
here once, per part: every role answers :class:`Role`; a bus consumer also :class:`ConsumerRole`, a
weight receiver :class:`ReceivesWeights`, and the one rollout and the one trainer
:class:`RolloutRole` / :class:`TrainerRole`. :func:`missing_methods` holds a class to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol

Part = Literal["rollout", "consumer", "trainer"]
"""How a driver drives a role: ``rollout`` (the one producer: generates and puts batches), ``consumer``
(reads samples from the bus, computes, writes fields back: ActorFwd, Reference, Teacher, Advantages) or
``trainer`` (the one consumer that trains, checkpoints and publishes weights)."""


class Restart(StrEnum):
    """What a role restarted in place (fully async) must redo before its loop starts again; the driver
    (:meth:`relax_core.async_run.AsyncRun.restart`) does each at its point around building the new actor."""

    CHECKPOINT = "checkpoint"
    """Ack the batches the latest checkpoint holds, give the rest back, load it (the trainer)."""
    JOURNAL = "journal"
    """Continue at the first step its journal does not show on the bus (the rollout)."""
    LEASES = "leases"
    """Give its unfinished samples back to the bus; those whose fields it had written count as done."""
    WEIGHTS = "weights"
    """Re-form the weight broadcast (the trainer sends its current weights; a receiver waits for them)."""
    STATE = "state"
    """Load the newest state it saved itself (a consumer that trains its own model: the Critic). The same
    role also loads its state beside the trainer's checkpoint when a run resumes (``--load``)."""


@dataclass(frozen=True)
class RoleSpec:
    """What the drivers, the bus config and the placement need to know about one role of a run."""

    name: str
    """Its registry key, its bus consumer's name and its ``bus/consumers/<name>/*`` metrics."""
    part: Part = "consumer"
    needs: tuple[str, ...] = ()
    """Bus fields a sample must have before this role's consumer gets it (empty: not a bus consumer)."""
    writes: tuple[str, ...] = ()
    """Bus fields this role writes (a restarted consumer does not compute them twice)."""
    feeds_trainer: bool = False
    """The trainer waits for this role's ``writes`` too (they join its needs)."""
    sampler: str = "in_order"
    """The consumer's sampler (``group``: whole prompt groups)."""
    receives_weights: bool = False
    """A DCS receiver: gets every policy version the trainer publishes."""
    model: str | None = None
    """Which model it loads: ``policy``, ``reference``, ``teacher``, or one of the role's own (``critic``: any
    other name; its :attr:`checkpoint`) (None: no model). A consumer with
    the policy computes with the trainer's own model in colocate mode; fully async with megatron, a role
    with a model reserves a replica of the trainer's GPUs (:func:`relax_core.placement.gpu_demand`)."""
    checkpoint: str | None = None
    """The checkpoint its model starts from when it has one of its own (the critic's --critic-checkpoint);
    None: its kind's — the reference's or the teacher's checkpoint, else the policy's (a model of the role's
    own, as the critic's value model, starts from the policy's trunk)."""
    restart: tuple[Restart, ...] = ()
    """What a restarted copy redoes (:class:`Restart`)."""

    def __post_init__(self) -> None:
        if self.part in ("consumer", "trainer") and not self.needs:
            raise ValueError(f"role {self.name!r}: a {self.part} reads from the bus: give its spec `needs`")
        if self.feeds_trainer and not self.writes:
            raise ValueError(f"role {self.name!r} feeds the trainer but writes nothing: give it `writes`")
        if self.receives_weights and Restart.WEIGHTS not in self.restart:
            raise ValueError(
                f"role {self.name!r} receives weights: add Restart.WEIGHTS to its `restart` (a restarted "
                "receiver must wait for the current weights)"
            )

    @property
    def consumer(self) -> str | None:
        """Its bus consumer: the role's own name, for a role that reads samples from the bus."""
        return self.name if self.needs else None


class Role(Protocol):
    """Every role, in both modes. The class also states its spec for a run (None: not in this run)."""

    @classmethod
    def spec(cls, cfg: Any, name: str) -> RoleSpec | None:
        """This role's spec under registry key ``name`` for run config ``cfg``; None leaves it out."""

    def heartbeat(self) -> dict[str, Any]:
        """For the health manager: ``pid`` and ``age_s`` (seconds since its loop last made progress)."""

    def get_spans(self) -> list[dict[str, Any]]:
        """Its trace spans (``--trace``)."""

    def close(self) -> None:
        """Release what it holds (processes, the weight broadcast, files)."""


class ConsumerRole(Role, Protocol):
    """A bus consumer besides the trainer: take what is ready, compute, write fields back, ack."""

    def run(self) -> int:
        """Fully async: loop until the bus closes; returns the samples handled."""

    def drain(self) -> int:
        """Colocate: handle everything ready now; returns the samples handled."""


class ReceivesWeights(Protocol):
    """A role that holds the policy's weights and receives each version the trainer publishes (DCS)."""

    def connect_dcs(self, init_method: str, world_size: int, rank: int) -> None:
        """Join the trainer's weight broadcast (again after any member restarted)."""

    def wait_weights(self, version: int, timeout_s: float = 300.0) -> int:
        """Block until weights of ``version`` or newer are loaded (a restarted receiver)."""

    def weight_version(self) -> int:
        """The version held now (for the live status)."""


class StatefulRole(Protocol):
    """A consumer that trains a model of its own (the Critic): it saves its state beside the trainer's
    checkpoints and loads it back (:attr:`Restart.STATE`)."""

    def save_state(self, checkpoint: str) -> str:
        """Save its state beside the trainer's checkpoint ``checkpoint`` (one the run wrote outside its own
        schedule: a stop by signal); returns where."""

    def load_state(self, checkpoint: str | None) -> int:
        """Load the state saved with the trainer's checkpoint ``checkpoint`` (a resumed run), or, None, the
        newest this run saved (a role restarted in place); returns the version loaded (0: none found)."""


class RolloutRole(Role, ReceivesWeights, Protocol):
    """The one producer: generates, scores and puts batches; journals each so a new process goes on."""

    def run(self, start_step: int = 0) -> dict[str, Any]:
        """Fully async: generate from ``start_step`` until the bus closes; returns its stats."""

    def produce(self, step: int) -> dict[str, float]:
        """Colocate: one batch (step ``step``)."""

    def reset_journal(self) -> None: ...
    def seed_journal(self, begun: dict[str, dict[str, int]], next_step: int) -> None: ...
    def load_data_state(self, state: dict[str, int] | None) -> None: ...
    def recover(self) -> int:
        """After a crash: load the journal; the first step not on the bus (:attr:`Restart.JOURNAL`)."""

    def restart_engine(self, member_id: str) -> dict[str, Any]: ...
    def set_weights(self, tensors: dict[str, Any], version: int) -> None: ...
    def release_memory(self) -> None: ...
    def resume_memory(self, tags: list[str] | None = None) -> None: ...
    def get_record(self) -> RolloutRecord:
        """What it did so far (a copy where it runs in another process)."""

    def engines(self) -> list[dict[str, Any]]: ...


@dataclass
class TrainerRecord:
    """What the trainer trained and logged so far: the run's report and its audits read it (exact resume,
    restarts, weight-sync checks), and a checkpoint carries its ids (a restarted trainer reports the whole run)."""

    history: list[dict[str, Any]] = field(default_factory=list)
    """Every logged row (training steps and evaluations), in order."""
    trained_ids: list[int] = field(default_factory=list)
    """The bus ids of every trained sample."""
    trained_prompts: list[list[str]] = field(default_factory=list)
    """Prompt ids of every trained batch, one list per step."""
    weight_log: dict[int, str] = field(default_factory=dict)
    """--verify-weight-sync: each weight version's checksum as sent."""


@dataclass
class RolloutRecord:
    """What the rollout did so far, for the run's report and audits."""

    stats: dict[str, Any] = field(default_factory=dict)
    """Its counters: samples put, seconds generating / scoring / waiting, rows skipped, the reward's."""
    weight_log: dict[int, str] = field(default_factory=dict)
    """--verify-weight-sync: each weight version's checksum as loaded by the engine."""
    prompt_log: list[tuple[int, list[str]]] = field(default_factory=list)
    """(step, prompt row ids) of every batch put on the bus, in order."""


class TrainerRole(Role, Protocol):
    """The one trainer: trains a batch per step, publishes weights, evaluates, checkpoints."""

    def run(self, start_step: int, num_steps: int) -> list[dict[str, Any]]:
        """Fully async: train steps ``start_step .. num_steps - 1`` (or until asked to stop); the history."""

    def train(self, step: int) -> dict[str, Any]:
        """Colocate: one step; its metrics."""

    def connect_dcs(self, init_method: str, world_size: int, republish: bool = False) -> int:
        """Open the weight broadcast; returns the version the receivers will hold."""

    def publish_weights(self) -> None: ...
    def eval_now(self, step: int) -> float | None: ...
    def progress(self) -> int:
        """The policy version (steps trained)."""

    def save(self, path: str | None = None) -> str:
        """A checkpoint; its path."""

    def load(self, path: str) -> dict[str, Any]:
        """Resume from a checkpoint; its ``version`` and run state."""

    def request_stop(self, checkpoint_dir: str) -> None: ...
    def get_interrupted(self) -> str | None: ...
    def get_record(self) -> TrainerRecord:
        """What it trained and logged so far (a copy where it runs in another process)."""


def protocols(spec: RoleSpec) -> list[type]:
    """The protocols a role with ``spec`` must answer."""
    by_part: dict[str, list[type]] = {
        "rollout": [RolloutRole],
        "trainer": [TrainerRole],
        "consumer": [ConsumerRole],
    }
    out = by_part[spec.part]
    if spec.receives_weights and spec.part == "consumer":
        out = [*out, ReceivesWeights]
    if Restart.STATE in spec.restart:
        out = [*out, StatefulRole]
    return out


def missing_methods(cls: type, spec: RoleSpec) -> list[str]:
    """The methods ``cls`` lacks for the protocols its spec implies (empty: it answers them all)."""
    ours = {Role, ConsumerRole, ReceivesWeights, StatefulRole, RolloutRole, TrainerRole}
    names = {
        n
        for p in protocols(spec)
        for base in p.__mro__
        if base in ours
        for n, v in vars(base).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, classmethod))
    }
    return sorted(n for n in names if not callable(getattr(cls, n, None)))
