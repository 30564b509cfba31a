"""The bytes of SGLang's weight group (``relax_rollout.engines.weight_group``); the group itself runs
against our engine server in ``tests/server/test_server.py`` and under the sglang engine in
``test_sglang.py``."""

import pytest

torch = pytest.importorskip("torch")

from relax_rollout.engines.weight_group import buckets, flatten, unflatten  # noqa: E402


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: odd offsets follow
        ("b", torch.randn(7, generator=g)),
        ("c", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
        ("d", torch.randn(4, 4, generator=g).t()),  # not contiguous
    ]


def test_flatten_concatenates_each_tensors_bytes_in_order():
    """SGLang's FlattenedTensorBucket: every tensor's bytes (row-major), one after the other, no padding."""
    named = _named()
    flat = flatten(named)
    assert flat.dtype == torch.uint8
    want = b"".join(
        t.contiguous().view(torch.uint8).numpy().tobytes()
        if t.dtype == torch.bfloat16
        else t.contiguous().numpy().tobytes()
        for _, t in named
    )
    assert flat.numpy().tobytes() == want


def test_unflatten_inverts_flatten_and_names_a_size_mismatch():
    named = [(n, t) for n, t in _named() if t.dtype == torch.float32]  # one dtype: aligned views
    flat = flatten(named)
    names = [n for n, _ in named]
    out = unflatten(flat, names, ["float32"] * len(named), [list(t.shape) for _, t in named])
    assert [n for n, _ in out] == names
    for (_, got), (_, want) in zip(out, named):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"holds 92 bytes, the tensors named take 20"):
        unflatten(flat, ["b"], ["float32"], [[5]])
    with pytest.raises(ValueError, match=r"b: the buffer ends at byte 92, the tensor needs 400"):
        unflatten(flat, ["b"], ["float32"], [[100]])
    with pytest.raises(ValueError, match="unknown dtype 'f'"):
        unflatten(flat, ["b"], ["f"], [[7]])


def test_buckets_hold_one_dtype_and_at_most_bucket_bytes():
    g = torch.Generator().manual_seed(1)
    named = [(f"w{i}", torch.randn(n, generator=g)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    named.insert(2, ("h", torch.zeros(8, dtype=torch.bfloat16)))
    parts = buckets(named, bucket_bytes=80)  # 20 float32 values a bucket
    assert [[n for n, _ in b] for b in parts] == [["w0", "w1"], ["w2"], ["w3"], ["w4"], ["w5"], ["h"]]
    assert all(len({t.dtype for _, t in b}) == 1 for b in parts)
    # a tensor larger than a bucket gets one of its own; every tensor goes exactly once
    assert sorted(n for b in parts for n, _ in b) == sorted(n for n, _ in named)
    with pytest.raises(ValueError, match="bucket_bytes"):
        buckets(named, 0)
