"""Environments for the text demo's arithmetic task (``--env-path relax_app.demo.envs:CalculatorEnv``).

``CalculatorEnv``: the model may call a calculator by answering ``calc: <expression>``; the observation is
the result, and the model answers again. A plain answer ends the episode, scored against the label; a
malformed or unsafe expression is answered with an error message (the episode goes on). Expressions are
parsed with ``ast`` (numbers and + - * / only), never ``eval``-ed: model output is untrusted.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from relax_core.tools import ToolEnv

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_CALL = re.compile(r"calc:\s*(.+)", re.IGNORECASE)


def safe_arith(expr: str) -> float:
    """Value of an arithmetic expression of numbers and + - * /; ValueError for anything else."""

    def ev(node: ast.AST) -> float:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression {ast.dump(node)[:60]}")

    if len(expr) > 64:
        raise ValueError("expression too long")
    try:
        return ev(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None


class CalculatorEnv(ToolEnv):
    """The arithmetic task with a calculator tool (``relax_core.tools.ToolEnv``): ``calc: <expression>``
    or a Qwen-style ``<tool_call>{"name": "calc", "arguments": {"expr": ...}}</tool_call>`` gets the value
    back as a tool message; a plain answer ends the episode, scored against the label."""

    tools = {"calc": lambda expr: f"{safe_arith(str(expr)):g}"}
    max_calls = 3

    def parse(self, response: str) -> tuple[str, dict[str, Any]] | None:
        m = _CALL.search(response)
        return ("calc", {"expr": m.group(1)}) if m else super().parse(response)

    def score(self, answer: str) -> float:
        return 1.0 if answer.strip() == str(self.label).strip() else 0.0


class RetryEnv:
    """Multi-turn arithmetic with feedback: a wrong answer gets "wrong, try again" and another turn; the
    reward is 1 for a right answer (at any turn), else 0. Untrained models take several turns, so it is
    also what the multi-turn tests and benchmarks drive."""

    def __init__(self, prompt: str, label: Any, metadata: dict[str, Any] | None = None) -> None:
        self.label = str(label).strip()

    def reset(self) -> None:
        return None

    def step(self, response: str) -> tuple[Any, bool, dict[str, Any]]:
        right = response.strip() == self.label
        return ("wrong, try again", right, {"reward": 1.0 if right else 0.0})

    def format_observation(self, observation: Any) -> str:
        return str(observation)

    def close(self) -> None:
        pass
