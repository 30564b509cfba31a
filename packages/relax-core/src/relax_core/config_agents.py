"""Agent runs: the section of the run configuration for agents Relax does not own (``cfg.agent``).

Why its own section: with ``--agent-path`` the rollout hands each sample to the user's agent code, which talks
to the rollout's own engine over HTTP in whichever protocol it was written for (Chat Completions, Responses,
Anthropic Messages) and returns a reward; everything the rollout then trains on is what the engine server
recorded of those calls (``relax_rollout.agents``). Several agents may act in one episode (``--agents``), each
trained on its own turns. Nothing here applies to --env-path episodes, which Relax drives itself.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from relax_core.config_sections import Section

DEFAULT_AGENT = "agent"
"""The one agent of an episode when --agents is not given."""


class AgentConfig(Section):
    """Where the agent code is and how the rollout runs it."""

    agent_path: str | None = None
    """Agentic RL with your own agent: a function 'pkg.mod:fn' called once per sample with a
    ``relax_rollout.agents.AgentTask`` (the row's prompt, label and metadata; the base URL of an engine server
    speaking /v1/chat/completions, /v1/responses and /v1/messages; the session header per agent). It returns
    the reward: a number for every agent, a dict by agent name, or None to score each agent's last reply
    with --rm-type. May be ``async def``. The calls it makes under its sessions are the samples."""
    agents: list[str] = [DEFAULT_AGENT]
    """The agents acting in one episode (multi-agent runs: e.g. '[searcher, answerer]'); each is a session of
    its own (``task.headers(name)``), trained on its own tokens only, its samples grouped apart. Samples per
    rollout step: --rollout-batch-size x --n-samples-per-prompt x the number of agents."""
    agent_timeout_s: float = Field(300.0, gt=0.0)
    """An episode whose agent has not returned by then ends (its calls so far are kept, the reward is the
    failure score, counted as agent_timeout); later calls of its sessions are refused."""
    agent_concurrency: int = Field(64, ge=1)
    """Episodes whose agents run at once (threads); their engine calls are batched together."""

    @field_validator("agents")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if not a or not a.replace("_", "").replace("-", "").isalnum()]
        if not v or bad or len(set(v)) != len(v):
            raise ValueError(
                f"--agents must be distinct names of letters, digits, '-' and '_' (got {v!r}), e.g. "
                "'[searcher, answerer]'"
            )
        return v
