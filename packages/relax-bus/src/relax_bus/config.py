"""Typed configuration of a :class:`~relax_bus.DataBus`.

Pydantic models so a bus config validates once, at load time, with messages that say what to fix, and so it
nests directly into the engine's top-level config. Every field carries its own docstring.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax_bus.samplers import LENGTH_SAMPLERS, SAMPLERS
from relax_bus.staleness import StalenessBound, StalenessPolicy


class ConsumerSpec(BaseModel):
    """One named reader of the bus; it sees every sample exactly once."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    required_fields: list[str] = Field(default_factory=list)
    """A sample is ready for this consumer only once all of these fields are written (by put or add_fields)."""

    sampler: str = "in_order"
    """How a get picks ready samples: "in_order" (by id), "group" (whole groups of one prompt, never split),
    "token_budget" (as many as fit in sampler_options["max_tokens"]) or "seq_balanced" (n samples ordered so
    that sampler_options["dp_size"] equal slices carry balanced token counts)."""

    sampler_options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the sampler, e.g. {"max_tokens": 8192} or {"dp_size": 4, "grouped": True}."""

    length_field: str | None = None
    """Field whose length (first dimension, len, or int value) counts as a sample's tokens for the token_budget
    and seq_balanced samplers; required by them."""

    enforce_staleness: bool = False
    """Apply the max_staleness guarantee to this consumer (set it for the trainer); samples need policy_version."""

    @field_validator("sampler")
    @classmethod
    def _known_sampler(cls, v: str) -> str:
        if v not in SAMPLERS:
            raise ValueError(
                f"unknown sampler {v!r}; known: {sorted(SAMPLERS)} (add one with register_sampler)"
            )
        return v

    @model_validator(mode="after")
    def _sampler_needs(self) -> ConsumerSpec:
        if self.sampler in LENGTH_SAMPLERS and self.length_field is None:
            raise ValueError(f"sampler {self.sampler!r} needs length_field (e.g. 'input_ids')")
        if self.sampler == "token_budget" and int(self.sampler_options.get("max_tokens", 0)) < 1:
            raise ValueError("sampler 'token_budget' needs sampler_options={'max_tokens': N} with N >= 1")
        return self


class BusConfig(BaseModel):
    """Capacity, consumers and staleness control of one bus."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    consumers: dict[str, ConsumerSpec] = Field(min_length=1)
    """Named consumers; a sample is evicted once every one of them has acknowledged it."""

    capacity: int = Field(default=4096, ge=1)
    """Max live samples (put but not yet acked by every consumer); put blocks while full (back-pressure)."""

    max_staleness: int | None = Field(default=1, ge=0)
    """Staleness of a sample = (trainer version when the sample is delivered for training) - (policy version
    that generated it). The bus guarantees it is <= max_staleness for every sample delivered to a consumer with
    enforce_staleness. 0 = strict on-policy, 1 = near on-policy, k >= 2 = fully asynchronous; None = unbounded."""

    staleness_policy: StalenessPolicy = "wait"
    """"wait": producers block in admit(step) until the trainer catches up, so no sample goes stale (one that
    does anyway raises StaleSampleError). "drop": producers never block; stale samples are discarded."""

    group_size: int = Field(default=8, ge=1)
    """Default number of responses per prompt for the "group" sampler (a sample may carry its own group_size)."""

    lease_timeout_s: float | None = Field(default=None, gt=0)
    """A taken batch not acked within this many seconds is delivered again to the same consumer; None = never."""

    fields: list[str] | None = None
    """If set, the only field names a put or add_fields may write (reserved fields are always allowed);
    None accepts any name. Either way a field's type, dtype and rank are fixed by its first write."""

    max_sample_bytes: int | None = Field(default=None, ge=1)
    """Refuse a put or add_fields that would make one sample larger than this many bytes; None = no limit."""

    @property
    def staleness(self) -> StalenessBound:
        """The rule ``max_staleness`` and ``staleness_policy`` set (``staleness.py``): every check asks it."""
        return StalenessBound(self.max_staleness, self.staleness_policy)

    @field_validator("consumers")
    @classmethod
    def _names(cls, v: dict[str, ConsumerSpec]) -> dict[str, ConsumerSpec]:
        for name in v:
            if not name:
                raise ValueError("consumer names must be non-empty strings")
        return v

    @model_validator(mode="after")
    def _staleness_consistent(self) -> BusConfig:
        if self.capacity < self.group_size and any(c.sampler == "group" for c in self.consumers.values()):
            raise ValueError(
                f"capacity ({self.capacity}) must be >= group_size ({self.group_size}) "
                "or no whole group could ever fit"
            )
        return self
