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


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_sparse_deltas_round_trip_far_gaps_large_steps_and_sign_flips(itemsize):
    """What the compact form escapes: gaps of 255 elements and more, steps past a signed byte, the bits'
    difference wrapping (a weight crossing zero flips its sign bit): every one decodes exactly."""
    from relax_core.weight_delta import decode_bucket, encode_bucket

    rng = np.random.default_rng(itemsize)
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    base = rng.integers(0, np.iinfo(dtype).max, size=20_000, dtype=dtype, endpoint=True)
    new = base.copy()
    near = rng.choice(len(new), 300, replace=False)
    new[near] += dtype(1)  # one unit in the last place (wrapping at the top)
    new[[0, 5_000, 19_999]] ^= dtype(1 << (8 * itemsize - 1))  # sign flips, a gap of 5,000 and the last
    new[rng.choice(len(new), 20, replace=False)] = rng.integers(0, 1 << 8 * min(itemsize, 4) - 1, 20)
    delta = encode_bucket(
        new.view(np.uint8),
        base.view(np.uint8),
        version=1,
        base_version=0,
        index=0,
        count=1,
        itemsize=itemsize,
    )
    assert delta.encoding == "sparse"
    assert np.array_equal(decode_bucket(delta, base.view(np.uint8)), new.view(np.uint8))


def test_one_ulp_changes_cost_well_under_a_byte_each():
    """The shape of an AdamW step in bf16 (5% of the weights move one unit in the last place, up or down):
    under 4% of the full bytes (indices + values cost 3 bytes a change: 7.5%)."""
    from relax_core.weight_delta import encode_bucket

    rng = np.random.default_rng(0)
    base = torch.randn(1_000_000).mul(0.02).to(torch.bfloat16).view(torch.int16).numpy()
    moved = rng.random(base.size) < 0.05
    new = base + np.where(moved, rng.choice(np.array([-1, 1], dtype=np.int16), base.size), 0).astype(np.int16)
    delta = encode_bucket(
        new.view(np.uint8), base.view(np.uint8), version=1, base_version=0, index=0, count=1, itemsize=2
    )
    assert delta.encoding == "sparse" and len(delta.payload) < 0.04 * new.nbytes


def test_a_delta_that_does_not_pay_is_given_up_once_with_a_warning(caplog):
    """fp32 weights at a high lr: every element changes; after 3 such versions the sender says so, once,
    and sends every later version full (which the receiver takes as any full sync)."""
    weights, sender, receiver = _model(), DeltaSender(), DeltaReceiver()
    fp32 = [w.contiguous().view(torch.uint8).reshape(-1).numpy() for w in weights]
    encodings = []
    with caplog.at_level("WARNING", logger="relax_core.weight_delta"):
        for v in range(8):
            _step(weights, 2e-4, v)
            deltas = sender.encode(v, [b.copy() for b in fp32], [4, 4])
            for d in deltas:
                receiver.apply(d)
            assert all(np.array_equal(a, b) for a, b in zip(receiver.buckets, fp32))
            encodings.append({d.encoding for d in deltas})
    warned = [r.getMessage() for r in caplog.records if "does not pay" in r.getMessage()]
    assert sender.gave_up and len(warned) == 1 and "drop --weight-sync-delta" in warned[0]
    assert encodings[0] == {"full"} and encodings[1] != {"full"} and encodings[4:] == [{"full"}] * 4
