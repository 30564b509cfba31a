import pytest

from relax_bus import SAMPLERS, BusError, SampleRef, register_sampler
from relax_bus.samplers import complete_groups, group, in_order


def refs(groups):
    """groups: list of group ids in id order."""
    return [SampleRef(i, g, None) for i, g in enumerate(groups)]


def test_in_order_takes_first_n_or_waits():
    assert in_order(refs([None] * 5), 3, False, 8) == [0, 1, 2]
    assert in_order(refs([None] * 2), 3, False, 8) == []
    assert in_order(refs([None] * 2), 3, True, 8) == [0, 1]
    assert in_order([], 3, True, 8) == []


def test_complete_groups_need_every_member():
    r = refs(["a", "b", "a", "b", "a"])
    assert complete_groups(r, 3) == [([0, 2, 4], 3)]
    # a sample's own group_size overrides the default
    r = [SampleRef(0, "a", 2), SampleRef(1, "a", 2), SampleRef(2, "b", None)]
    assert complete_groups(r, 3) == [([0, 1], 2)]


def test_group_never_splits_and_fills_n():
    r = refs(["a", "a", "b", "b", "c", "c"])
    assert group(r, 4, False, 2) == [0, 1, 2, 3]
    # 5 is not a multiple of 2: whole groups up to n
    assert group(r, 5, False, 2) == [0, 1, 2, 3]
    # not enough complete groups yet
    assert group(refs(["a", "a", "b"]), 4, False, 2) == []
    assert group(refs(["a", "a", "b"]), 4, True, 2) == [0, 1]


def test_group_rejects_n_below_group_size():
    with pytest.raises(BusError, match="never split"):
        group(refs(["a"] * 4), 2, False, 4)


def test_register_sampler():
    def last_first(ready, n, partial, gs):
        return [r.id for r in reversed(ready)][:n] if len(ready) >= n else []

    register_sampler("test_last_first", last_first)
    try:
        assert SAMPLERS["test_last_first"](refs([None] * 3), 2, False, 1) == [2, 1]
        with pytest.raises(ValueError, match="already registered"):
            register_sampler("test_last_first", last_first)
    finally:
        del SAMPLERS["test_last_first"]
