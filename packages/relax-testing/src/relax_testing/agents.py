"""Agents for the tests of ``--agent-path`` runs (``relax_rollout.agents``): each written as a user would, with
the real SDKs (``anthropic``, ``openai``) pointed at the rollout's server, and a few that misbehave.

``SEEN`` keeps, per session, the replies the agent got back, so a test can compare what was trained on
with what the agent saw."""

from __future__ import annotations

import threading
import time
from typing import Any

SEEN: dict[str, list[str]] = {}
_lock = threading.Lock()


def _saw(session: str, text: str) -> None:
    with _lock:
        SEEN.setdefault(session, []).append(text)


def messages_two_turns(task: Any) -> float:
    """Anthropic's Messages API: the problem, then "wrong, try again" once if the answer is wrong; asks for
    temperature 0.3 (the run's server samples at --rollout-temperature whatever is asked). Reward 1 if an
    answer is right."""
    import anthropic

    client = anthropic.Anthropic(base_url=task.base_url, api_key=task.api_key, default_headers=task.headers())
    messages: list[Any] = [{"role": "user", "content": str(task.prompt)}]
    for _ in range(2):
        reply = client.messages.create(
            model="default", max_tokens=task.max_tokens, messages=messages, extra_body={"temperature": 0.3}
        )
        text = "".join(b.text for b in reply.content if b.type == "text")
        _saw(task.session(), text)
        if text.strip() == str(task.label):
            return 1.0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "wrong, try again"}]
    return 0.0


def solver_and_checker(task: Any) -> dict[str, float]:
    """Two agents: the solver answers through OpenAI's Chat Completions, the checker sees the problem and
    the solver's answer through Anthropic's Messages and gives the final one; each rewarded for its own."""
    import anthropic
    import openai

    solver = openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key)
    r = solver.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": str(task.prompt)}],
        max_tokens=task.max_tokens,
        extra_headers=task.headers("solver"),
    )
    proposed = r.choices[0].message.content or ""
    _saw(task.session("solver"), proposed)
    checker = anthropic.Anthropic(base_url=task.base_url, api_key=task.api_key)
    m = checker.messages.create(
        model="default",
        max_tokens=task.max_tokens,
        messages=[{"role": "user", "content": f"{task.prompt}{proposed.strip()}?"}],
        extra_headers=task.headers("checker"),
    )
    final = "".join(b.text for b in m.content if b.type == "text")
    _saw(task.session("checker"), final)
    right = str(task.label)
    return {"solver": float(proposed.strip() == right), "checker": float(final.strip() == right)}


def misbehaving(task: Any) -> Any:
    """By the row's label: raises after one call (label 2), hangs after one call (label 15: past a short
    --agent-timeout-s, then tries another call), returns a string (label 8), makes no call (label 9);
    otherwise one call and reward 1."""
    import openai

    client = openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0)

    def ask() -> str:
        r = client.chat.completions.create(
            model="default", messages=task.messages, max_tokens=task.max_tokens, extra_headers=task.headers()
        )
        return r.choices[0].message.content or ""

    label = str(task.label)
    if label == "9":
        return 1.0
    ask()
    if label == "2":
        raise RuntimeError("the agent's tool crashed")
    if label == "15":
        time.sleep(3.0)
        try:
            ask()
        except openai.BadRequestError as e:  # the session ended with the episode: refused
            _saw(task.session(), f"refused: {e.status_code}")
        return 1.0
    if label == "8":
        return "great"
    return 1.0


async def async_agent(task: Any) -> float:
    """An ``async def`` agent (the SDK's async client)."""
    import openai

    client = openai.AsyncOpenAI(base_url=task.openai_base_url, api_key=task.api_key)
    r = await client.chat.completions.create(
        model="default", messages=task.messages, max_tokens=task.max_tokens, extra_headers=task.headers()
    )
    _saw(task.session(), r.choices[0].message.content or "")
    task.tool_failed()  # (as an agent whose tool raised would: counted on the sample)
    await client.close()
    return 0.5


def slow(task: Any) -> float:
    """0.6 s of the agent's own work, then one call."""
    import openai

    time.sleep(0.6)
    client = openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0)
    client.chat.completions.create(
        model="default", messages=task.messages, max_tokens=task.max_tokens, extra_headers=task.headers()
    )
    return 1.0
