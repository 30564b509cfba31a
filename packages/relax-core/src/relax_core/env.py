"""The environment interface of agentic multi-turn RL, and the checks any environment must pass.

An environment is built per sample (``--env-path pkg.mod:Class``, called with the sample's ``prompt``,
``label`` and ``metadata``) and then driven turn by turn by the rollout role: the model answers, ``step``
judges the answer and returns the next observation, ``format_observation`` turns that observation into
chat messages that are appended to the conversation token by token (``relax_rollout.turns``). Methods may
be ``async def``; the rollout role runs them either way. An environment that raises, hangs past
``--env-step-timeout-s`` or returns something malformed ends only its own sample, with the reason recorded.

Multimodal (Qwen-VL/Omni models): a row's media (``--multimodal-keys``) reach the environment as
``metadata["media"]`` (by modality: ``{"image": [path, ...]}``), and an observation's messages may carry new
media next to ``<image>`` / ``<video>`` / ``<audio>`` markers in their content: ``{"role": "user", "content":
"<image> the crop", "images": [PIL image | path | HxWx3 uint8 array]}`` (also ``"videos"``, ``"audio"``);
the rollout role expands them as it does the prompt's (``relax_rollout.multiturn``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Environment(Protocol):
    def reset(self) -> Any:
        """Start the episode; returns an initial observation to show before the first turn, or None."""

    def step(self, response: str) -> tuple[Any, bool, dict[str, Any]]:
        """Judge the model's turn: (observation, done, info). ``info["reward"]``, when present at the end of
        the episode, is the sample's reward (otherwise the configured --rm-type scores the conversation)."""

    def format_observation(self, observation: Any) -> str | list[dict[str, Any]]:
        """Chat messages for an observation: a string (one user message) or a list of messages
        (``{"role": "tool" | "user", "content": ...}``, optionally with ``"images"`` / ``"videos"`` /
        ``"audio"`` lists for a multimodal model)."""

    def close(self) -> None:
        """Release what the episode holds (processes, sandboxes); called once, however the episode ended."""


def resolve(result: Any) -> Any:
    """The value of a sync or async environment method's result."""
    return asyncio.run(_awaited(result)) if inspect.isawaitable(result) else result


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    """``asyncio.run`` takes a coroutine; an ``async def`` method's result is one, any other awaitable is
    awaited in one."""
    return await awaitable


def env_factory(path: str) -> Any:
    """The environment class (or factory) named by ``path`` ("pkg.mod:Name"); a bad path is a config error."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--env-path {path!r}: expected 'package.module:ClassName'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--env-path {path!r}: cannot import it ({e})") from e


def build_env(
    path: str, prompt: str | list[dict[str, Any]], label: Any, metadata: dict[str, Any]
) -> Environment:
    """Instantiate the environment named by ``path`` for one sample (see :func:`env_factory`); ``prompt`` is
    the row's as the dataset gives it: text, or its chat messages (the episode starts from those)."""
    env: Environment = env_factory(path)(prompt=prompt, label=label, metadata=metadata)
    missing = [
        m for m in ("reset", "step", "format_observation", "close") if not callable(getattr(env, m, None))
    ]
    if missing:
        raise TypeError(
            f"--env-path {path!r}: the environment lacks {missing}; see relax_core.env.Environment"
        )
    return env


class BrokenEnv:
    """Stands in for an environment whose construction failed, so its sample ends with the reason recorded
    (after the model's first turn) instead of stopping the batch."""

    def __init__(self, error: str) -> None:
        self.error = error

    def reset(self) -> None:
        raise RuntimeError(self.error)

    def step(self, response: str) -> tuple[Any, bool, dict[str, Any]]:
        raise RuntimeError(self.error)

    def format_observation(self, observation: Any) -> str:
        return ""

    def close(self) -> None:
        pass


def as_messages(formatted: Any) -> list[dict[str, Any]]:
    """``format_observation``'s result as a list of chat messages; raises TypeError when malformed."""
    if isinstance(formatted, str):
        return [{"role": "user", "content": formatted}]
    if isinstance(formatted, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in formatted
    ):
        return formatted
    raise TypeError(
        f"format_observation returned {type(formatted).__name__}; return a str or a list of "
        "{'role': ..., 'content': str} messages"
    )


def check_environment(
    factory: Any, prompt: str = "1+1=", label: Any = "2", responses: tuple[str, ...] = ("2",)
) -> list[tuple[str, Any, bool, dict[str, Any]]]:
    """Contract checks any environment can be run through (use it in the environment's own tests):
    builds it, resets, steps through ``responses``, formats every observation, closes. Returns the
    transcript [(response, observation, done, info)]; raises AssertionError naming the broken rule."""
    env = factory(prompt=prompt, label=label, metadata={})
    transcript: list[tuple[str, Any, bool, dict[str, Any]]] = []
    try:
        first = resolve(env.reset())
        if first is not None:
            as_messages(resolve(env.format_observation(first)))
        for r in responses:
            out = resolve(env.step(r))
            assert isinstance(out, tuple) and len(out) == 3, (
                f"step must return (observation, done, info), got {out!r}"
            )
            obs, done, info = out
            assert isinstance(done, bool), f"step's done must be a bool, got {type(done).__name__}"
            assert isinstance(info, dict), f"step's info must be a dict, got {type(info).__name__}"
            if "reward" in info:
                assert isinstance(info["reward"], int | float), "info['reward'] must be a number"
            if not done:
                as_messages(resolve(env.format_observation(obs)))
            transcript.append((r, obs, done, info))
            if done:
                break
    finally:
        resolve(env.close())
    return transcript
