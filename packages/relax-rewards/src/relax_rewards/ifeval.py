r"""``ifeval``: verifiable instruction-following constraints (IFEval / IFBench style).

Why checkers and not a judge: "answer in under 100 words, all lowercase, end with 'Is there
anything else?'" can be verified exactly and cheaply, which makes a clean RL signal. Each
constraint kind is a plain function ``check(response, **params) -> bool`` registered in
:data:`CONSTRAINTS`; a sample lists its constraints as

    [{"type": "max_words", "n": 100}, {"type": "lowercase"}, {"type": "end_with", "phrase": "..."}]

in the label (or ``metadata["instructions"]``). IFEval's ids (``length_constraints:number_words``
with ``relation`` / ``num_words``, ...) are accepted through :data:`IFEVAL_ALIASES`. Score = the
fraction of constraints met (``metadata["strict"] = True``: 1.0 only if all are). A ``</think>``
block is removed first: only the visible answer is checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from relax_rewards.registry import register
from relax_rewards.types import RewardResult

__all__ = ["CONSTRAINTS", "IFEVAL_ALIASES", "check_constraint", "constraint", "ifeval_reward"]

CONSTRAINTS: dict[str, Callable[..., bool]] = {}
"""Constraint kind → checker ``(response, **params) -> bool``."""


def constraint(name: str) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        CONSTRAINTS[name] = fn
        return fn

    return decorator


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+(?:['’-]\w+)*\b", text)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if re.search(r"\w", s)]


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n|^\s*\*\*\*\s*$", text.strip(), flags=re.MULTILINE) if p.strip()]


def _relation(value: int, n: int, relation: str) -> bool:
    return {"at least": value >= n, "at most": value <= n, "less than": value < n, "exactly": value == n}[
        relation
    ]


@constraint("min_words")
def min_words(response: str, n: int) -> bool:
    return len(_words(response)) >= n


@constraint("max_words")
def max_words(response: str, n: int) -> bool:
    return len(_words(response)) <= n


@constraint("num_sentences")
def num_sentences(response: str, n: int, relation: str = "at least") -> bool:
    return _relation(len(_sentences(response)), n, relation)


@constraint("num_paragraphs")
def num_paragraphs(response: str, n: int) -> bool:
    """Paragraphs separated by blank lines or a ``***`` line."""
    return len(_paragraphs(response)) == n


@constraint("include_keywords")
def include_keywords(response: str, keywords: list[str]) -> bool:
    return all(re.search(rf"(?i)\b{re.escape(k)}\b", response) for k in keywords)


@constraint("keyword_frequency")
def keyword_frequency(response: str, keyword: str, n: int, relation: str = "at least") -> bool:
    return _relation(len(re.findall(rf"(?i)\b{re.escape(keyword)}\b", response)), n, relation)


@constraint("forbidden_words")
def forbidden_words(response: str, words: list[str]) -> bool:
    return not any(re.search(rf"(?i)\b{re.escape(w)}\b", response) for w in words)


@constraint("letter_frequency")
def letter_frequency(response: str, letter: str, n: int, relation: str = "at least") -> bool:
    return _relation(response.lower().count(letter.lower()), n, relation)


@constraint("json_format")
def json_format(response: str) -> bool:
    """The whole response is JSON (a ```json fence around it is allowed)."""
    text = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", response.strip())
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@constraint("lowercase")
def lowercase(response: str) -> bool:
    return response == response.lower() and any(c.isalpha() for c in response)


@constraint("uppercase")
def uppercase(response: str) -> bool:
    return response == response.upper() and any(c.isalpha() for c in response)


@constraint("capital_word_frequency")
def capital_word_frequency(response: str, n: int, relation: str = "at least") -> bool:
    return _relation(sum(1 for w in _words(response) if w.isupper() and len(w) > 1), n, relation)


@constraint("start_with")
def start_with(response: str, phrase: str) -> bool:
    return response.strip().lower().startswith(phrase.strip().lower())


@constraint("end_with")
def end_with(response: str, phrase: str) -> bool:
    return response.strip().lower().endswith(phrase.strip().lower())


@constraint("bullet_count")
def bullet_count(response: str, n: int) -> bool:
    """Exactly ``n`` markdown bullets (``* `` or ``- `` at a line start)."""
    return len(re.findall(r"^\s*[*-]\s+\S", response, re.MULTILINE)) == n


@constraint("numbered_list_count")
def numbered_list_count(response: str, n: int) -> bool:
    return len(re.findall(r"^\s*\d+[.)]\s+\S", response, re.MULTILINE)) == n


@constraint("title")
def title(response: str) -> bool:
    """A title in double angular brackets, ``<<like this>>``."""
    return bool(re.search(r"<<[^\n]+>>", response))


@constraint("placeholders")
def placeholders(response: str, n: int) -> bool:
    """At least ``n`` square-bracket placeholders such as ``[address]``."""
    return len(re.findall(r"\[[^\[\]\n]+\]", response)) >= n


@constraint("highlighted_sections")
def highlighted_sections(response: str, n: int) -> bool:
    """At least ``n`` markdown highlights ``*like this*``."""
    return len([h for h in re.findall(r"\*[^\n*]+\*", response) if h.strip("* ")]) >= n


@constraint("sections")
def sections(response: str, n: int, splitter: str = "Section") -> bool:
    return len(re.findall(rf"(?m)^\s*{re.escape(splitter)}\s+\d+", response)) == n


@constraint("postscript")
def postscript(response: str, marker: str = "P.S.") -> bool:
    return bool(re.search(rf"(?im)^\s*{re.escape(marker)}", response))


@constraint("no_commas")
def no_commas(response: str) -> bool:
    return "," not in response


@constraint("quotation")
def quotation(response: str) -> bool:
    """The whole response is wrapped in double quotes."""
    r = response.strip()
    return len(r) > 1 and r[0] == '"' and r[-1] == '"'


@constraint("repeat_prompt")
def repeat_prompt(response: str, prompt: str) -> bool:
    return response.strip().lower().startswith(prompt.strip().lower())


@constraint("two_responses")
def two_responses(response: str) -> bool:
    parts = response.split("******")
    return len(parts) == 2 and all(p.strip() for p in parts) and parts[0].strip() != parts[1].strip()


IFEVAL_ALIASES: dict[str, tuple[str, Callable[[dict], dict]]] = {
    "length_constraints:number_words": (
        "__words",
        lambda k: {"n": k["num_words"], "relation": k.get("relation", "at least")},
    ),
    "length_constraints:number_sentences": (
        "num_sentences",
        lambda k: {"n": k["num_sentences"], "relation": k.get("relation", "at least")},
    ),
    "length_constraints:number_paragraphs": ("num_paragraphs", lambda k: {"n": k["num_paragraphs"]}),
    "keywords:existence": ("include_keywords", lambda k: {"keywords": k["keywords"]}),
    "keywords:frequency": (
        "keyword_frequency",
        lambda k: {"keyword": k["keyword"], "n": k["frequency"], "relation": k.get("relation", "at least")},
    ),
    "keywords:forbidden_words": ("forbidden_words", lambda k: {"words": k["forbidden_words"]}),
    "keywords:letter_frequency": (
        "letter_frequency",
        lambda k: {
            "letter": k["letter"],
            "n": k["let_frequency"],
            "relation": k.get("let_relation", "at least"),
        },
    ),
    "detectable_format:json_format": ("json_format", lambda k: {}),
    "detectable_format:number_bullet_lists": ("bullet_count", lambda k: {"n": k["num_bullets"]}),
    "detectable_format:title": ("title", lambda k: {}),
    "detectable_format:number_highlighted_sections": (
        "highlighted_sections",
        lambda k: {"n": k["num_highlights"]},
    ),
    "detectable_format:multiple_sections": (
        "sections",
        lambda k: {"n": k["num_sections"], "splitter": k.get("section_spliter", "Section")},
    ),
    "detectable_content:number_placeholders": ("placeholders", lambda k: {"n": k["num_placeholders"]}),
    "detectable_content:postscript": ("postscript", lambda k: {"marker": k.get("postscript_marker", "P.S.")}),
    "change_case:english_lowercase": ("lowercase", lambda k: {}),
    "change_case:english_capital": ("uppercase", lambda k: {}),
    "change_case:capital_word_frequency": (
        "capital_word_frequency",
        lambda k: {"n": k["capital_frequency"], "relation": k.get("capital_relation", "at least")},
    ),
    "startend:end_checker": ("end_with", lambda k: {"phrase": k["end_phrase"]}),
    "startend:quotation": ("quotation", lambda k: {}),
    "punctuation:no_comma": ("no_commas", lambda k: {}),
    "combination:repeat_prompt": ("repeat_prompt", lambda k: {"prompt": k["prompt_to_repeat"]}),
    "combination:two_responses": ("two_responses", lambda k: {}),
}


def check_constraint(response: str, spec: dict) -> bool:
    """Check one constraint ``{"type": kind, **params}``; unknown kinds raise ``KeyError``.

    >>> check_constraint("hello world", {"type": "max_words", "n": 3})
    True
    >>> check_constraint("Hi", {"type": "length_constraints:number_words", "num_words": 2, "relation": "less than"})
    True
    """
    spec = dict(spec)
    kind = spec.pop("type", None) or spec.pop("id", None)
    if kind in IFEVAL_ALIASES:
        kind, convert = IFEVAL_ALIASES[kind]
        spec = convert(spec)
        if kind == "__words":
            return _relation(len(_words(response)), spec["n"], spec["relation"])
    if kind not in CONSTRAINTS:
        raise KeyError(f"unknown ifeval constraint {kind!r}; known: {', '.join(sorted(CONSTRAINTS))}")
    return bool(CONSTRAINTS[kind](response, **spec))


@register("ifeval", "ifbench")
def ifeval_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    """Fraction of the listed constraints the response satisfies.

    >>> ifeval_reward("all lowercase, short.", [{"type": "lowercase"}, {"type": "max_words", "n": 2}]).score
    0.5
    """
    meta = metadata or {}
    specs = meta.get("instructions") or label
    if isinstance(specs, str):
        specs = json.loads(specs)
    if isinstance(specs, dict):
        specs = [specs]
    if not specs:
        raise ValueError("ifeval needs a list of constraints in the label or metadata['instructions']")
    text = (response or "").rsplit("</think>", 1)[-1].strip()
    results = {f"{i}:{s.get('type') or s.get('id')}": check_constraint(text, s) for i, s in enumerate(specs)}
    met = sum(results.values())
    score = float(met == len(results)) if meta.get("strict") else met / len(results)
    return RewardResult(score, {"constraints": results, "met": met, "total": len(results)})
