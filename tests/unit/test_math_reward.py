"""The built-in verifiable reward for math (reward/rewards.py math_answer): which answer of a response counts, and
when it equals the reference answer."""

from __future__ import annotations

import pytest

from reinforce.reward.rewards import final_answer, math_answer, same_answer


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("The answer is 42.", "42"),  # a sentence's full stop is not a decimal point
        ("so \\boxed{12} and then 7", "12"),  # a boxed answer wins over a later number
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last boxed one, nested braces kept
        ("x = -3.5", "-3.5"),
        ("1,234 apples", "1,234"),
        ("12, 13, and 14,", "14"),
        ("no number", None),
    ],
)
def test_the_final_answer_is_the_last_boxed_one_else_the_last_number(response: str, answer: str | None) -> None:
    assert final_answer(response) == answer


def test_answers_are_compared_as_numbers_when_both_are() -> None:
    assert same_answer("1,000", "1000") and same_answer("0.5", ".5") and same_answer("-3", "-3.0")
    assert not same_answer("41", "42")
    assert same_answer(" x+1 ", "x+1") and not same_answer("x+1", "1+x")  # otherwise as text


def test_math_answer_scores_one_per_match_and_refuses_a_prompt_without_an_answer() -> None:
    assert math_answer(["p"] * 3, ["It is 42.", "\\boxed{1000}", "41"], ["42", "1,000", "42"]) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="1 prompts without a reference answer"):
        math_answer(["p", "q"], ["1", "2"], ["1", " "])
