"""The math_verify reward on a table of answer pairs: equivalent forms, wrong answers, malformed."""

from __future__ import annotations

import pytest

from relax.contracts import RewardSample
from relax.registry import get_registry


def reward(**options):
    registry = get_registry()
    return registry.load("rewards", "math_verify")(registry.build_config("rewards", "math_verify", options))


@pytest.fixture(scope="module")
def default():
    return reward()


EQUIVALENT = [
    ("The answer is $\\boxed{\\frac{1}{2}}$", "0.5"),
    ("so x = 1/2", "\\frac12"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("Final answer: 42", "42"),
    ("42.0", "42"),
    ("$\\{1,2\\}$", "\\{2,1\\}"),
    ("\\boxed{(1,2)}", "(1,2)"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{1/3}", "0.333333"),
    ("1,000", "1000"),
    ("x=5", "5"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
    ("\\boxed{\\infty}", "\\infty"),
    ("\\boxed{[0,1)}", "[0,1)"),
    ("\\boxed{10^{3}}", "1000"),
    ("12 apples", "12"),
    ("We get $\\boxed{-7}$.", "-7"),
    ("\\boxed{0.25}", "\\frac{1}{4}"),
]
WRONG = [
    ("The answer is 41", "42"),
    ("\\boxed{-3}", "3"),
    ("\\boxed{[0,1]}", "[0,1)"),
    ("\\boxed{\\pi}", "3.14159"),
    ("\\boxed{\\frac{1}{3}}", "0.33"),
    ("\\boxed{(2,1)}", "(1,2)"),
    ("\\boxed{x+1}", "x+2"),
    ("\\boxed{\\text{yes}}", "42"),
]
MALFORMED = [
    ("I don't know", "42"),
    ("", "3"),
    ("\\boxed{3", "3"),
    ("$\\frac{1}{$", "0.5"),
]


@pytest.mark.parametrize(("response", "label"), EQUIVALENT)
def test_equivalent_answers_score_one(default, response, label):
    assert default.score([RewardSample("q", response, label)]) == [1.0]


@pytest.mark.parametrize(("response", "label"), WRONG + MALFORMED)
def test_wrong_and_malformed_answers_score_zero(default, response, label):
    assert default.score([RewardSample("q", response, label)]) == [0.0]


def test_the_table_is_large_enough():
    assert len(EQUIVALENT) + len(WRONG) + len(MALFORMED) >= 30


def test_scores_are_configurable_and_a_missing_answer_is_told_apart():
    custom = reward(correct_score=2.0, wrong_score=-1.0, unparsed_score=-0.5)
    batch = [RewardSample("q", "\\boxed{4}", "4"), RewardSample("q", "\\boxed{5}", "4"),
             RewardSample("q", "no idea", "4")]
    assert custom.score(batch) == [2.0, -1.0, -0.5]


def test_require_boxed_ignores_unboxed_answers():
    boxed = reward(require_boxed=True)
    batch = [RewardSample("q", "the answer is 5", "5"), RewardSample("q", "\\boxed{5}", "5"),
             RewardSample("q", "5, so \\boxed{4}", "5")]
    assert boxed.score(batch) == [0.0, 1.0, 0.0]


def test_several_accepted_labels(default):
    assert default.score([RewardSample("q", "\\boxed{-2}", ["2", "-2"])]) == [1.0]


def test_bad_labels_are_errors_naming_the_sample(default):
    with pytest.raises(ValueError, match="sample 1 has no label"):
        default.score([RewardSample("q", "1", "1"), RewardSample("q", "1", None)])
    with pytest.raises(ValueError, match=r"label '\?\?\?' of sample 0 is not a math answer"):
        default.score([RewardSample("q", "1", "???")])
