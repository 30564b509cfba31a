r"""``multiple_choice`` and ``gpqa``: which option letter did the model pick?

Why so many patterns: models write their pick as ``\boxed{B}``, ``Answer: (B)``, ``**B**``,
``The correct option is B.``, ``B) 42``, ``<answer>B</answer>`` (the R1 format of the multimodal
datasets), or only restate the option's text. When the response has ``<answer>`` tags, only the last
tag's content is searched. We try, in order: a lone letter in the tag, a box, an ``Answer:`` line, "answer/option/choice is X" phrases, a lone letter (possibly in
parentheses or bold) on the last non-empty line, the last parenthesised letter. If no letter is
found and ``metadata["choices"]`` lists the options, the response's final answer is matched to an
option's text. ``gpqa`` is the same with four options (A–D).

The label may be a letter (``"C"``), a 0-based index (``2``) or the option text (with ``choices``).
"""

from __future__ import annotations

import re
import string
from typing import Any

from relax_rewards.math import extract_boxed
from relax_rewards.registry import register
from relax_rewards.types import RewardResult

__all__ = ["extract_choice", "gpqa_reward", "multiple_choice_reward"]


def _patterns(letters: str) -> list[re.Pattern]:
    L = f"[{letters}]"
    return [
        re.compile(rf"(?i)\banswer\s*(?:is)?\s*[*_]*\s*[:：]\s*[*_(\[\s]*({L})(?![a-z])"),
        re.compile(
            rf"(?i)\b(?:answer|option|choice)\s+(?:is|would be|should be|=)\s*[:：]?\s*[*_(\[\s]*(?:option\s+)?({L})(?![a-z])"
        ),
        re.compile(rf"(?i)\b(?:choose|pick|select|go with)\s+(?:option\s+)?[*_(\[]*({L})(?![a-z])"),
        re.compile(rf"(?i)\b(?:option|choice)\s+[*_(]*({L})(?![a-z])[)*_]*\s+is\s+(?:correct|right)"),
    ]


def extract_choice(response: str, letters: str = "ABCDEFGHIJ") -> str | None:
    r"""The option letter a response commits to, or ``None``.

    >>> extract_choice(r"... so \boxed{C}")
    'C'
    >>> extract_choice("I think the answer is (b).")
    'B'
    >>> extract_choice("Reasoning...\n**D**")
    'D'
    >>> extract_choice("<think>A or B?</think><answer>(B) Paris</answer>")
    'B'
    """
    text = (response or "")[-20_000:]
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    tagged = re.findall(r"(?is)<answer>(.*?)</answer>", text)
    if tagged:
        text = tagged[-1]
        m = re.fullmatch(
            rf"[*_(\[\s]*([{letters}{letters.lower()}])[)\]*_]*(?:[.:)]\s*.*)?", text.strip(), re.S
        )
        if m:
            return m.group(1).upper()
    boxed = extract_boxed(text)
    if boxed is not None:
        m = re.fullmatch(rf"\s*(?:\\text\{{)?\(?([{letters}{letters.lower()}])\)?\}}?\s*(?:[.:)].*)?", boxed)
        if m:
            return m.group(1).upper()
    for pattern in _patterns(letters + letters.lower()):
        found = pattern.findall(text)
        if found:
            return found[-1].upper()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines:
        m = re.fullmatch(rf"[*_(\[\s]*([{letters}])[)\]*_.:\s]*(?:\s.*)?", lines[-1])
        if m and (len(lines[-1]) <= 3 or re.match(rf"[*_(\[\s]*[{letters}][)\]*_.:]", lines[-1])):
            return m.group(1)
    found = re.findall(rf"\(([{letters}])\)", text)
    return found[-1] if found else None


def _label_letter(label: Any, choices: Any, letters: str) -> str | None:
    if isinstance(label, int) and not isinstance(label, bool):
        return letters[label] if 0 <= label < len(letters) else None
    text = str(label).strip()
    m = re.fullmatch(rf"\(?([{letters}{letters.lower()}])\)?", text)
    if m:
        return m.group(1).upper()
    return _match_option_text(text, choices, letters)


def _options(choices: Any, letters: str) -> list[tuple[str, str]]:
    if isinstance(choices, dict):
        return [(str(k).upper(), str(v)) for k, v in choices.items()]
    if isinstance(choices, list | tuple):
        return list(zip(letters, (str(c) for c in choices)))
    return []


def _norm(s: str) -> str:
    s = s.lower().translate(str.maketrans("", "", string.punctuation.replace("-", "").replace(".", "")))
    return " ".join(s.split()).strip(" .")


def _match_option_text(text: str, choices: Any, letters: str, contained: bool = False) -> str | None:
    """The unique option whose text equals ``text`` (or, with ``contained``, appears in it)."""
    target = _norm(text)
    if not target:
        return None
    options = [(letter, _norm(option)) for letter, option in _options(choices, letters)]
    hits = [letter for letter, option in options if option == target]
    if not hits and contained:
        hits = [
            letter for letter, option in options if option and re.search(rf"\b{re.escape(option)}\b", target)
        ]
    return hits[0] if len(hits) == 1 else None


def _score(response: str, label: Any, metadata: dict | None, letters: str) -> RewardResult:
    choices = (metadata or {}).get("choices")
    picked = extract_choice(response, letters)
    how = "letter" if picked else None
    if picked is None and choices:
        from relax_rewards.math import extract_answer

        answer, _ = extract_answer(response)
        tail = (response or "").strip().splitlines()[-1:] if response else []
        for candidate in (answer, *tail):
            if candidate and (picked := _match_option_text(candidate, choices, letters, contained=True)):
                how = "option_text"
                break
    gold = _label_letter(label, choices, letters)
    correct = picked is not None and picked == gold
    return RewardResult(
        1.0 if correct else 0.0,
        {"extracted": picked, "format_ok": picked is not None, "format": how, "gold": gold},
    )


@register("multiple_choice", "mcq")
def multiple_choice_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    """1.0 if the chosen letter (A–J) is the label's, else 0.0.

    >>> multiple_choice_reward("The answer is C.", "C").score
    1.0
    >>> multiple_choice_reward("It must be Paris.", "B", {"choices": ["Rome", "Paris"]}).score
    1.0
    """
    return _score(response, label, metadata, "ABCDEFGHIJ")


@register("gpqa")
def gpqa_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    """GPQA: four options A–D, same extraction as ``multiple_choice``.

    >>> gpqa_reward("Answer: (d)", "D").score
    1.0
    """
    return _score(response, label, metadata, "ABCD")
