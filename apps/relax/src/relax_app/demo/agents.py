"""The agent demo's agents: ordinary SDK code, as a user writes it, trained by ``--agent-path``.

Each is given a ``relax_rollout.agents.AgentTask`` and points its SDK at ``task.base_url`` with the task's
session header; it knows nothing else of Relax. ``relax train --agent-demo`` runs :func:`messages_agent`;
``--agent-path relax_app.demo.agents:solver_and_checker --agents solver checker`` runs the two-agent one.
"""

from __future__ import annotations

import functools
from typing import Any

FEEDBACK = "wrong, try again"


@functools.cache
def _anthropic(base_url: str, api_key: str) -> Any:
    """One client per server, shared by the episodes (an SDK client holds a connection pool)."""
    import anthropic

    return anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)


@functools.cache
def _openai(base_url: str, api_key: str) -> Any:
    import openai

    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def messages_agent(task: Any) -> float:
    """Anthropic's Messages API: answer the problem; after a wrong answer, hear "wrong, try again" and answer
    once more. Reward 1 for a right first answer, 0.5 for a right second one, else 0."""
    client = _anthropic(task.base_url, task.api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": str(task.prompt)}]
    for reward in (1.0, 0.5):
        reply = client.messages.create(
            model="default", max_tokens=task.max_tokens, messages=messages, extra_headers=task.headers()
        )
        text = "".join(block.text for block in reply.content if block.type == "text")
        if text.strip() == str(task.label).strip():
            return reward
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FEEDBACK}]
    return 0.0


def solver_and_checker(task: Any) -> dict[str, float]:
    """Two agents in one episode: the solver answers (OpenAI's Chat Completions), the checker is shown the
    problem with the solver's answer (``23+45=67?``) and gives the final one (Anthropic's Messages). Each is
    rewarded for its own answer: a checker that corrects a wrong solver gains, one that copies it does not."""
    solver = _openai(task.openai_base_url, task.api_key)
    r = solver.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": str(task.prompt)}],
        max_tokens=task.max_tokens,
        extra_headers=task.headers("solver"),
    )
    proposed = (r.choices[0].message.content or "").strip()
    checker = _anthropic(task.base_url, task.api_key)
    m = checker.messages.create(
        model="default",
        max_tokens=task.max_tokens,
        messages=[{"role": "user", "content": f"{task.prompt}{proposed}?"}],
        extra_headers=task.headers("checker"),
    )
    final = "".join(block.text for block in m.content if block.type == "text").strip()
    label = str(task.label).strip()
    return {"solver": float(proposed == label), "checker": float(final == label)}
