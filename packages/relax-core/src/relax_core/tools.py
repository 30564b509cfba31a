"""A base for tool-calling environments: parse a tool call from the model's turn, run the tool with a
time-out, return the result as the next observation; a turn without a call is the final answer.

Subclasses set ``tools`` (name -> function of keyword arguments) and ``score(answer)``; the default parser
reads Qwen / Hermes tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), override
:meth:`ToolEnv.parse` for another format. Tool errors, unknown tools, bad arguments and time-outs become a
tool message saying what went wrong — the model sees it and may retry; the episode goes on. A tool that
runs model-written code must sandbox it itself (``relax_rewards`` has a sandbox for code); the time-out
here abandons a stuck call's thread, it cannot kill it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
from collections.abc import Callable
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class ToolEnv:
    tools: dict[str, Callable[..., Any]] = {}
    """Tool name -> function called with the call's arguments as keywords."""
    timeout_s: float = 5.0
    """Seconds a tool may run; longer calls are answered with a time-out error."""
    max_calls: int = 8
    """Tool calls allowed per episode; more end the episode (reward as for the last answer)."""

    def __init__(self, prompt: str, label: Any, metadata: dict[str, Any] | None = None) -> None:
        self.prompt, self.label, self.metadata = prompt, label, metadata or {}
        self.calls = 0
        self.errors = 0
        """Tool calls that failed (their result says ``error: ...``)."""
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="relax-tool")

    def parse(self, response: str) -> tuple[str, dict[str, Any]] | None:
        """(tool name, arguments) of the first tool call in ``response``, or None for a final answer.
        A call that is not valid JSON is returned as ("", {"error": ...}) so the model hears about it."""
        m = _CALL.search(response)
        if m is None:
            return None
        try:
            call = json.loads(m.group(1))
            name, args = call["name"], call.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
        except (ValueError, KeyError, TypeError) as e:
            return "", {
                "error": f'malformed tool call ({e}); write <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>'
            }
        return name, args

    def score(self, answer: str) -> float:
        """Reward of a final answer (override); 0.0 by default."""
        return 0.0

    def run_tool(self, name: str, args: dict[str, Any]) -> str:
        if name == "":
            return f"error: {args['error']}"
        if name not in self.tools:
            return f"error: unknown tool {name!r}; available: {sorted(self.tools)}"
        try:
            return str(self._pool.submit(self.tools[name], **args).result(timeout=self.timeout_s))
        except cf.TimeoutError:
            self._pool.shutdown(wait=False, cancel_futures=True)  # abandon the stuck call
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="relax-tool")
            return f"error: {name} timed out after {self.timeout_s}s"
        except TypeError as e:
            return f"error: bad arguments for {name}: {e}"
        except Exception as e:  # noqa: BLE001 - the tool's failure is the model's observation
            return f"error: {name} failed: {type(e).__name__}: {e}"

    # -- the Environment protocol ---------------------------------------------------------------
    def reset(self) -> None:
        return None

    def step(self, response: str) -> tuple[Any, bool, dict[str, Any]]:
        call = self.parse(response)
        counts = {"tool_calls": self.calls, "tool_errors": self.errors}
        if call is None:
            return None, True, {"reward": float(self.score(response)), **counts}
        self.calls += 1
        result = self.run_tool(*call)
        self.errors += result.startswith("error: ")
        done = self.calls >= self.max_calls
        info = {"tool_calls": self.calls, "tool_errors": self.errors, **({"reward": 0.0} if done else {})}
        return {"name": call[0], "content": result}, done, info

    def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        return [{"role": "tool", "content": observation["content"]}]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
