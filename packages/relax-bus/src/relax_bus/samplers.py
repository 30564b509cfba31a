"""Samplers: which ready samples a ``get`` takes.

A sampler sees only lightweight :class:`SampleRef` rows (id, group) for the samples that are ready for the
consumer, in id order, and returns the ids to take — or an empty list when the request cannot be met yet, in
which case the bus waits for more data. Keeping samplers pure functions over refs means new strategies
(token-budget batching, priority) are a dict entry away and testable without a bus.

Register new ones with :func:`register_sampler`; :class:`~relax_bus.config.ConsumerSpec` validates the name.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

from relax_bus.errors import BusError


class SampleRef(NamedTuple):
    """What a sampler knows about one ready sample."""

    id: int
    group_id: Hashable | None
    group_size: int | None  # the sample's own ``group_size`` field, if it set one


Sampler = Callable[[list[SampleRef], int, bool, int], list[int]]
"""``sampler(ready, n, partial, default_group_size) -> ids`` (empty list: not enough yet)."""


def in_order(ready: list[SampleRef], n: int, partial: bool, default_group_size: int) -> list[int]:
    """The first ``n`` ready samples by id; with ``partial``, up to ``n`` as soon as one is ready."""
    if len(ready) >= n or (partial and ready):
        return [r.id for r in ready[:n]]
    return []


def complete_groups(ready: list[SampleRef], default_group_size: int) -> list[tuple[list[int], int]]:
    """Groups whose every member is ready, as ``(ids, size)``, ordered by their first id.

    A group's size is the ``group_size`` field of its first sample, else ``default_group_size``.
    """
    members: dict[Hashable, list[int]] = {}
    sizes: dict[Hashable, int] = {}
    for r in ready:
        if r.group_id not in members:
            members[r.group_id] = []
            sizes[r.group_id] = r.group_size or default_group_size
        members[r.group_id].append(r.id)
    return [(ids, sizes[g]) for g, ids in members.items() if len(ids) >= sizes[g]]


def group(ready: list[SampleRef], n: int, partial: bool, default_group_size: int) -> list[int]:
    """Whole groups (the n responses of one prompt) in order of first id, never split, totalling at most ``n``.

    Without ``partial`` the request is met once no further group could fit: exactly ``n`` when ``n`` is a
    multiple of the group size, else the largest whole number of groups below ``n``. With ``partial`` one
    complete group is enough.
    """
    taken: list[int] = []
    blocked = False  # the next complete group does not fit in what is left of n
    for ids, size in complete_groups(ready, default_group_size):
        if size > n:
            raise BusError(
                f"get(n={n}) is smaller than group size {size}; groups are never split, ask for n >= {size}"
            )
        if len(taken) + size > n:
            blocked = True
            break
        taken.extend(ids[:size])
    if not taken:
        return []
    if partial or blocked or len(taken) == n or len(taken) + default_group_size > n:
        return taken
    return []


SAMPLERS: dict[str, Sampler] = {"in_order": in_order, "group": group}
"""Name -> sampler. ``ConsumerSpec.sampler`` must be a key of this dict."""

GROUPED_SAMPLERS: set[str] = {"group"}
"""Samplers that need a ``group_id`` on every sample (checked at ``put``)."""


def register_sampler(name: str, fn: Sampler, *, grouped: bool = False) -> None:
    """Add a sampler under ``name`` (before building configs that use it)."""
    if name in SAMPLERS:
        raise ValueError(f"sampler {name!r} is already registered")
    SAMPLERS[name] = fn
    if grouped:
        GROUPED_SAMPLERS.add(name)
