"""Environments for the demos (``--env-path relax_app.demo.envs:CalculatorEnv``, ``...:ZoomEnv``).

``CalculatorEnv``: the model may call a calculator by answering ``calc: <expression>``; the observation is
the result, and the model answers again. A plain answer ends the episode, scored against the label; a
malformed or unsafe expression is answered with an error message (the episode goes on). Expressions are
parsed with ``ast`` (numbers and + - * / only), never ``eval``-ed: model output is untrusted.

``ZoomEnv`` (DeepEyes-style visual tool use, for the omni demo's image task): the model may answer
``zoom: x0,y0,x1,y1`` (fractions of the image's width and height, 0 ≤ x0 < x1 ≤ 1, 0 ≤ y0 < y1 ≤ 1) and
sees the crop, resized back up to the image's size, as a new image observation; a malformed request gets a
text error; any other reply is the final answer, scored like ``--rm-type multiple_choice``.
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


_ZOOM = re.compile(r"zoom:\s*([^\n]*)", re.IGNORECASE)


def parse_box(text: str) -> tuple[float, float, float, float]:
    """``x0,y0,x1,y1`` as fractions of the image (0 ≤ x0 < x1 ≤ 1, same for y); ValueError otherwise."""
    try:
        box = tuple(float(v) for v in text.replace(" ", "").split(","))
    except ValueError:
        raise ValueError(f"expected four numbers x0,y0,x1,y1, got {text[:40]!r}") from None
    if len(box) != 4:
        raise ValueError(f"expected four numbers x0,y0,x1,y1, got {len(box)}")
    x0, y0, x1, y1 = box
    if not (0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1):
        raise ValueError("need 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1 (fractions of the image)")
    return box  # (len(box) == 4 narrows it to four floats)


class ZoomEnv:
    """Zoom into the row's image (``metadata["media"]["image"][0]``) until the model answers."""

    def __init__(self, prompt: str, label: Any, metadata: dict[str, Any] | None = None) -> None:
        from PIL import Image

        self.label, self.metadata = label, dict(metadata or {})
        images = self.metadata.pop("media", {}).get("image") or []
        if not images:
            raise ValueError("ZoomEnv needs a row image (--multimodal-keys with an image column)")
        if isinstance(images[0], Image.Image):
            self.image = images[0].convert("RGB")
        else:
            with Image.open(images[0]) as im:
                self.image = im.convert("RGB")
        self.zooms = 0

    def reset(self) -> None:
        return None

    def zoom(self, box: tuple[float, float, float, float]) -> Any:
        w, h = self.image.size
        x0, y0, x1, y1 = box
        px = (
            int(x0 * w),
            int(y0 * h),
            max(int(x0 * w) + 1, round(x1 * w)),
            max(int(y0 * h) + 1, round(y1 * h)),
        )
        self.zooms += 1
        return self.image.crop(px).resize((w, h))

    def step(self, response: str) -> tuple[Any, bool, dict[str, Any]]:
        call = _ZOOM.search(response)
        if call:
            try:
                box = parse_box(call.group(1))
                return (self.zoom(box), False, {"zooms": self.zooms})
            except ValueError as e:
                return (f"error: {e}", False, {"zoom_errors": 1})
        from relax_rewards.choice import multiple_choice_reward

        return (None, True, {"reward": multiple_choice_reward(response, self.label, self.metadata).score})

    def format_observation(self, observation: Any) -> list[dict[str, Any]]:
        if isinstance(observation, str):
            return [{"role": "user", "content": observation}]
        return [{"role": "user", "content": "<image>\nThe zoomed region.", "images": [observation]}]

    def close(self) -> None:
        pass


class GuidedZoomEnv(ZoomEnv):
    """``ZoomEnv`` for untrained policies (demo, tests): a reply that neither zooms nor names an option
    zooms into the image's centre instead of ending the episode, so episodes see image observations."""

    def step(self, response: str) -> tuple[Any, bool, dict[str, Any]]:
        from relax_rewards.choice import extract_choice

        if _ZOOM.search(response) or extract_choice(response, "ABCD"):
            return super().step(response)
        return (self.zoom((0.25, 0.25, 0.75, 0.75)), False, {"zooms": self.zooms})
