"""Exact resume: a run stopped by SIGTERM mid-way and resumed with --load trains on the same prompts, in
the same order, for the same number of steps as a run that was never interrupted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _tiny import run_flags

from relax_app.cli_config import build_config
from relax_core.controller import Controller
from relax_testing import after_trained_steps

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

STEPS = 8
PARITY = "relax_testing:parity_reward"
"""A reward an untrained model earns on about half its samples (the critic has returns to fit)."""


def _cfg(inputs, out, *extra):
    """Two samples per prompt (a batch of 8), no trace."""
    argv = run_flags(inputs, out, *extra, n_samples_per_prompt=2, num_rollout=STEPS, trace=False)
    return build_config(None, argv)


_UNINTERRUPTED: dict[tuple[str, ...], object] = {}
"""The uninterrupted runs this file compares against, by their flags: each is run once (four tests compare
against the same colocate run; a run depends on its flags and the session's inputs alone)."""


def _uninterrupted(inputs, tmp_path_factory, *flags):
    key = tuple(flags)
    if key not in _UNINTERRUPTED:
        out = tmp_path_factory.mktemp("uninterrupted")
        _UNINTERRUPTED[key] = Controller(_cfg(inputs, out, *flags), inputs).run()
    return _UNINTERRUPTED[key]


def _trained(result, steps_done: int) -> list:
    """(step, prompt ids) of the batches that were trained (async rollout may have generated more)."""
    return [(s, ids) for s, ids in result.audit["prompt_log"] if s < steps_done]


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode",
    [
        ["--colocate"],
        ["--fully-async", "--max-staleness", "1"],
        ["--colocate", "--lora-rank", "4", "--advantage-estimator", "gae", "--rm-type", PARITY],
    ],
    ids=["colocate", "async", "colocate-lora-ppo"],
)
def test_sigterm_then_load_trains_on_the_same_prompts_as_an_uninterrupted_run(
    tiny_run_inputs, tmp_path, tmp_path_factory, mode, sigterm_self
):
    # the uninterrupted run: colocate for every mode (batches are drawn in step order in either mode,
    # and it needs no Ray cluster of its own), with the same flags when the mode is colocate
    plain = mode if "--colocate" in mode else ["--colocate"]
    full = _uninterrupted(tiny_run_inputs, tmp_path_factory, *plain)

    ckpt = tmp_path / "ckpt"
    first = Controller(_cfg(tiny_run_inputs, tmp_path / "a", "--save", str(ckpt), *mode), tiny_run_inputs)
    after_trained_steps(tmp_path / "a" / "metrics.jsonl", trained_steps=1, fire=sigterm_self)
    part1 = first.run()
    assert first.interrupted_at is not None, "the signal did not stop the run early"
    stopped = len([h for h in part1.history if "train/loss" in h])
    assert 1 <= stopped < STEPS

    second = Controller(_cfg(tiny_run_inputs, tmp_path / "b", "--load", str(ckpt), *mode), tiny_run_inputs)
    rest = second.run()
    # same prompts, same order, nothing lost, nothing twice (the checkpoint carries what was trained)
    assert rest.audit["trained_prompts"] == full.audit["trained_prompts"]
    steps = [h["step"] for h in part1.history + rest.history if "train/loss" in h]
    assert steps == list(range(1, STEPS + 1))
    if "--colocate" in mode:
        assert _trained(part1, stopped) + _trained(rest, STEPS) == _trained(full, STEPS)
        # and the same result: every step's loss as the uninterrupted run's (LoRA: adapter, optimizer, RNG;
        # PPO: the critic's weights and optimizer, saved beside the checkpoint the signal wrote)
        losses = [h["train/loss"] for h in part1.history + rest.history if "train/loss" in h]
        assert losses == pytest.approx([h["train/loss"] for h in full.history if "train/loss" in h], rel=1e-5)
        if "gae" in mode:  # the critic's values too, step by step (a critic started afresh differs at once)
            got = [h["critic/values_mean"] for h in part1.history + rest.history if "train/loss" in h]
            want = [h["critic/values_mean"] for h in full.history if "train/loss" in h]
            assert len(set(want)) == STEPS and got == pytest.approx(want, rel=1e-5)
    else:  # the bus snapshot came back: batches generated before the stop were trained, not regenerated
        assert second.async_run.resumed_from_bus
        resume = json.loads((Path(first.interrupted_at) / "bus_resume.json").read_text())
        assert all(step >= resume["next_step"] for step, _ in rest.audit["prompt_log"])


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode, part",
    [
        (["--colocate"], "model/model.safetensors"),
        (["--fully-async", "--max-staleness", "1"], "bus/state.pkl"),
    ],
    ids=["colocate-weights", "async-bus-snapshot"],
)
def test_a_damaged_last_checkpoint_resumes_from_the_one_before_and_loses_nothing(
    tiny_run_inputs, tmp_path, tmp_path_factory, sigterm_self, caplog, mode, part
):
    """The newest checkpoint torn (a kill or a full disk while it was copied elsewhere): --load names it,
    takes the one before, re-does the step in between, and the run trains the uninterrupted run's prompts.
    It loaded the torn one (or failed with a traceback). The fully-async bus snapshot is a part like the
    weights (issue 36: written after the manifest, a truncated one was an UnpicklingError traceback)."""
    full = _uninterrupted(tiny_run_inputs, tmp_path_factory, "--colocate")
    ckpt = tmp_path / "ckpt"
    first = Controller(
        _cfg(tiny_run_inputs, tmp_path / "a", *mode, "--save", str(ckpt), "--save-interval", "1"),
        tiny_run_inputs,
    )
    after_trained_steps(tmp_path / "a" / "metrics.jsonl", trained_steps=3, fire=sigterm_self)
    first.run()
    steps = sorted(ckpt.glob("step_*"))
    assert len(steps) >= 2
    torn = steps[-1] / part
    torn.write_bytes(torn.read_bytes()[:-100])  # truncated
    with caplog.at_level("WARNING", logger="relax_core.checkpoints"):
        rest = Controller(
            _cfg(tiny_run_inputs, tmp_path / "b", *mode, "--load", str(ckpt)), tiny_run_inputs
        ).run()
    assert (
        f"checkpoint {steps[-1]} is not whole" in caplog.text and f"resuming from {steps[-2]}" in caplog.text
    )
    assert rest.audit["trained_prompts"] == full.audit["trained_prompts"]
    if part == "bus/state.pkl":  # (#49) damaged inside and sealed: whole by its manifest, a traceback before
        import pickle

        from relax_core.checkpoints import CheckpointNotFound, write_manifest

        snap = steps[0] / part
        record = pickle.loads(snap.read_bytes())
        record["samples"].append("not a sample")
        snap.write_bytes(pickle.dumps(record))
        write_manifest(steps[0])
        again = _cfg(tiny_run_inputs, tmp_path / "c", *mode, "--load", str(steps[0]))
        with pytest.raises(
            CheckpointNotFound, match=r"state.pkl is not a bus state inside .* damaged"
        ) as info:
            Controller(again, tiny_run_inputs).run()
        assert "\n" not in str(info.value)
