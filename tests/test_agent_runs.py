"""Agent runs end to end (#55): the agent demo's agents — SDK code knowing nothing of Relax — trained fully
asynchronously through the rollout's engine server: the Messages-API agent's reward and held-out accuracy
rise; a solver and a checker in one episode both train, each with its own metrics.

The assets are the agent demo's (``relax_app.demo.agent_demo``: a tiny Qwen3 warmed up on the chat-rendered
task), built once for this module under its temporary directory."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("anthropic")
pytestmark = [pytest.mark.integration, pytest.mark.shared_ray]


@pytest.fixture(scope="module")
def agent_demo(tmp_path_factory):
    from relax_app.demo.agent_demo import prepare_agent_demo

    return prepare_agent_demo(tmp_path_factory.mktemp("agent-demo-cache"))


def _run(agent_demo, out: Path, *flags: str):
    from relax_app.cli_config import build_config
    from relax_app.demo.agent_demo import AGENT_DEFAULTS
    from relax_core.controller import Controller, RunInputs

    model, train, held_out = agent_demo
    defaults = {**AGENT_DEFAULTS, "prompt_data": train, "eval_data": held_out, "hf_checkpoint": model}
    argv = [*flags, "--output-dir", str(out), "--torch-threads", "1", "--no-progress"]
    cfg = build_config(None, argv, defaults=defaults)
    result = Controller(cfg, RunInputs(model, train, held_out)).run()
    steps = [h for h in result.history if "train/loss" in h]
    evals = [h["eval/accuracy"] for h in result.history if "eval/accuracy" in h]
    return cfg, steps, evals


def test_a_messages_agent_trains_fully_async_and_its_reward_rises(agent_demo, tmp_path):
    """`relax train --agent-demo`, 30 steps: the Anthropic-SDK agent's episodes (one or two turns) train with
    staleness ≤ 1, the reward of the last 10 steps beats the first 10's, held-out accuracy rises, and the
    run shows its episodes: how they ended, turns, turn latency percentiles, the agent's own line."""
    from relax_app.watch import render
    from relax_core.live import read_status

    cfg, steps, evals = _run(agent_demo, tmp_path / "out", "--num-rollout", "30")
    assert len(steps) == 30 and all(math.isfinite(h["train/loss"]) for h in steps)
    assert max(h["train/staleness_max"] for h in steps) <= 1
    reward = [h["rollout/reward_mean"] for h in steps]
    assert np.mean(reward[-10:]) > np.mean(reward[:10]) + 0.02, reward
    assert evals[-1] > evals[0], evals
    for h in steps:
        ends = {k: v for k, v in h.items() if k.startswith("rollout/stop/")}
        assert sum(ends.values()) == cfg.samples_per_rollout and set(ends) <= {
            "rollout/stop/agent_done",
            "rollout/stop/length",
        }, ends
        assert 1 <= h["rollout/turns_mean"] <= 2 and 0 < h["rollout/turn_s_p50"] <= h["rollout/turn_s_p99"]
        assert h["rollout/agent/agent/reward_mean"] == h["rollout/reward_mean"]
        assert h["rollout/reward_failures"] == 0
    status = read_status(Path(cfg.run.output_dir))
    assert status.agent is not None and status.agent.step == 30
    shown = render(status)
    assert "episodes v30:" in shown and "agent agent: reward" in shown and "turn s p50" in shown


def test_two_agents_in_one_episode_both_train_with_their_own_metrics(agent_demo, tmp_path):
    """The solver (Chat Completions) and the checker (Messages): twice the samples per step, each agent's
    groups apart, each agent's reward, length, turns and staleness logged every step and shown by `relax
    watch`. (That each agent's loss mask covers only its own tokens: relax-rollout's test_agents.py.)"""
    from relax_app.demo.agent_demo import TWO_AGENTS
    from relax_app.watch import render
    from relax_core.live import read_status

    flags = ["--agent-path", TWO_AGENTS, "--agents", "solver", "checker", "--num-rollout", "6"]
    cfg, steps, _ = _run(agent_demo, tmp_path / "out", *flags)
    assert cfg.samples_per_rollout == 2 * cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    assert len(steps) == 6 and all(math.isfinite(h["train/loss"]) for h in steps)
    for h in steps:
        assert h["rollout/groups"] == 2 * cfg.rollout.rollout_batch_size
        for agent in ("solver", "checker"):
            assert 0 <= h[f"rollout/agent/{agent}/reward_mean"] <= 1
            assert (
                h[f"rollout/agent/{agent}/turns_mean"] == 1
                and h[f"rollout/agent/{agent}/response_len_mean"] > 0
            )
            assert 0 <= h[f"rollout/agent/{agent}/staleness_mean"] <= 1
    shown = render(read_status(Path(cfg.run.output_dir)))
    assert "agent solver: reward" in shown and "agent checker: reward" in shown
