"""The staleness rule, in one place: which policy versions a training step may see, and who waits for whom.

Why a module of its own: the bound is applied by the bus at three moments (``admit`` gates a producer,
``get`` drops or refuses stale samples, the histogram records each delivered sample's lag) and by a rollout
worker outside the bus (an engine must hold recent enough weights before it generates a step). Each of those
once carried its own copy of ``step - max_staleness``; an off-by-one between them would let a sample through
that another place refuses. Every caller now asks :class:`StalenessBound`.

Definitions (the trainer takes rollout step ``k``'s samples at trainer version ``k``):

- *lag* of a sample = trainer version when it is delivered - the policy version that generated it;
- a sample is *stale* when its lag exceeds ``max_staleness`` (never, with ``max_staleness=None``);
- step ``k`` may train samples of policy version ``oldest_allowed(k) = max(0, k - max_staleness)`` or newer;
- with the ``"wait"`` policy, the producer of step ``k`` waits until the trainer (and its engine's weights)
  reached ``admit_version(k) = oldest_allowed(k)``, so no sample goes stale; with ``"drop"`` nobody waits
  (``admit_version`` is 0) and stale samples are discarded at ``get``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StalenessPolicy = Literal["wait", "drop"]
POLICIES: tuple[str, ...] = ("wait", "drop")


@dataclass(frozen=True, slots=True)
class StalenessBound:
    """``max_staleness`` (None = unbounded) and what happens at the bound (``"wait"`` or ``"drop"``).

    >>> b = StalenessBound(1, "wait")
    >>> b.oldest_allowed(5), b.admit_version(5), b.is_stale(3, 5), b.lag(4, 5)
    (4, 4, True, 1)
    >>> StalenessBound(1, "drop").admit_version(5), StalenessBound(None).is_stale(0, 99)
    (0, False)
    """

    max_staleness: int | None
    policy: StalenessPolicy = "wait"

    def __post_init__(self) -> None:
        s = self.max_staleness
        if s is not None and (not isinstance(s, int) or isinstance(s, bool) or s < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or None (got {s!r})")
        if self.policy not in POLICIES:
            raise ValueError(f"staleness policy must be one of {list(POLICIES)} (got {self.policy!r})")

    @property
    def bounded(self) -> bool:
        """Whether there is a bound at all (``max_staleness`` is not None)."""
        return self.max_staleness is not None

    @property
    def gates_producers(self) -> bool:
        """Producers wait at the bound (``"wait"``), rather than the bus dropping what went stale."""
        return self.bounded and self.policy == "wait"

    @property
    def drops(self) -> bool:
        """Stale samples are discarded at ``get`` (``"drop"`` policy with a bound)."""
        return self.bounded and self.policy == "drop"

    @staticmethod
    def lag(sample_version: int, trainer_version: int) -> int:
        """How many updates behind the trainer a sample of ``sample_version`` is at ``trainer_version``."""
        return trainer_version - sample_version

    def is_stale(self, sample_version: int, trainer_version: int) -> bool:
        """A sample of ``sample_version`` may not be trained at ``trainer_version``."""
        return (
            self.max_staleness is not None and self.lag(sample_version, trainer_version) > self.max_staleness
        )

    def oldest_allowed(self, step: int) -> int:
        """The oldest policy version rollout step ``step`` may train (trained at trainer version ``step``)."""
        return 0 if self.max_staleness is None else max(0, step - self.max_staleness)

    def admit_version(self, step: int) -> int:
        """The version the producer of ``step`` waits for before generating: the trainer's in
        ``admit(step)``, an engine's weights in a rollout worker. 0 (no wait) unless the policy is ``"wait"``."""
        return self.oldest_allowed(step) if self.gates_producers else 0
