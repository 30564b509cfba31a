"""``f1``, the format helpers and ``openr1mm``."""

import pytest

from relax_rewards.f1 import f1_reward, normalize_answer, token_f1
from relax_rewards.format import (
    extract_tag,
    format_reward,
    has_think_answer_format,
    openr1mm_reward,
    think_format_reward,
)


def test_token_f1():
    assert token_f1("The Eiffel Tower", "eiffel tower!") == 1.0
    assert token_f1("red car", "blue car") == pytest.approx(0.5)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0
    assert normalize_answer("An  apple, a day.") == "apple day"


def test_f1_reward_answer_sources():
    assert f1_reward("<think>hmm</think><answer>Paris</answer>", "paris").score == 1.0
    assert f1_reward("blah\nAnswer: New York City", "New York").score == pytest.approx(0.8)
    assert f1_reward("London", ["Paris", "London"]).score == 1.0


def test_format_helpers():
    assert has_think_answer_format("<think>a</think>\n<answer>b</answer>\n")
    assert not has_think_answer_format("<think>a</think><answer>b</answer><answer>c</answer>")
    assert not has_think_answer_format("<answer>b</answer><think>a</think>")
    assert format_reward("<think>a</think><answer>b</answer>", None) == 1.0
    assert think_format_reward("</think><think>", None) == 0.0
    assert extract_tag("<answer>1</answer><answer> 2 </answer>", "answer") == "2"


@pytest.mark.parametrize(
    "response,label,score",
    [
        ("<think>2+2</think><answer>4</answer>", "4", 2.0),
        (r"<think>x</think><answer>\boxed{\frac12}</answer>", "0.5", 2.0),
        ("<think>x</think><answer>a dog</answer>", "Dog", 2.0),
        ("<think>x</think><answer>5</answer>", "4", 1.0),
        ("<answer>4</answer>", "4", 1.0),
        ("4", "4", 0.0),
    ],
)
def test_openr1mm(response, label, score):
    assert openr1mm_reward(response, label).score == score
