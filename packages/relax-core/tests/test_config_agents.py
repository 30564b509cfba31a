"""--agent-path's section: the agents' names, what it does not combine with, the samples a step makes."""

import pytest
from pydantic import ValidationError

from relax_core.config import RelaxConfig


def _cfg(agent: dict, **rollout) -> RelaxConfig:
    r = {"rollout_batch_size": 4, "n_samples_per_prompt": 2, **rollout}
    return RelaxConfig.model_validate({"agent": agent, "rollout": r})


def test_each_agent_makes_its_own_samples():
    assert _cfg({"agent_path": "m:f"}).samples_per_rollout == 8
    assert _cfg({"agent_path": "m:f", "agents": ["searcher", "answerer"]}).samples_per_rollout == 16
    assert _cfg({"agents": ["agent"]}).samples_per_rollout == 8  # (the default: no agent run)


@pytest.mark.parametrize(
    ("agent", "rollout", "says"),
    [
        ({"agents": ["a", "b"]}, {}, "add --agent-path"),
        ({"agent_path": "m:f", "agents": ["a", "a"]}, {}, "distinct names"),
        ({"agent_path": "m:f", "agents": ["a b"]}, {}, "letters, digits"),
        ({"agent_path": "m:f", "agents": []}, {}, "--agents"),
        ({"agent_path": "m:f"}, {"env_path": "m:Env"}, "does not combine with --env-path"),
        ({"agent_path": "m:f"}, {"dynamic_sampling": True}, "--dynamic-sampling"),
        ({"agent_path": "m:f", "agent_timeout_s": 0}, {}, "agent_timeout_s"),
    ],
)
def test_what_an_agent_run_refuses_names_the_flag(agent, rollout, says):
    with pytest.raises(ValidationError, match=says):
        _cfg(agent, **rollout)


def test_streaming_rollout_refuses_agents_saying_so():
    with pytest.raises(ValidationError, match="does not combine with --agent-path"):
        RelaxConfig.model_validate(
            {
                "agent": {"agent_path": "m:f"},
                "rollout": {"streaming_rollout": True},
                "run": {"mode": "fully_async"},
            }
        )
