"""Samplers: which ready samples a ``get`` takes.

A sampler sees only lightweight :class:`SampleRef` rows (id, group, length) for the samples that are ready for
the consumer, in id order, and returns the ids to take — or an empty list when the request cannot be met yet,
in which case the bus waits for more data. Keeping samplers pure functions over refs means new strategies are
a dict entry away and testable without a bus. A sampler is called as
``sampler(ready, n, partial, default_group_size, **ConsumerSpec.sampler_options)``.

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
    length: int = 0  # tokens, from ConsumerSpec.length_field (0 when the consumer has none)


Sampler = Callable[..., list[int]]
"""``sampler(ready, n, partial, default_group_size, **options) -> ids`` (empty list: not enough yet)."""


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


def _units(ready: list[SampleRef], grouped: bool, gs: int) -> list[tuple[list[int], int]]:
    """(ids, tokens) of the units a sampler may take: single samples, or whole complete groups."""
    if not grouped:
        return [([r.id], r.length) for r in ready]
    length = {r.id: r.length for r in ready}
    return [(ids[:size], sum(length[i] for i in ids[:size])) for ids, size in complete_groups(ready, gs)]


def token_budget(
    ready: list[SampleRef],
    n: int,
    partial: bool,
    default_group_size: int,
    max_tokens: int = 0,
    grouped: bool = False,
) -> list[int]:
    """Samples (or whole groups with ``grouped``) in id order while their tokens fit in ``max_tokens``, at
    most ``n`` samples. Met once the next unit would not fit (or ``n`` is reached); with ``partial``, as soon
    as one unit fits. A single unit larger than the budget is taken alone so it can never block the stream."""
    taken: list[int] = []
    tokens = 0
    for ids, t in _units(ready, grouped, default_group_size):
        if len(taken) + len(ids) > n or (taken and tokens + t > max_tokens):
            return taken
        taken.extend(ids)
        tokens += t
        if tokens >= max_tokens or len(taken) == n:
            return taken
    return taken if partial else []


def seq_balanced(
    ready: list[SampleRef],
    n: int,
    partial: bool,
    default_group_size: int,
    dp_size: int = 1,
    grouped: bool = False,
) -> list[int]:
    """``n`` samples (whole groups with ``grouped``), reordered so that cutting the batch into ``dp_size``
    equal contiguous slices gives each data-parallel rank about the same number of tokens.

    Greedy longest-first: each sample goes to the least-loaded rank that still has room. With ``partial`` the
    batch may be short; it is then cut as evenly as possible.
    """
    if grouped:
        ids = group(ready, n, partial, default_group_size)
    else:
        ids = in_order(ready, n, partial, default_group_size)
    if not ids or dp_size <= 1:
        return ids
    length = {r.id: r.length for r in ready}
    room = [len(ids) // dp_size + (1 if r < len(ids) % dp_size else 0) for r in range(dp_size)]
    loads = [0] * dp_size
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for sid in sorted(ids, key=lambda i: (-length[i], i)):
        r = min((r for r in range(dp_size) if len(ranks[r]) < room[r]), key=lambda r: (loads[r], r))
        ranks[r].append(sid)
        loads[r] += length[sid]
    return [sid for rank in ranks for sid in sorted(rank)]


SAMPLERS: dict[str, Sampler] = {
    "in_order": in_order,
    "group": group,
    "token_budget": token_budget,
    "seq_balanced": seq_balanced,
}
"""Name -> sampler. ``ConsumerSpec.sampler`` must be a key of this dict."""

GROUPED_SAMPLERS: set[str] = {"group"}
"""Samplers that need a ``group_id`` on every sample (checked at ``put``); others need it with grouped=True."""

LENGTH_SAMPLERS: set[str] = {"token_budget", "seq_balanced"}
"""Samplers that need ``ConsumerSpec.length_field``."""


def register_sampler(name: str, fn: Sampler, *, grouped: bool = False) -> None:
    """Add a sampler under ``name`` (before building configs that use it)."""
    if name in SAMPLERS:
        raise ValueError(f"sampler {name!r} is already registered")
    SAMPLERS[name] = fn
    if grouped:
        GROUPED_SAMPLERS.add(name)
