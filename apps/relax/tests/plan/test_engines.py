"""relax_app.plan.engines: a simulated engine's batching on the virtual clock."""

from __future__ import annotations

import pytest

from relax_app.plan.costs import Costs, Device, Efficiency
from relax_app.plan.engines import Engine, Request
from relax_core.roofline import ModelShape

SHAPE = ModelShape(layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128, vocab=100)


def _engine(static: bool) -> Engine:
    eff = Efficiency(decode_step_s=0.0, decode_row_s=0.01, engine_update_s=0.0)
    costs = Costs(SHAPE, Device(peak_tflops=1e6, hbm_gbps=1e9, memory_gb=80), eff)
    return Engine(0, 1, costs, capacity=8, static=static)


def _run(e: Engine) -> dict[int, float]:
    """Each request's end time, the engine driven from one end to the next."""
    ends, now = {}, 0.0
    e.start_queued(now)
    while e.running or e.queue:
        now = e.next_end() or now
        for r in e.finish(now):
            ends[r.index] = now
        e.start_queued(now)
    return ends


def test_continuous_batching_frees_a_row_static_batching_computes_it_to_the_end():
    """A short and a long response, then a third queued: continuous batching starts the third when the
    short one ends and pays for running rows only; a static batch (the torch engine's batch mode) computes
    both rows until the long one ends and starts the third only then."""
    for static in (False, True):
        e = _engine(static)
        e.capacity = 2
        e.queue.extend([Request(0, 0, 0, 4, 2), Request(0, 0, 1, 4, 10), Request(0, 0, 2, 4, 2)])
        ends = _run(e)
        if static:
            assert ends[1] == pytest.approx(ends[0] + 8 * 0.02) and ends[2] > ends[1]  # two rows to the end
        else:
            assert ends[2] < ends[1]  # the third ran beside the long one
    assert _engine(False).costs.decode_steps(1, 3, 0, 1)[0] == pytest.approx(0.03)  # (rows x decode_row_s)
