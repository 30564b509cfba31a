"""Labelled cases for the math rewards: extraction, equivalence, variants and adversarial inputs."""

import time

import pytest

from relax_rewards.math import (
    dapo_reward,
    deepscaler_reward,
    extract_answer,
    extract_boxed,
    extract_last_number,
    math_reward,
)
from relax_rewards.math_equiv import is_equiv, normalize, parse_number, symbolic_equal
from relax_rewards.types import RewardResult

# --- extraction -----------------------------------------------------------------------------

EXTRACTION_CASES = [
    (r"The answer is \boxed{42}.", "42", "boxed"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", "boxed"),
    (r"nested \boxed{\sqrt{\frac{a}{b}}} end", r"\sqrt{\frac{a}{b}}", "boxed"),
    (r"first \boxed{1} then \boxed{2}", "2", "boxed"),
    (r"\boxed{3} and a broken \boxed{4", "3", "boxed"),
    (r"\fbox{9}", "9", "boxed"),
    (r"\boxed 5", "5", "boxed"),
    (r"\boxed{}", "", "boxed"),
    (r"$\boxed{\{1, 2\}}$", r"\{1, 2\}", "boxed"),
    ("Work.\nAnswer: 17", "17", "answer_line"),
    ("Work.\nanswer : -3.5", "-3.5", "answer_line"),
    ("Answer: 1\nmore\nAnswer: 2", "2", "answer_line"),
    ("**Answer:** 12", "12", "answer_line"),
    ("So the final answer: 8.", "8", "answer_line"),
    ("The answer is 6, not answer: 5\nok", "5", "answer_line"),
    ("Final Answer: $x^2$.", "x^2", "answer_line"),
    (r"Answer: \boxed{7}", "7", "boxed"),
    ("so 3 + 4 = 7", "7", "last_number"),
    ("the total is 1,234,567 dollars", "1,234,567", "last_number"),
    ("about 2.5e-3 m", "2.5e-3", "last_number"),
    ("ratio 3/4", "3/4", "last_number"),
    ("temperature -12 today", "-12", "last_number"),
    ("no digits here", None, None),
    ("", None, None),
]


@pytest.mark.parametrize("text,expected,how", EXTRACTION_CASES)
def test_extract_answer(text, expected, how):
    assert extract_answer(text) == (expected, how)


def test_extract_boxed_none_and_last_number_none():
    assert extract_boxed("nothing") is None
    assert extract_last_number("x plus y") is None


# --- equivalence ------------------------------------------------------------------------------

EQUAL = [
    ("42", "42"),
    ("42", 42),
    (" 42 ", "42.0"),
    ("-7", "-7"),
    ("-0.5", r"-\frac{1}{2}"),
    ("0.5", r"\frac{1}{2}"),
    (r"\dfrac{3}{4}", "0.75"),
    (r"\tfrac{3}{4}", "3/4"),
    (r"\frac12", "0.5"),
    ("6/8", "3/4"),
    ("1,000", "1000"),
    ("1{,}000", "1000"),
    ("1,234,567.5", "1234567.5"),
    (r"50\%", "50"),
    ("25%", "0.25"),
    ("1e3", "1000"),
    ("2.5E-2", "0.025"),
    (r"3\times 10^{4}", "30000"),
    (r"5 \text{ cm}", "5"),
    ("12 meters", "12"),
    (r"90^\circ", "90"),
    (r"\$15", "15"),
    (r"\text{(B)}", "(B)"),
    ("x = 3", "3"),
    (r"\left(1, 2\right)", "(1,2)"),
    ("(1,2)", "(1, 2)"),
    (r"\{3, 1, 2\}", r"\{1, 2, 3\}"),
    ("2, 3", "3, 2"),
    (r"2\sqrt{2}", r"\sqrt{8}"),
    (r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}"),
    (r"\frac{\pi}{2}", r"\pi/2"),
    ("(x+1)^2", "x^2 + 2x + 1"),
    ("2(x+1)", "2x+2"),
    (r"\sqrt[3]{27}", "3"),
    ("10^{20}", "100000000000000000000"),
    ("5!", "120"),
    ("0.3333333", "1/3"),
    ("e^{0}", "1"),
    (r"\ln(e)", "1"),
    ("3.1415927", r"\pi"),
    (r"3\sqrt{2}", r"\sqrt{18}"),
    (r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2"),
    ("(A)", "A"),
]

NOT_EQUAL = [
    ("42", "43"),
    ("-7", "7"),
    ("0.5", "0.6"),
    (r"\frac{1}{3}", "0.33"),
    ("1,000", "100"),
    ("(1,2)", "(2,1)"),
    ("(1,2)", "[1,2]"),
    ("1, 2", "1, 2, 3"),
    (r"2\sqrt{2}", r"\sqrt{2}"),
    ("x^2", "x^3"),
    ("10^{20}", "100000000000000000001"),
    ("100000000000000000000", "100000000000000000001"),
    ("", "0"),
    ("A", "B"),
    ("x", "y"),
    ("3.14", r"\pi"),
    (r"\sqrt{2}", r"\frac{99}{70}"),
    (None, "1"),
]


@pytest.mark.parametrize("a,b", EQUAL)
def test_equal_pairs(a, b):
    assert is_equiv(a, b), (a, b, normalize(a), normalize(str(b)))


@pytest.mark.parametrize("a,b", NOT_EQUAL)
def test_unequal_pairs(a, b):
    assert not is_equiv(a, b)


def test_normalize_examples():
    assert normalize(r"\$1{,}000 \text{ dollars}") == "1000"
    assert normalize(r"\left( \dfrac12, x \right)") == r"(\frac{1}{2},x)"
    assert normalize("x = 5") == "5"


def test_parse_number_exactness():
    assert parse_number("7") == (7, True)
    assert parse_number("0.5")[1] is False
    assert parse_number("abc") is None
    assert parse_number(r"\frac{1}{0}") is None


# --- adversarial --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a,b",
    [
        ("2^{2^{2^{100}}}", "1"),
        ("9^{9^{9^{9}}}", "9^{9^{9^{9}}}0"),
        ("100000!", "1"),
        ("(x+1)^{100000}", "x"),
        ("1" + "0" * 5000, "1" + "0" * 4999),
        ("1e999999", "1"),
        (r"\frac{1}{0}", "1"),
        ("__import__('os').system('echo pwned')", "0"),
        ("().__class__", "0"),
        ("x" * 5000, "x"),
    ],
)
def test_adversarial_inputs_are_fast_and_false(a, b):
    start = time.monotonic()
    assert not is_equiv(a, b)
    assert time.monotonic() - start < 5.0


def test_huge_equal_integers_compare_exactly():
    big = "9" * 300
    assert is_equiv(big, big + ".0")
    assert not is_equiv(big, "9" * 299 + "8")


def test_symbolic_refuses_unknown_commands():
    assert not symbolic_equal(r"\unknown{1}", "1")
    assert symbolic_equal("x y", "y x")


# --- rewards --------------------------------------------------------------------------------------


def test_math_reward_correct_and_details():
    r = math_reward(r"Thus $\boxed{\dfrac{1}{2}}$.", "0.5")
    assert isinstance(r, RewardResult)
    assert r.score == 1.0 and r.details["extracted"] == r"\dfrac{1}{2}" and r.details["format_ok"]
    assert r.failure is None


def test_math_reward_wrong_and_unformatted():
    r = math_reward("I guess 7", "8")
    assert r.score == 0.0 and r.details == {
        "extracted": "7",
        "format_ok": False,
        "format": "last_number",
        "correct": False,
    }


def test_math_reward_lenient_last_number_counts():
    assert math_reward("so the total is 1,000", 1000).score == 1.0


def test_math_reward_last_box_wins():
    assert math_reward(r"\boxed{3} wait, \boxed{4}", "4").score == 1.0
    assert math_reward(r"\boxed{3} wait, \boxed{4}", "3").score == 0.0


def test_math_reward_empty_box_and_empty_response():
    assert math_reward(r"\boxed{}", "0").score == 0.0
    assert math_reward("", "0").details["extracted"] is None


def test_math_reward_label_forms():
    assert math_reward(r"\boxed{5}", r"The solution gives \boxed{5}").score == 1.0
    assert math_reward(r"\boxed{5}", ["4", "5"]).score == 1.0
    assert math_reward(r"\boxed{5}", 5.0).score == 1.0


def test_math_reward_text_around():
    text = (
        "Let me think step by step.\nFirst 2+2=4, then times 3.\nTherefore the answer is $\\boxed{12}$ units."
    )
    assert math_reward(text, "12").score == 1.0


def test_math_reward_huge_response_is_bounded():
    text = "1 " * 200_000 + r"\boxed{2}"
    start = time.monotonic()
    assert math_reward(text, "2").score == 1.0
    assert time.monotonic() - start < 5.0


def test_deepscaler_requires_format():
    assert deepscaler_reward(r"\boxed{4}", "4").score == 1.0
    assert deepscaler_reward("Answer: 4", "4").score == 1.0
    assert deepscaler_reward("it is 4", "4").score == 0.0
    assert deepscaler_reward(r"\boxed{5}", "4").score == 0.0


def test_deepscaler_think_handling():
    assert deepscaler_reward(r"<think>\boxed{1}</think>so \boxed{4}", "4").score == 1.0
    assert deepscaler_reward(r"<think>\boxed{4}</think>no final answer", "4").score == 0.0
    assert deepscaler_reward(r"<think>still going \boxed{4}", "4").score == 0.0


def test_dapo_scores():
    assert dapo_reward("blah\nAnswer: 34", "34").score == 1.0
    assert dapo_reward("blah\nAnswer: 35", "34").score == -1.0
    r = dapo_reward(r"blah \boxed{34}", "34")
    assert r.score == -1.0 and r.details["format_ok"] is False
    assert dapo_reward("Answer: 1/2", r"\frac{1}{2}").score == 1.0
