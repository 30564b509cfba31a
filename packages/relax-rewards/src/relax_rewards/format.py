r"""Format rewards and the ``openr1mm`` reward (format + accuracy, as in open-r1 multimodal).

Why format rewards: R1-style recipes ask the model to reason in ``<think>…</think>`` and answer in
``<answer>…</answer>``; a small reward for respecting that template is what teaches it. The helpers
here are plain predicates, reusable inside other rewards.

``openr1mm``: score = accuracy + format, each 0 or 1 (so 0, 1 or 2, as in open-r1-multimodal's two
summed rewards). Accuracy compares the ``<answer>`` content (or its ``\boxed{}``) to the label with
the math equivalence, falling back to a normalised string match for non-numeric answers.
"""

from __future__ import annotations

import re
from typing import Any

from relax_rewards.registry import register
from relax_rewards.types import RewardResult

__all__ = [
    "extract_tag",
    "format_reward",
    "has_think_answer_format",
    "no_reward",
    "openr1mm_reward",
    "think_format_reward",
]

_THINK_ANSWER_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def has_think_answer_format(response: str) -> bool:
    """Exactly ``<think>…</think>`` then ``<answer>…</answer>`` (whitespace around allowed).

    >>> has_think_answer_format("<think>hmm</think> <answer>4</answer>")
    True
    >>> has_think_answer_format("<answer>4</answer>")
    False
    """
    r = response or ""
    return bool(_THINK_ANSWER_RE.match(r)) and r.count("<think>") == 1 and r.count("<answer>") == 1


def extract_tag(response: str, tag: str) -> str | None:
    """Content of the last ``<tag>…</tag>``, or ``None``.

    >>> extract_tag("<answer> 42 </answer>", "answer")
    '42'
    """
    m = re.findall(rf"<{tag}>(.*?)</{tag}>", response or "", re.DOTALL)
    return m[-1].strip() if m else None


@register("none")
def no_reward(response: str, label: Any = None, metadata: dict | None = None) -> float:
    """Always 0.0: for runs whose only signal is another term, e.g. pure on-policy distillation
    (``--rm-type none --teacher-checkpoint ...``), where every group's task advantage is then 0.

    >>> no_reward("anything", "42")
    0.0
    """
    return 0.0


@register("format")
def format_reward(response: str, label: Any = None, metadata: dict | None = None) -> float:
    """1.0 for the ``<think>…</think><answer>…</answer>`` template, else 0.0.

    >>> format_reward("<think>a</think><answer>b</answer>", None)
    1.0
    """
    return 1.0 if has_think_answer_format(response) else 0.0


@register("think_format")
def think_format_reward(response: str, label: Any = None, metadata: dict | None = None) -> float:
    """1.0 if the response has one closed ``<think>`` block followed by a non-empty answer.

    >>> think_format_reward("<think>a</think> 42", None), think_format_reward("<think>a", None)
    (1.0, 0.0)
    """
    r = response or ""
    ok = r.count("<think>") == 1 and r.count("</think>") == 1 and bool(r.rsplit("</think>", 1)[1].strip())
    return 1.0 if ok and r.index("<think>") < r.index("</think>") else 0.0


@register("openr1mm")
def openr1mm_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    """Accuracy (0/1) + format (0/1) for ``<think>…</think><answer>…</answer>`` responses.

    >>> openr1mm_reward("<think>2+2</think><answer>4</answer>", "4").score
    2.0
    >>> openr1mm_reward("the answer is 4", "4").score
    0.0
    """
    from relax_rewards.f1 import normalize_answer
    from relax_rewards.math import answers_match, extract_boxed

    fmt = has_think_answer_format(response)
    answer = extract_tag(response, "answer")
    if answer is not None:
        boxed = extract_boxed(answer)
        answer = boxed if boxed is not None else answer
    correct = answer is not None and (
        answers_match(answer, label) or (normalize_answer(answer) == normalize_answer(str(label)) != "")
    )
    return RewardResult(
        float(correct) + float(fmt), {"extracted": answer, "format_ok": fmt, "correct": bool(correct)}
    )
