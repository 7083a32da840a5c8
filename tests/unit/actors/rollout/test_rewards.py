"""Reward functions: built-ins on hand-checked cases, the length penalty, lookup, and failure translation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from offpolicy.actors.errors import RewardError
from offpolicy.actors.rollout.rewards import (
    exact_match,
    final_answer,
    last_boxed,
    length_penalty,
    math_answer,
    parse_number,
    resolve_reward,
    score,
    target_token_share,
)


def test_exact_match_strips_whitespace_only():
    assert exact_match("  Paris\n", "Paris", {}) == 1.0
    assert exact_match("paris", "Paris", {}) == 0.0
    assert exact_match("", "", {}) == 1.0


def test_exact_match_without_answer_is_a_reward_error():
    with pytest.raises(RewardError, match="no `answer`"):
        exact_match("x", None, {})


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("-3.5", -3.5),
        ("1,000", 1000.0),
        ("3/4", 0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac{1}{8}", 0.125),
        ("-\\frac{1}{2}", -0.5),
        ("$5$", 5.0),
        ("50%", 50.0),
        (".5", 0.5),
        ("7.", 7.0),
        ("1/0", None),
        ("x", None),
        ("", None),
        ("1,2", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_last_boxed_handles_nesting_and_unclosed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{3") is None
    assert last_boxed("no box") is None


def test_final_answer_prefers_boxed_then_last_number():
    assert final_answer("I think 3, then \\boxed{7} and 9") == 7.0
    assert final_answer("first 12 then 1,234 apples") == 1234.0
    assert final_answer("1,2,3") == 3.0
    assert final_answer("nothing here") is None


def test_math_answer():
    assert math_answer("so the answer is \\boxed{0.5}", "1/2", {}) == 1.0
    assert math_answer("The total is 1,000.", "1000", {}) == 1.0
    assert math_answer("The total is 999", "1000", {}) == 0.0
    assert math_answer("no digits", "1", {}) == 0.0
    assert math_answer("\\boxed{x+1}", "1", {}) == 0.0  # a box without a number is wrong, not an error
    with pytest.raises(RewardError, match="not a number"):
        math_answer("1", "one", {})
    with pytest.raises(RewardError):
        math_answer("1", None, {})


def test_target_token_share():
    assert target_token_share("aaba", "a", {}) == 0.75
    assert target_token_share("", "a", {}) == 0.0
    assert target_token_share("abab", None, {"target": "b"}) == 0.5
    assert target_token_share("abab", "ab", {}) == 1.0
    with pytest.raises(RewardError, match="no target"):
        target_token_share("a", None, {})


def test_length_penalty_is_linear_then_capped():
    fn = length_penalty(target_token_share, coef=0.5, max_chars=4)
    assert fn("aa", "a", {}) == pytest.approx(1.0 - 0.5 * 2 / 4)
    assert fn("aaaaaaaa", "a", {}) == pytest.approx(1.0 - 0.5)


def test_resolve_reward_by_name_dotted_path_and_wrapper():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("offpolicy.actors.rollout.rewards.math_answer") is math_answer
    wrapped = resolve_reward("target_token_share", length_coef=1.0, length_max_chars=2)
    assert wrapped("ab", "a", {}) == pytest.approx(0.5 - 1.0)
    with pytest.raises(ValueError, match="unknown reward"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("offpolicy.actors.rollout.rewards.nope")


def test_score_translates_every_failure():
    def boom(c, a, m):
        raise ZeroDivisionError("x")

    with pytest.raises(RewardError, match="ZeroDivisionError"):
        score(boom, "", None, {})
    for bad in (math.nan, math.inf, "1", None, True):
        with pytest.raises(RewardError, match="not a finite number"):
            score(lambda c, a, m, v=bad: v, "", None, {})
    assert score(lambda c, a, m: np.float32(0.25), "", None, {}) == 0.25
    assert score(lambda c, a, m: 2, "", None, {}) == 2.0


# --- math answers as users write them

GSM8K_SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nSo 48+24 = <<48+24=72>>72.\n#### 72"


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        # GSM8K: `#### 72` in the reference and in the completion
        ("She sold 24 in May, 72 in all.", GSM8K_SOLUTION, 1.0),
        ("24 in May, so\n#### 72", GSM8K_SOLUTION, 1.0),
        ("24 in May, so\n#### 72\nI hope that helps, 5 stars", "72", 1.0),
        ("#### 24", GSM8K_SOLUTION, 0.0),
        ("#### 1,234", "1234", 1.0),
        ("The answer is 1,234,567.", "#### 1234567", 1.0),
        # \boxed{...}, nested braces
        ("so \\boxed{\\frac{3}{4}}.", "0.75", 1.0),
        ("\\boxed{\\dfrac{1}{8}}", "\\frac{1}{8}", 1.0),
        ("\\boxed{\\tfrac{1}{8}}", "0.125", 1.0),
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
        ("first \\boxed{3} then \\boxed{{4}}", "4", 1.0),  # the last box; math-verify reads `{4}`
        ("\\boxed{\\frac{6}{\\left(2\\right)}}", "3", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),  # math-verify, symbolically
        ("\\boxed{1+x}", "x+1", 1.0),
        ("\\boxed{(1,2]}", "(1, 2]", 1.0),
        ("\\boxed{x+2}", "x+1", 0.0),
        # separators, dollars, units, trailing periods, percent
        ("It costs $1,234.", "1234", 1.0),
        ("\\boxed{\\$18}", "18", 1.0),
        ("\\boxed{18 \\text{ dollars}}", "$18", 1.0),
        ("\\boxed{5\\text{ cm}}", "5", 1.0),
        ("#### 72 clips.", "72", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{2x}", "2", 0.0),  # a letter glued to a number is not a unit
        ("nothing to see", GSM8K_SOLUTION, 0.0),
    ],
)
def test_math_answer_forms(completion, answer, reward):
    assert math_answer(completion, answer, {}) == reward


@pytest.mark.parametrize("answer", ["see the solution above", "", "The answer is five"])
def test_math_answer_unreadable_reference_is_a_bad_answer(answer):
    with pytest.raises(RewardError, match="not a number") as e:
        math_answer("\\boxed{5}", answer, {})
    assert e.value.reason == "bad_answer"
    with pytest.raises(RewardError) as e:
        math_answer("5", None, {})
    assert e.value.reason == "no_answer"


def test_score_keeps_the_reason_of_a_reward_error():
    with pytest.raises(RewardError) as e:
        score(math_answer, "1", "prose only", {})
    assert e.value.reason == "bad_answer"
    with pytest.raises(RewardError) as e:
        score(lambda c, a, m: 1 / 0, "", None, {})
    assert e.value.reason == "raised"


def test_math_answer_symbolic_reference_without_a_stated_answer():
    """No box and no `####`: math-verify finds the completion's last expression itself."""
    assert math_answer("so it is $\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt{3}}{2}", {}) == 1.0
    assert math_answer("so it is $\\frac{1}{2}$", "\\frac{\\sqrt{3}}{2}", {}) == 0.0
