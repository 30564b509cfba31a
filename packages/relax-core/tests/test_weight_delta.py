"""The delta codec of weight sync (#53, its first part): every version a receiver commits is bitwise the
sender's, and what does not fit (another base, a bucket out of order or twice, a version cut short, a
corrupted payload) is refused, naming it, with the last complete version kept; a full sync repairs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax_core.weight_delta import DeltaReceiver, DeltaRefused, DeltaSender, bucket_checksum


def _bf16_buckets(weights: list[torch.Tensor]) -> list[np.ndarray]:
    return [w.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1).numpy().copy() for w in weights]


def _model(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 256, generator=g) * 0.05, torch.randn(4096, generator=g) * 0.05]


def _step(weights: list[torch.Tensor], lr: float, seed: int) -> None:
    """An Adam-like update: every element moves by about lr (sign of a random gradient)."""
    g = torch.Generator().manual_seed(seed)
    for w in weights:
        w -= lr * torch.sign(torch.randn(w.shape, generator=g))


def _send(sender: DeltaSender, receiver: DeltaReceiver, version: int, buckets: list[np.ndarray]) -> int:
    deltas = sender.encode(version, buckets, [2] * len(buckets))
    got = None
    for d in deltas:
        got = receiver.apply(d)
    assert got is not None and receiver.version == version
    return sum(len(d.payload) for d in deltas)


def test_a_hundred_versions_arrive_bitwise_and_deltas_are_small():
    weights, sender, receiver = _model(), DeltaSender(full_every=50), DeltaReceiver()
    full = sum(b.nbytes for b in _bf16_buckets(weights))
    sizes = []
    for v in range(100):
        _step(weights, 1e-5, v)
        buckets = _bf16_buckets(weights)
        sizes.append(_send(sender, receiver, v, buckets))
        for mine, theirs in zip(receiver.buckets, buckets):
            assert bucket_checksum(mine) == bucket_checksum(theirs) and np.array_equal(mine, theirs)
    # (v0 and v50 are full; in bf16 at lr 1e-5 nearly nothing changes in between)
    assert sizes[0] >= full and sizes[50] >= full
    assert max(sizes[1:50] + sizes[51:]) < 0.3 * full


def _held(receiver: DeltaReceiver) -> list[bytes]:
    return [b.tobytes() for b in receiver.buckets]


@pytest.fixture
def synced():
    """A sender and a receiver both at version 1 (a full sync, then a delta), and the next version's deltas."""
    weights, sender, receiver = _model(), DeltaSender(), DeltaReceiver()
    for v in (0, 1):
        _step(weights, 1e-3, v)
        _send(sender, receiver, v, _bf16_buckets(weights))
    _step(weights, 1e-3, 2)
    return sender, receiver, weights


def test_a_delta_on_another_base_is_refused_and_the_held_version_stays(synced):
    sender, receiver, weights = synced
    before = _held(receiver)
    sender.held_version = 0  # (a sender that believes the receivers hold version 0)
    deltas = sender.encode(2, _bf16_buckets(weights), [2, 2])
    with pytest.raises(DeltaRefused, match="delta on version 0; this receiver holds 1"):
        receiver.apply(deltas[0])
    assert receiver.version == 1 and _held(receiver) == before


def test_a_bucket_out_of_order_or_twice_is_refused(synced):
    sender, receiver, weights = synced
    before = _held(receiver)
    d0, d1 = sender.encode(2, _bf16_buckets(weights), [2, 2])
    with pytest.raises(DeltaRefused, match="version 2 bucket 1 came out of order"):
        receiver.apply(d1)
    assert receiver.version == 1 and _held(receiver) == before
    assert receiver.apply(d0) is None
    with pytest.raises(DeltaRefused, match="version 2 bucket 0 came twice"):
        receiver.apply(d0)
    assert receiver.version == 1 and _held(receiver) == before
    assert receiver.apply(d0) is None and receiver.apply(d1) is not None and receiver.version == 2
    with pytest.raises(DeltaRefused, match="version 2 bucket 1 came twice"):
        receiver.apply(d1)
    assert receiver.version == 2


def test_a_version_cut_short_is_never_committed_and_the_next_repairs(synced):
    sender, receiver, weights = synced
    before = _held(receiver)
    d0, _ = sender.encode(2, _bf16_buckets(weights), [2, 2])  # the sender dies after bucket 0
    assert receiver.apply(d0) is None and receiver.version == 1 and _held(receiver) == before
    _step(weights, 1e-3, 3)
    fresh = DeltaSender()  # its restart: a new sender, which starts with a full sync
    buckets = _bf16_buckets(weights)
    _send(fresh, receiver, 3, buckets)
    assert _held(receiver) == [b.tobytes() for b in buckets]


def test_a_corrupted_payload_fails_its_checksum_and_is_refused(synced):
    from dataclasses import replace

    sender, receiver, weights = synced
    before = _held(receiver)
    d0, _ = sender.encode(2, _bf16_buckets(weights), [2, 2])
    bad = replace(d0, checksum="0" * 32)
    with pytest.raises(DeltaRefused, match="checksum differs"):
        receiver.apply(bad)
    assert receiver.version == 1 and _held(receiver) == before
