r"""Math rewards: pull the final answer out of a response and check it against the label.

Why three variants of one reward: recipes disagree on what a *format* failure is worth.

- ``math``: lenient. Takes ``\boxed{}`` (last one wins), else an ``Answer:`` line, else the last
  number in the text. 1.0 if equivalent to the label, else 0.0. Good for evaluation and for bases
  that have not learned a format yet.
- ``deepscaler``: 1.0 only if the answer is boxed (or on an ``Answer:`` line) *and* correct, else
  0.0; text inside an unterminated ``<think>`` block does not count. A bare trailing number earns
  nothing, which pushes the policy to commit to a final answer.
- ``dapo``: the DAPO recipe. The answer must be on an ``Answer:`` line; 1.0 if correct, -1.0
  otherwise (including a missing line), so wrong and unformatted answers are punished equally.

Equivalence (fractions, decimals, units, sympy for symbolic forms) lives in
:mod:`relax_rewards.math_equiv`; sympy is only imported when a string comparison is not enough.
A label may be a string, a number, a ``\boxed{}`` solution, or a list of acceptable answers.
"""

from __future__ import annotations

import re
from typing import Any

from relax_rewards.math_equiv import is_equiv
from relax_rewards.registry import register
from relax_rewards.types import RewardResult

__all__ = [
    "dapo_reward",
    "deepscaler_reward",
    "extract_answer",
    "extract_answer_line",
    "extract_boxed",
    "extract_last_number",
    "math_reward",
]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_LINE_RE = re.compile(r"(?i)\b(?:final\s+)?answer\s*[*_]*\s*[:：]\s*([^\n]*)")
_NUMBER_RE = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\s*/\s*\d+|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)(?!\w)"
)
MAX_RESPONSE_CHARS = 200_000  # longer responses are scored on their tail


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (nested braces allowed), or ``None`` if there is none.

    An unterminated last box is skipped in favour of the previous complete one.

    >>> extract_boxed(r"so \boxed{1} no wait \boxed{\frac{1}{2}}.")
    '\\frac{1}{2}'
    >>> extract_boxed(r"\boxed 7") , extract_boxed("no box") is None
    ('7', True)
    """
    for m in reversed(list(_BOX_RE.finditer(text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{" and text[j - 1] != "\\":
                    depth += 1
                elif text[j] == "}" and text[j - 1] != "\\":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            continue  # unterminated: try an earlier box
        bare = re.match(r"[^\s$.,;]+", text[i:])
        if bare and i > m.end():
            return bare.group(0)
    return None


def extract_answer_line(text: str) -> str | None:
    r"""The text after the last ``Answer:`` (DAPO style) up to the line end, unwrapping a box in it.

    >>> extract_answer_line("work...\nAnswer: 42")
    '42'
    >>> extract_answer_line(r"**Final Answer:** $\boxed{3}$")
    '3'
    """
    matches = _ANSWER_LINE_RE.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip()
    boxed = extract_boxed(answer)
    if boxed is not None:
        return boxed
    return answer.strip(" \t$.*_") or None


def extract_last_number(text: str) -> str | None:
    """The last number in the text (integers, decimals, ``1,000``, ``3/4``, ``1e5``), or ``None``.

    >>> extract_last_number("We get 12 apples, then 1,500.5 total.")
    '1,500.5'
    """
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


def extract_answer(text: str) -> tuple[str | None, str | None]:
    r"""``(answer, how)``: how is ``"boxed"``, ``"answer_line"``, ``"last_number"`` or ``None``.

    >>> extract_answer(r"Answer: 5 but really \boxed{6}")
    ('6', 'boxed')
    >>> extract_answer("it is 12")
    ('12', 'last_number')
    """
    text = _tail(text)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    line = extract_answer_line(text)
    if line is not None:
        return line, "answer_line"
    number = extract_last_number(text)
    if number is not None:
        return number, "last_number"
    return None, None


@register("math")
def math_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    r"""1.0 if the response's final answer equals the label, else 0.0 (lenient extraction).

    >>> math_reward(r"... so the answer is $\boxed{\dfrac{1}{2}}$.", "0.5").score
    1.0
    >>> r = math_reward("I think it is 7", "8")
    >>> r.score, r.details["extracted"], r.details["format_ok"]
    (0.0, '7', False)
    """
    answer, how = extract_answer(response)
    correct = answers_match(answer, label)
    return RewardResult(
        1.0 if correct else 0.0,
        {
            "extracted": answer,
            "format_ok": how in ("boxed", "answer_line"),
            "format": how,
            "correct": correct,
        },
    )


@register("deepscaler")
def deepscaler_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    r"""1.0 if a boxed (or ``Answer:``) answer after any ``</think>`` is correct, else 0.0.

    >>> deepscaler_reward(r"<think>maybe 4</think> The answer is \boxed{4}.", "4").score
    1.0
    >>> deepscaler_reward("The answer is 4.", "4").score  # no box, no credit
    0.0
    >>> deepscaler_reward(r"<think>\boxed{4}", "4").score  # never left the think block
    0.0
    """
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    elif "<think>" in response:
        return RewardResult(0.0, {"extracted": None, "format_ok": False, "format": None, "correct": False})
    answer, how = extract_answer(response)
    format_ok = how in ("boxed", "answer_line")
    correct = format_ok and answers_match(answer, label)
    return RewardResult(
        1.0 if correct else 0.0,
        {"extracted": answer, "format_ok": format_ok, "format": how, "correct": correct},
    )


@register("dapo")
def dapo_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    """1.0 if the last ``Answer:`` line is correct, else -1.0 (missing line included).

    >>> dapo_reward("Some work.\\nAnswer: 34", "34").score
    1.0
    >>> dapo_reward("Some work. The answer is 34", "34").score
    -1.0
    """
    answer = extract_answer_line(_tail(response))
    correct = answers_match(answer, label)
    return RewardResult(
        1.0 if correct else -1.0,
        {"extracted": answer, "format_ok": answer is not None, "format": "answer_line", "correct": correct},
    )


def _tail(text: str) -> str:
    text = "" if text is None else str(text)
    return text[-MAX_RESPONSE_CHARS:]


def answers_match(answer: str | None, label: Any) -> bool:
    labels = label if isinstance(label, list | tuple | set | frozenset) else [label]
    usable = [c for c in labels if isinstance(c, str | int | float) and not isinstance(c, bool)]
    if label is None:  # no label: 0 (label-free runs rescore by group; the scorer counts "unlabeled")
        return False
    if not usable:  # a malformed label: no response can match it (a failure, not a 0)
        raise ValueError(
            f"a math label must be a string, a number or a list of them, not {type(label).__name__} "
            f"{str(label)[:60]!r}: fix the sample's label column"
        )
    if answer is None:
        return False
    for candidate in usable:
        text = str(candidate)
        boxed = extract_boxed(text) if "\\boxed" in text or "\\fbox" in text else None
        if is_equiv(answer, boxed if boxed is not None else text):
            return True
    return False
