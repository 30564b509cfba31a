"""``f1``: token-level F1 between the response's answer and the label (SQuAD normalisation).

Why F1 and not exact match: for short free-text answers ("the Eiffel Tower" vs "Eiffel Tower")
exact match is too harsh, and partial overlap is a useful gradient. Normalisation follows SQuAD:
lower-case, drop punctuation and the articles a/an/the, collapse whitespace. The answer is the
``<answer>`` block or ``Answer:`` line when present, else the text after ``</think>``, else the
whole response. A list label scores the best match.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from relax_rewards.registry import register
from relax_rewards.types import RewardResult

__all__ = ["f1_reward", "normalize_answer", "token_f1"]

_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation.

    >>> normalize_answer("The  Eiffel-Tower!")
    'eiffeltower'
    """
    text = str(text).lower().translate(_PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, truth: str) -> float:
    """Harmonic mean of token precision and recall after normalisation.

    >>> round(token_f1("Eiffel Tower in Paris", "the Eiffel Tower"), 3)
    0.667
    """
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def _answer_text(response: str) -> str:
    m = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    if m:
        return m[-1]
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    line = re.findall(r"(?i)\banswer\s*[:：]\s*([^\n]*)", response)
    return line[-1] if line else response


@register("f1")
def f1_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    """Best token F1 of the response's answer against the label (or any label in a list).

    >>> f1_reward("Answer: Eiffel Tower", ["Big Ben", "the Eiffel Tower"]).score
    1.0
    """
    answer = _answer_text(response or "")
    labels = label if isinstance(label, list | tuple) else [label]
    score = max((token_f1(answer, str(gold)) for gold in labels if gold is not None), default=0.0)
    return RewardResult(score, {"extracted": answer.strip()})
