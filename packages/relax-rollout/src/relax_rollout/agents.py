"""Agentic RL with agents Relax does not own: the user's agent code, unmodified, talks to the rollout's engine.

Why: agents are written against an API (OpenAI's Chat Completions or Responses, Anthropic's Messages), with
an SDK, their own tools and loop. ``--agent-path pkg.mod:fn`` lets such code be trained as it is: the rollout
serves its engine on 127.0.0.1 (``relax_rollout.server``: all three protocols), calls ``fn`` once per sample
with an :class:`AgentTask` (the row; the server's base URL; per agent a session header), and trains on what
the server recorded of the calls made under those sessions — the tokens the model produced, the tokens the
chat template added between turns (loss mask 0), the engine's log-probs — the same trajectories whichever
protocol the agent speaks (``server.trajectories``).

Several agents may act in one episode (``--agents searcher answerer``): each calls under its own session
(``task.headers("searcher")``), so each agent's sample holds only its own conversation and its loss mask only
its own tokens; each agent's n samples of a prompt form their own advantage group. ``fn`` returns the
reward: a number (every agent's), a dict by agent name, or None (each agent's last reply is scored with
--rm-type against the row's label).

An agent that raises, returns something else or runs past --agent-timeout-s ends its episode, counted
(``agent_error``, ``agent_timeout``, ``bad_return``): the calls it made are trained on with the failure
score, later calls under its sessions are refused, and the run goes on. An agent that never called the model
under a session gives that agent a sample with nothing to train on (stop reason ``no_calls``), counted.
"""

from __future__ import annotations

import importlib
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.env import resolve
from relax_rollout.engines.base import EpisodeResult, GenerateOutput
from relax_rollout.prompts import messages_of
from relax_rollout.server.trajectories import SESSION_HEADER, render_prompt


@dataclass(frozen=True)
class AgentTask:
    """What an agent function is given for one episode."""

    prompt: Any
    """The row's prompt: text, or chat messages (:attr:`messages` has it as messages either way)."""
    label: Any
    metadata: dict[str, Any]
    base_url: str
    """The rollout's engine server, ``http://127.0.0.1:<port>``: Anthropic's SDK takes it as its
    ``base_url``; OpenAI's takes :attr:`openai_base_url`."""
    episode: str
    """This episode's name (``<step>:<group>:<sample>``), unique in the run."""
    agents: tuple[str, ...]
    """The agents of the episode (--agents)."""
    max_tokens: int
    """--rollout-max-response-len, a reply's length to ask for (the server cuts at the model's context)."""
    temperature: float
    """--rollout-temperature: what every call is sampled at (the server enforces it, as the trainer scores
    the tokens under it)."""
    api_key: str = "relax"
    """Any non-empty key (SDKs want one; the server on 127.0.0.1 takes generation calls without)."""
    tool_errors: dict[str, int] = field(default_factory=dict, compare=False)
    """Failed tool calls per agent, as the agent reported them (:meth:`tool_failed`)."""

    def tool_failed(self, agent: str | None = None) -> None:
        """Count one of ``agent``'s tool calls as failed (the model's call was malformed, named no tool, or
        the tool raised): the run's ``rollout/tool_call_error_rate`` is these over the calls the model made."""
        name = self.agents[0] if agent is None else agent
        self.tool_errors[name] = self.tool_errors.get(name, 0) + 1

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The prompt as chat messages (a text prompt is one user message)."""
        return messages_of(self.prompt)

    def session(self, agent: str | None = None) -> str:
        """The session name of ``agent``'s calls (default: the first agent)."""
        name = self.agents[0] if agent is None else agent
        if name not in self.agents:
            raise ValueError(f"unknown agent {name!r}: this run's agents are {list(self.agents)} (--agents)")
        return f"{self.episode}/{name}"

    def headers(self, agent: str | None = None) -> dict[str, str]:
        """The HTTP headers that make a call ``agent``'s (``X-Relax-Session``): give them to the SDK's client
        (``default_headers=``) or to each call (``extra_headers=``)."""
        return {SESSION_HEADER: self.session(agent)}


@dataclass
class AgentSample:
    """One agent's part of one episode, as the rollout trains on it."""

    prompt: list[int]
    out: GenerateOutput
    text: str
    """The agent's last reply (what --rm-type scores when the agent returned None)."""


@dataclass
class _Episode:
    task: AgentTask
    future: Future | None = None
    started: float | None = None
    """When the agent function began (None while the episode waits for a thread: not timed yet)."""


def load_agent(path: str) -> Callable[[AgentTask], Any]:
    """The function --agent-path names ('pkg.mod:fn'), or a ValueError saying what is wrong with the path."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--agent-path {path!r}: expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - any import failure is the flag's
        raise ValueError(f"--agent-path {path!r} cannot be imported: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ValueError(f"--agent-path {path!r} is a {type(fn).__name__}, not a function")
    return fn


def _call(fn: Callable[[AgentTask], Any], task: AgentTask) -> Any:
    """The agent's return (an ``async def`` agent run to its end on this thread's own event loop)."""
    return resolve(fn(task))


def rewards_of(value: Any, agents: tuple[str, ...]) -> dict[str, float | None]:
    """The agent function's return as a reward per agent (None: --rm-type scores that agent's reply), or a
    ValueError saying what it should have returned."""
    if value is None:
        return dict.fromkeys(agents)
    if isinstance(value, dict):
        if set(value) != set(agents):
            raise ValueError(f"a dict of rewards names every agent {list(agents)}; got keys {sorted(value)}")
        return {a: _number(value[a], a) for a in agents}
    return dict.fromkeys(agents, _number(value, "episode"))


def _number(v: Any, what: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"the {what} reward must be a finite number or None (got {v!r})")
    return float(v)


class AgentServer:
    """The rollout's ``engine`` served on 127.0.0.1 for its agents (any free port; :attr:`base_url`): an
    in-process torch engine behind a :class:`~relax_rollout.engines.shared.SharedTorchEngine`, so the agents'
    calls decode together; weight updates go through :meth:`update_weights` (between two decode steps, or
    once the running calls end)."""

    def __init__(self, cfg: RelaxConfig, engine: Any, tokenizer: Any, model_path: str) -> None:
        from relax_rollout.engines.shared import SharedTorchEngine
        from relax_rollout.engines.torch_engine import TorchEngine
        from relax_rollout.server.served import ServedEngine

        r = cfg.rollout
        self.shared = (
            SharedTorchEngine(engine, cfg.agent.agent_concurrency, drain=not r.partial_rollout)
            if isinstance(engine, TorchEngine)
            else None
        )
        self.engine = self.shared if self.shared is not None else engine
        self.served = ServedEngine(self.engine, tokenizer, model_path, max_queued_requests=None)
        self.served.state.sampling = (r.rollout_temperature, r.rollout_top_p)
        self.state = self.served.state
        self.base_url = self.served.url

    def update_weights(self, tensors: dict[str, Any], version: int) -> None:
        self.engine.update_weights(tensors, version)

    def close(self) -> None:
        self.served.close()
        if self.shared is not None:
            self.shared.close()


class AgentHost:
    """Runs ``cfg``'s agent function on episodes against ``state`` (an engine server's state, served at
    ``base_url``): :meth:`run` one step's rows. ``stats``: counters shared with the rollout."""

    def __init__(self, cfg: RelaxConfig, state: Any, base_url: str, tokenizer: Any, stats: dict[str, Any]):
        assert cfg.agent.agent_path is not None, "an agent host needs --agent-path"
        self.cfg, self.state, self.base_url, self.tokenizer, self.stats = (
            cfg,
            state,
            base_url,
            tokenizer,
            stats,
        )
        self.fn = load_agent(cfg.agent.agent_path)
        self.agents = tuple(cfg.agent.agents)
        self.pool = ThreadPoolExecutor(cfg.agent.agent_concurrency, "agent")
        self._lock = threading.Lock()

    def run(self, step: int, rows: list[Any], alive: Callable[[], None] = lambda: None) -> list[AgentSample]:
        """Every row's n episodes, run concurrently; their samples ordered by row, then agent, then episode
        (each agent's n samples of a row adjacent: a group)."""
        n = self.cfg.rollout.n_samples_per_prompt
        episodes = [[self._start(step, g, j, row) for j in range(n)] for g, row in enumerate(rows)]
        ends = [[self._wait(ep, alive) for ep in group] for group in episodes]
        out = []
        for g in range(len(rows)):
            for agent in self.agents:
                for j in range(n):
                    rewards, failure = ends[g][j]
                    out.append(self._sample(episodes[g][j].task, agent, rewards, failure))
        return out

    def _start(self, step: int, g: int, j: int, row: Any) -> _Episode:
        r = self.cfg.rollout
        task = AgentTask(
            prompt=row.prompt,
            label=row.label,
            metadata=dict(row.metadata),
            base_url=self.base_url,
            episode=f"{step}:{g}:{j}",
            agents=self.agents,
            max_tokens=r.rollout_max_response_len,
            temperature=r.rollout_temperature,
        )
        ep = _Episode(task)
        ep.future = self.pool.submit(self._begin, ep)
        return ep

    def _begin(self, ep: _Episode) -> Any:
        ep.started = time.monotonic()
        return _call(self.fn, ep.task)

    def _wait(
        self, ep: _Episode, alive: Callable[[], None]
    ) -> tuple[dict[str, float | None], tuple[str, str]]:
        """(reward per agent, (failure kind, message) or ("", "")) once the episode ended or timed out."""
        limit = self.cfg.agent.agent_timeout_s
        assert ep.future is not None, "an episode is waited for once started"
        while True:
            left = limit if ep.started is None else limit - (time.monotonic() - ep.started)
            try:
                value = ep.future.result(timeout=max(0.0, min(0.5, left)))
                break
            except FutureTimeout:
                alive()
                if left <= 0:
                    ep.future.cancel()
                    return {}, (
                        "agent_timeout",
                        f"the agent did not return within --agent-timeout-s {limit:g}",
                    )
            except Exception as e:  # noqa: BLE001 - the agent's failure ends its episode, counted
                return {}, ("agent_error", f"the agent raised {type(e).__name__}: {e}")
        try:
            return rewards_of(value, self.agents), ("", "")
        except ValueError as e:
            return {}, ("bad_return", f"bad return of the agent: {e}")

    def _sample(
        self,
        task: AgentTask,
        agent: str,
        rewards: dict[str, float | None],
        failure: tuple[str, str],
    ) -> AgentSample:
        """``agent``'s sample of the episode: its session's last trajectory (earlier ones, where the agent
        rewrote its history, are counted and left out), or a sample with nothing to train on."""
        kind, message = failure
        trajectories = self.state.recorder.take(task.session(agent))
        self._count("agent_trajectories_dropped", max(0, len(trajectories) - 1))
        reason = kind or "agent_done"
        if not trajectories:
            reason = kind or "no_calls"
            ids = render_prompt(self.tokenizer, task.messages)
            eos = self.tokenizer.eos_token_id
            out = GenerateOutput([eos], [0.0], reason, int(self.state.engine.weight_version))
            result = EpisodeResult([0.0], 0, env_error=message or "the agent made no call under this session")
            result.env_reward_error, result.failure = (message or "no call was made", kind or "no_calls")
        else:
            t = trajectories[-1]
            plen = int(t[sample.PROMPT_LEN])
            ids, response = list(t[sample.TOKENS][:plen]), list(t[sample.TOKENS][plen:])
            finish = "length" if t["finish_reasons"][-1] == "length" and not kind else reason
            out = GenerateOutput(
                response, list(t[sample.ROLLOUT_LOG_PROBS]), finish, min(t["weight_versions"])
            )
            result = EpisodeResult(list(t[sample.LOSS_MASK]), len(t["finish_reasons"]), env_error=message)
            result.turn_s = list(t["call_s"])
            result.tool_calls = sum(len(m.get("tool_calls") or ()) for m in t["messages"])
            result.tool_errors = task.tool_errors.get(agent, 0)
            if kind:
                result.env_reward_error, result.failure = message, kind
            else:
                result.env_reward = rewards.get(agent)
        result.agent = agent
        self._count(f"stop/{out.finish_reason}", 1)
        out.episode = result
        replies = [
            m.get("content") or ""
            for m in (t["messages"] if trajectories else ())
            if m["role"] == "assistant"
        ]
        return AgentSample(ids, out, str(replies[-1]) if replies else "")

    def _count(self, key: str, k: int) -> None:
        if k:
            with self._lock:
                self.stats[key] = self.stats.get(key, 0) + k

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
