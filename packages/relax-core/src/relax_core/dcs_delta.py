"""Delta mode of DCS's broadcast (``--weight-sync-delta``): each bucket of a version goes as its delta against
the version every receiver holds (:mod:`relax_core.weight_delta`), its encoding and size in the version's
header. A receiver that cannot apply one (it joined since, or a delta does not check) keeps its last complete
version and asks for a full sync through the store; the sender's next version is full.

Why through the store: it is the control plane the sender already reads between versions
(:mod:`relax_core.dcs`), and asking costs one counter; the broadcasts themselves stay one-way.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from relax_core.weight_delta import BucketDelta, DeltaReceiver, DeltaRefused, DeltaSender

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

FULL_KEY = "delta/full"
"""The store counter receivers add to when they ask for a full sync."""


def encode_version(
    codec: DeltaSender, store: Any, seen: int, flats: list[torch.Tensor], dtypes: list[str], version: int
) -> tuple[list[BucketDelta], int]:
    """Version ``version``'s buckets (``flats``: each bucket's bytes on the host, of ``dtypes``) encoded by
    ``codec``, full where a receiver asked since the count ``seen``; (the deltas, the count now)."""
    import torch

    asked = int(store.add(FULL_KEY, 0))
    if asked > seen:
        codec.ask_full()
    sizes = [torch.empty(0, dtype=getattr(torch, d)).element_size() for d in dtypes]
    return codec.encode(version, [f.numpy() for f in flats], sizes), asked


def header_of(deltas: list[BucketDelta]) -> list[list[Any]]:
    """What a receiver needs to rebuild each bucket's delta from its payload (the version's header)."""
    return [[d.encoding, d.base_version, len(d.payload), d.checksum, d.itemsize, d.nbytes] for d in deltas]


def payload(d: BucketDelta) -> torch.Tensor:
    """A delta's payload as the uint8 tensor the broadcast sends."""
    import torch

    return torch.frombuffer(bytearray(d.payload), dtype=torch.uint8)


def receive_version(
    bcast: Any, store: Any, device: Any, codec: DeltaReceiver, header: dict[str, Any]
) -> list[np.ndarray] | None:
    """Take part in every bucket broadcast of ``header``'s version (``bcast``: the group's); the version's
    buckets once ``codec`` committed them, or None when it refused one (this receiver then keeps its last
    complete version and has asked for a full sync)."""
    import torch

    version, metas = header["version"], header["delta"]
    committed, refused = None, None
    for i, (encoding, base, size, checksum, itemsize, nbytes) in enumerate(metas):
        buf = torch.empty(size, dtype=torch.uint8, device=device)
        bcast(buf)  # (every member joins every broadcast, also after a refusal)
        if refused is not None:
            continue
        delta = BucketDelta(
            version, base, i, len(metas), encoding, itemsize, nbytes, buf.cpu().numpy().tobytes(), checksum
        )
        try:
            committed = codec.apply(delta)
        except DeltaRefused as e:
            refused = e
    if refused is not None:
        logger.warning("DCS: %s; keeping version %s, asking for a full sync", refused, codec.version)
        store.add(FULL_KEY, 1)
        return None
    return committed
