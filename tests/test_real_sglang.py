"""``relax train --rollout-backend sglang`` for a few steps against the real SGLang server on this CPU.

The rollout role launches and drives SGLang 0.5.23 (its own venv, ``tools/sglang-cpu/setup.sh``) as it
does on GPUs; only the launch flags (``--device cpu``) and the Python differ. Colocate runs without offload
(SGLang's memory release needs CUDA), weights through disk; fully async (streaming, partial rollout) runs
every role on the local Ray cluster, weights broadcast on SGLang's weight group. With
``--verify-weight-sync`` the rollout records SGLang's own ``/weights_checker`` digest after every sync.
"""

from __future__ import annotations

import math

import pytest
from _tiny import run_flags

from relax_app.cli_config import build_config
from relax_core.controller import Controller
from relax_rollout.engines import sglang_cpu

pytestmark = [pytest.mark.real_sglang, pytest.mark.integration, pytest.mark.shared_ray]

STEPS = 3


@pytest.fixture(scope="module")
def sglang_python() -> str:
    return sglang_cpu.require_python()


def _run(inputs, tmp_path, python: str, *flags: str):
    argv = run_flags(
        inputs,
        tmp_path / "out",
        *flags,
        num_rollout=STEPS,
        eval_interval=100,
        rm_type="relax_testing:parity_reward",
        verify_weight_sync=True,
        rollout_backend="sglang",
        rollout_num_gpus=1,
        sglang_python=python,
        sglang_env=sglang_cpu.ENV,
        sglang_server_args=sglang_cpu.SERVER_ARGS,
        sglang_mem_fraction_static=0.3,
    )
    return Controller(build_config(None, argv), inputs).run()


def _check(result) -> None:
    steps = [h for h in result.history if "train/loss" in h]
    assert len(steps) == STEPS and all(math.isfinite(h["train/loss"]) for h in steps)
    assert len(result.audit["trained_ids"]) == len(set(result.audit["trained_ids"]))
    trainer, rollout = result.audit["trainer_weights"], result.audit["rollout_weights"]
    # SGLang served every version the trainer sent. Its digest is over its own fused parameters, so it is not
    # the trainer's checksum; but it must be a function of it: two versions hold the same weights in SGLang
    # exactly when the trainer sent the same weights
    # (the last version may land after the last rollout: fully async, nothing waits for it)
    assert set(range(1, STEPS)) <= set(rollout) and set(rollout) <= set(trainer)
    assert all(rollout[v].startswith("sglang:") for v in rollout)
    pairs = {(trainer[v], rollout[v]) for v in rollout}
    assert len(pairs) == len({t for t, _ in pairs}) == len({r for _, r in pairs}), pairs
    assert len(pairs) > 1, "the weights never changed: the run did not test the sync"


def test_colocate_without_offload(tiny_run_inputs, tmp_path, sglang_python):
    """Weights through disk here; the broadcast path runs in the fully-async test and the engine tier."""
    result = _run(
        tiny_run_inputs,
        tmp_path,
        sglang_python,
        "--colocate",
        "--no-offload",
        "--sglang-weight-update",
        "disk",
    )
    _check(result)


def test_fully_async_streaming_with_partial_rollout(tiny_run_inputs, tmp_path, sglang_python):
    """Fully async on the Ray cluster, weights broadcast on SGLang's weight group, streaming rollout: every
    response its own request to SGLang, groups put as they end, and with partial rollout each weight update
    goes in under ``pause_generation`` in place, the requests in flight going on under the new weights
    (SGLang's reply says which tokens came from which version). (Batch-synchronous fully async against
    SGLang is not run here as well — CI minutes: its parts are this run's broadcast, the colocate run's
    batch generation, and the engine tier's update while requests decode.)"""
    result = _run(
        tiny_run_inputs,
        tmp_path,
        sglang_python,
        "--fully-async",
        "--max-staleness",
        "1",
        "--sglang-weight-update",
        "distributed",
        "--streaming-rollout",
        "--partial-rollout",
    )
    _check(result)
    trained = [h for h in result.history if "train/loss" in h]
    assert all(h["train/optimizer_steps"] == 1 and "rollout/token_version_spread_max" in h for h in trained)
    assert result.rollout_stats["streamed_groups"] >= STEPS * 4
