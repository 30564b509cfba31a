"""``ifeval``: every constraint kind, satisfied and violated, plus IFEval ids and scoring."""

import pytest

from relax_rewards.ifeval import CONSTRAINTS, check_constraint, ifeval_reward

KINDS = [  # (spec, passing response, failing response)
    ({"type": "min_words", "n": 3}, "one two three", "one two"),
    ({"type": "max_words", "n": 2}, "one two", "one two three"),
    ({"type": "num_sentences", "n": 2, "relation": "exactly"}, "Hi. Bye!", "Hi."),
    ({"type": "num_paragraphs", "n": 2}, "a\n\nb", "a\nb"),
    ({"type": "include_keywords", "keywords": ["cat", "dog"]}, "A cat and a dog.", "A cat."),
    ({"type": "keyword_frequency", "keyword": "ok", "n": 2}, "ok, ok", "ok"),
    ({"type": "forbidden_words", "words": ["very"]}, "quite good", "very good"),
    ({"type": "letter_frequency", "letter": "z", "n": 2}, "jazz", "jaz"),
    ({"type": "json_format"}, '```json\n{"a": 1}\n```', "{a: 1}"),
    ({"type": "lowercase"}, "all lower", "Not lower"),
    ({"type": "uppercase"}, "ALL UPPER", "Not upper"),
    ({"type": "capital_word_frequency", "n": 2}, "THIS IS loud", "THIS is not"),
    ({"type": "start_with", "phrase": "Dear Sir"}, "dear sir, hello", "Hello"),
    ({"type": "end_with", "phrase": "Is there anything else?"}, "Done. Is there anything else?", "Done."),
    ({"type": "bullet_count", "n": 2}, "* a\n* b", "* a\n* b\n* c"),
    ({"type": "numbered_list_count", "n": 2}, "1. a\n2. b", "1. a"),
    ({"type": "title"}, "<<My Title>>\ntext", "My Title"),
    ({"type": "placeholders", "n": 2}, "At [name] in [city]", "At [name]"),
    ({"type": "highlighted_sections", "n": 2}, "*one* and *two*", "*one*"),
    ({"type": "sections", "n": 2}, "Section 1\na\nSection 2\nb", "Section 1\na"),
    ({"type": "postscript"}, "Hi.\nP.S. bye", "Hi."),
    ({"type": "no_commas"}, "no commas here", "a, b"),
    ({"type": "quotation"}, '"quoted"', "not quoted"),
    ({"type": "repeat_prompt", "prompt": "Say hi"}, "Say hi. Hi!", "Hi!"),
    ({"type": "two_responses"}, "one******two", "one"),
]


def test_at_least_fifteen_kinds():
    assert len(CONSTRAINTS) >= 15
    assert {spec["type"] for spec, _, _ in KINDS} == set(CONSTRAINTS)


@pytest.mark.parametrize("spec,good,bad", KINDS, ids=[s["type"] for s, _, _ in KINDS])
def test_constraint(spec, good, bad):
    assert check_constraint(good, spec) is True
    assert check_constraint(bad, spec) is False


def test_ifeval_ids_accepted():
    spec = {"id": "length_constraints:number_words", "num_words": 3, "relation": "at least"}
    assert check_constraint("one two three", spec)
    assert check_constraint("a, b", {"id": "punctuation:no_comma"}) is False
    assert check_constraint(
        "x\nP.P.S y", {"id": "detectable_content:postscript", "postscript_marker": "P.P.S"}
    )


def test_score_fraction_strict_and_think_removed():
    specs = [{"type": "lowercase"}, {"type": "max_words", "n": 2}, {"type": "no_commas"}]
    r = ifeval_reward("<think>IGNORED, Words</think>hello there friend", specs)
    assert r.score == pytest.approx(2 / 3) and r.details["met"] == 2
    assert ifeval_reward("hello there friend", specs, {"strict": True}).score == 0.0
    assert ifeval_reward("hi", None, {"instructions": specs}).score == 1.0


def test_unknown_kind_and_missing_specs():
    with pytest.raises(KeyError, match="unknown ifeval constraint"):
        check_constraint("x", {"type": "haiku"})
    with pytest.raises(ValueError, match="list of constraints"):
        ifeval_reward("x", None)
