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


class CalculatorEnv:
    def __init__(self, prompt: str, label: Any, metadata: dict[str, Any] | None = None) -> None:
        self.label = str(label).strip()

    def reset(self) -> None:
        return None

    def step(self, response: str) -> tuple[Any, bool, dict[str, Any]]:
        call = _CALL.search(response)
        if call:
            try:
                value = safe_arith(call.group(1))
                return (f"{value:g}", False, {"tool_calls": 1})
            except ValueError as e:
                return (f"error: {e}", False, {"tool_errors": 1})
        answer = response.strip()
        return (None, True, {"reward": 1.0 if answer == self.label else 0.0})

    def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"result: {observation}"}]

    def close(self) -> None:
        pass


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
