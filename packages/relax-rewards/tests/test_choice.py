"""``multiple_choice`` / ``gpqa``: letters written many ways, and the option-text fallback."""

import pytest

from relax_rewards.choice import extract_choice, gpqa_reward, multiple_choice_reward

LETTERS = [
    (r"So the answer is \boxed{C}.", "C"),
    (r"$\boxed{\text{(B)}}$", "B"),
    ("Answer: D", "D"),
    ("**Answer:** (a)", "A"),
    ("The correct answer is: **C**", "C"),
    ("The answer is option D.", "D"),
    ("I choose B because...", "B"),
    ("Option C is correct.", "C"),
    ("Reasoning...\n\n**E**", "E"),
    ("Reasoning...\n(B) 42", "B"),
    ("Reasoning...\nB) 42", "B"),
    ("<think>maybe A</think>Answer: C", "C"),
    ("Both (A) and (D) seem plausible, but it is (D)", "D"),
    ("<think>maybe A</think><answer>C</answer>", "C"),
    ("<answer> (d) </answer>", "D"),
    ("I think <answer>B. Paris</answer>", "B"),
    ("<answer>The answer is A</answer>", "A"),
    ("A? <answer>I am not sure</answer>", None),  # only the tag counts once there is one
    ("I have no idea", None),
]


@pytest.mark.parametrize("text,letter", LETTERS)
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


def test_label_forms():
    assert multiple_choice_reward("Answer: C", 2).score == 1.0  # 0-based index
    assert multiple_choice_reward("Answer: C", "(c)").score == 1.0
    choices = ["red", "green", "blue"]
    assert multiple_choice_reward("Answer: B", "green", {"choices": choices}).score == 1.0
    assert multiple_choice_reward("Answer: A", "green", {"choices": choices}).score == 0.0


def test_option_text_fallback():
    meta = {"choices": {"A": "Rome", "B": "Paris", "C": "Madrid"}}
    r = multiple_choice_reward("The capital is Paris.", "B", meta)
    assert r.score == 1.0 and r.details["format"] == "option_text"
    assert multiple_choice_reward("Rome or Paris?", "B", meta).score == 0.0  # ambiguous: no pick


def test_gpqa_only_abcd():
    assert gpqa_reward("Answer: D", "D").score == 1.0
    assert gpqa_reward("Answer: E", "D").details["extracted"] is None
