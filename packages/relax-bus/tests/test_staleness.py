"""The staleness rule (``staleness.py``): the one definition the bus and a rollout worker both apply."""

from __future__ import annotations

import pytest

from relax_bus import BusConfig, ConsumerSpec, StalenessBound


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_step_trains_versions_down_to_step_minus_k(k):
    b = StalenessBound(k)
    for step in range(8):
        oldest = b.oldest_allowed(step)
        assert oldest == max(0, step - k)
        assert not b.is_stale(oldest, step) and b.lag(oldest, step) <= k
        assert oldest == 0 or b.is_stale(oldest - 1, step)


def test_wait_gates_producers_drop_does_not():
    wait, drop = StalenessBound(1, "wait"), StalenessBound(1, "drop")
    assert wait.gates_producers and not wait.drops and wait.admit_version(5) == 4
    assert drop.drops and not drop.gates_producers and drop.admit_version(5) == 0
    assert drop.is_stale(3, 5) and wait.is_stale(3, 5)  # the bound is the same; only who acts differs


def test_unbounded_never_stale_never_waits():
    b = StalenessBound(None)
    assert not b.bounded and not b.gates_producers and not b.drops
    assert not b.is_stale(0, 10**6) and b.oldest_allowed(100) == 0 and b.admit_version(100) == 0


@pytest.mark.parametrize(
    "args, says", [((-1,), "max_staleness must be an int >= 0"), ((1, "later"), "one of ['wait', 'drop']")]
)
def test_a_bad_bound_says_what_to_fix(args, says):
    with pytest.raises(ValueError) as err:
        StalenessBound(*args)
    assert says in str(err.value)


def test_bus_config_states_its_bound():
    cfg = BusConfig(consumers={"t": ConsumerSpec()}, max_staleness=2, staleness_policy="drop")
    assert cfg.staleness == StalenessBound(2, "drop")


def test_doctest():
    import doctest

    from relax_bus import staleness

    assert doctest.testmod(staleness).failed == 0
