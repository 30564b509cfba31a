"""Streaming rollout on a real local Ray cluster (fully async, the in-process torch engine batching
continuously): prompt groups reach the bus one at a time and the trainer takes step k's groups at version
k, so the run trains exactly the prompts of the batch-synchronous run, step for step; with partial rollout
responses may go on across weight updates and the staleness bound still holds on each sample's oldest token.
A killed rollout process mid-stream, and a stop and resume with groups in flight, lose nothing."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest
from _tiny import run_flags

from relax_app.cli_config import build_config
from relax_core.controller import Controller
from relax_testing import signal_role_after

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

STEPS = 6
LONG_TAIL = dict(long_tail_min_tokens=3, rollout_max_response_len=24)


def _cfg(inputs, out, *extra, **flags):
    run = dict(n_samples_per_prompt=2, num_rollout=STEPS, eval_interval=STEPS, trace=False, **LONG_TAIL)
    return build_config(None, run_flags(inputs, out, "--fully-async", *extra, **{**run, **flags}))


def _per_step(result) -> list[collections.Counter]:
    return [collections.Counter(step) for step in result.audit["trained_prompts"]]


@pytest.fixture(scope="module")
def batch_steps(tiny_run_inputs, tmp_path_factory) -> list[collections.Counter]:
    """The prompts a batch-synchronous run trains in each step: its rollout draws them step by step from
    the same data order (``Prompts.batch``), each prompt n times. (Read from the rollout's own prompt
    source instead of a run of its own: CI minutes; the e2e and fault tests run batch mode.)"""
    from transformers import AutoTokenizer

    from relax_rollout.prompts import Prompts

    cfg = _cfg(tiny_run_inputs, tmp_path_factory.mktemp("batch"), max_staleness=2)
    tok = AutoTokenizer.from_pretrained(tiny_run_inputs.model_path)
    prompts = Prompts(cfg, tok, tiny_run_inputs.model_path, tiny_run_inputs.prompt_path, {})
    n = cfg.rollout.n_samples_per_prompt
    return [
        collections.Counter(str(r.row_id) for r in prompts.batch()[0] for _ in range(n)) for _ in range(STEPS)
    ]


@pytest.mark.integration
@pytest.mark.slow
def test_streamed_groups_survive_a_killed_rollout_and_a_stop_with_groups_in_flight(
    tiny_run_inputs, tmp_path, batch_steps, sigterm_self
):
    """Streaming with partial rollout trains the batch run's prompts in every step, within the staleness
    bound on each sample's oldest token, through two interruptions (one run for both: CI minutes).

    The rollout process is SIGKILLed after step 1, with groups of several steps in flight and some on the
    bus: the restarted process goes on from the first step not whole (journal), generates its groups
    again and the bus refuses those already there (ids fixed by step and group). Then SIGTERM after step 3:
    the checkpoint's bus snapshot holds the groups already put of steps not yet whole (a part of a step:
    a reward slow for some labels makes a step's groups land at different times), the responses still
    generating are lost with the process. --load resumes at the first step not whole: its missing groups
    are generated again (the same prompts and seeds), the ones in the snapshot trained as they were —
    nothing lost, nothing twice."""
    import json
    import threading

    from relax_bus import snapshot

    flags = ["--streaming-rollout", "--partial-rollout"]
    ckpt = tmp_path / "ckpt"
    slow = dict(max_staleness=2, rm_type="relax_testing:uneven_reward")
    first = Controller(
        _cfg(tiny_run_inputs, tmp_path / "a", *flags, "--save", str(ckpt), **slow), tiny_run_inputs
    )
    kill = signal_role_after(first, 1, "rollout")
    metrics = tmp_path / "a" / "metrics.jsonl"

    def watch():
        while (
            sum('"train/loss"' in x for x in (metrics.read_text().splitlines() if metrics.exists() else []))
            < 3
        ):
            time.sleep(0.01)
        sigterm_self()

    threading.Thread(target=watch, daemon=True).start()
    part1 = first.run()
    assert "pid" in kill, "the rollout was never killed (the run ended first)"
    assert [(e["role"], e["action"]) for e in part1.audit["health"]] == [("rollout", "restart")]
    assert first.interrupted_at is not None, "the signal did not stop the run early"
    assert part1.rollout_stats["streamed_groups"] >= 4  # (the restarted process's)
    stopped = len([h for h in part1.history if "train/loss" in h])
    resume = json.loads((Path(first.interrupted_at) / "bus_resume.json").read_text())
    held = collections.Counter(
        int(x.fields["rollout_step"]) for x in snapshot.read(Path(first.interrupted_at) / "bus").samples
    )
    assert any(0 < n < 8 for n in held.values()), held  # a part of a step: what the resume is about
    assert held[resume["next_step"]] < 8 and all(held[s] == 8 for s in held if s < resume["next_step"])

    second = Controller(
        _cfg(tiny_run_inputs, tmp_path / "b", *flags, "--load", str(ckpt), **slow), tiny_run_inputs
    )
    rest = second.run()
    assert second.async_run.resumed_from_bus
    assert _per_step(rest) == batch_steps  # the same prompts in every step (the checkpoint carries
    # the steps trained before)
    trained = [h for h in part1.history + rest.history if "train/loss" in h]
    assert [h["step"] for h in trained] == list(range(1, STEPS + 1)) and 3 <= stopped < STEPS
    ids = part1.audit["trained_ids"][: stopped * 8] + rest.audit["trained_ids"][-(STEPS - stopped) * 8 :]
    assert len(ids) == len(set(ids)) == STEPS * 8
    # each trained sample's oldest token within the bound; whether a response went on across an update
    # is up to timing with this tiny model (counted in rollout/responses_across_updates; the exact
    # per-token versions across an update: tests/engines/test_continuous.py)
    assert all(h["rollout/token_version_spread_max"] <= 2 for h in trained), trained
    # the trainer took each step's groups as they came (streamed training: one optimizer step per batch)
    assert all(h["train/parts"] >= 1 and h["train/optimizer_steps"] == 1 for h in trained), trained
    # how long a group waited between its last response and the trainer taking it; interruptions counted
    assert all(0 <= h["rollout/group_to_train_s_max"] < 60 for h in trained), trained
    assert all(h["rollout/interruptions_max"] <= 2 for h in trained), trained
    for result in (part1, rest):
        hist = result.bus_stats["staleness_hist"]
        assert hist and max(int(k) for k in hist) <= 2, hist


@pytest.mark.integration
@pytest.mark.parametrize(("seed", "staleness"), [(s, s % 3) for s in range(1, 9)])
def test_the_staleness_bound_holds_on_each_samples_oldest_token_under_random_timings(
    tiny_run_inputs, tmp_path, seed, staleness
):
    """A property under random timings (response lengths from a heavy tail, reward calls of a random
    0-50 ms, a trainer step of a random 0-150 ms, all drawn from ``seed``), with partial rollout on: every
    sample the trainer takes at version k has its oldest token of version >= k - max_staleness, its
    ``policy_version`` is that oldest token's, and its tokens' versions never go back. The bus refuses a
    stale delivery by itself too (StaleSampleError). The rollout's trace has one generation span per
    group, and groups score while others generate. Played in process (``stream_in_process``): the real
    rollout loop, engine and bus, no Ray — eight timings for a fraction of one e2e run."""
    import random

    import numpy as np
    from _tiny import stream_in_process

    import relax_testing as testing

    testing.JITTER.seed(seed)
    rng = random.Random(seed)
    cfg = _cfg(
        tiny_run_inputs,
        tmp_path,
        "--streaming-rollout",
        "--partial-rollout",
        max_staleness=staleness,
        seed=seed,
        long_tail_exact=True,  # (each response ends at its drawn length: the untrained model never stops)
        trace=True,
        rm_type="relax_testing:jittered_reward",
    )
    steps, spans = stream_in_process(
        cfg,
        tiny_run_inputs.model_path,
        tiny_run_inputs.prompt_path,
        STEPS,
        between_steps=lambda k, _: time.sleep(rng.uniform(0.0, 0.15)),
    )
    continued = 0
    for k, data in enumerate(steps):
        assert len(data["tokens"]) == cfg.samples_per_rollout
        assert set(data["rollout_step"]) == {k}
        for versions, oldest, n in zip(data["token_versions"], data["policy_version"], data["response_len"]):
            v = np.asarray(versions)
            assert len(v) == n and (np.diff(v) >= 0).all()
            assert oldest == v.min() and k - oldest <= staleness, (k, oldest, v)
            continued += v.min() != v.max()
    print(f"responses continued across an update: {continued} of {STEPS * cfg.samples_per_rollout}")
    generate = [s for s in spans if s["name"] == "generate"]
    groups = {(s["args"]["step"], s["args"]["group"]) for s in generate}
    assert len(groups) == len(generate) and {(k, g) for k in range(STEPS) for g in range(4)} <= groups
    assert any(  # scoring beside generation: a reward span inside some group's generation span
        g["start_ns"] < r["start_ns"] < g["start_ns"] + g["dur_ns"]
        for r in spans
        if r["name"] == "reward"
        for g in generate
    )


@pytest.mark.integration
def test_a_small_bus_does_not_deadlock_streaming_at_staleness_two(tiny_run_inputs, tmp_path):
    """Found by `relax plan`'s simulation of the real bus (#57): under streaming the groups of steps k+1
    and k+2 filled a bus of a step's size while step k's last groups waited to be put, and the trainer,
    waiting for step k whole, never freed it — every role alive, the run at step 0 for good. The bus now
    holds every group in flight (``RelaxConfig.bus_samples``). `relax train` in its own process, so a
    deadlock fails the test by its time-out."""
    import subprocess
    import sys

    flags = dict(max_staleness=2, bus_capacity=8, num_rollout=STEPS, long_tail_exact=True, **LONG_TAIL)
    argv = run_flags(
        tiny_run_inputs,
        tmp_path / "out",
        "--fully-async",
        "--streaming-rollout",
        "--partial-rollout",
        **flags,
    )
    cfg = build_config(None, argv)
    assert cfg.bus_samples == 3 * cfg.samples_per_rollout  # (3 steps' groups in flight at staleness 2)
    run = subprocess.run(
        [sys.executable, "-m", "relax_app.cli", "train", *argv], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert sum("train/loss" in line for line in lines) == STEPS
