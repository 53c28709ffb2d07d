"""The regex, format, multiple_choice and overlong_penalty rewards, on tables of cases."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from relax.contracts import RewardSample
from relax.registry import get_registry


def reward(name, **options):
    registry = get_registry()
    return registry.load("rewards", name)(registry.build_config("rewards", name, options))


def one(plugin, response, label=None, **metadata):
    return plugin.score([RewardSample("q", response, label, metadata)])[0]


@pytest.mark.parametrize(("options", "response", "label", "expected"), [
    ({"pattern": r"\d+"}, "it is 42", None, 1.0),
    ({"pattern": r"\d+"}, "forty-two", None, 0.0),
    ({"pattern": r"\d+", "mode": "fullmatch"}, " 42 ", None, 1.0),            # stripped first
    ({"pattern": r"\d+", "mode": "fullmatch", "strip": False}, " 42 ", None, 0.0),
    ({"pattern": r"\d+", "mode": "match"}, "x 42", None, 0.0),
    ({"pattern": "yes", "flags": ["IGNORECASE"]}, "YES", None, 1.0),
    ({"pattern": "yes"}, "YES", None, 0.0),
    ({"compare_label": True}, "Answer: 42", "42", 1.0),                       # default pattern: answer: X
    ({"compare_label": True}, "answer = 41. Answer: 42", "42", 1.0),          # the last match counts
    ({"compare_label": True, "last_match": False}, "answer = 41. Answer: 42", "42", 0.0),
    ({"compare_label": True}, "Answer: 41", "42", 0.0),
    ({"compare_label": True}, "I think 42", "42", 0.0),
    ({"compare_label": True, "pattern": r"#### (?P<answer>\S+)"}, "so #### Paris", "paris", 1.0),
    ({"compare_label": True, "pattern": r"#### (\S+)", "case_sensitive": True}, "#### Paris", "paris", 0.0),
    ({"compare_label": True, "match_score": 2, "wrong_score": -1, "miss_score": -2}, "Answer: 1", "2", -1.0),
    ({"compare_label": True, "match_score": 2, "wrong_score": -1, "miss_score": -2}, "nothing", "2", -2.0),
])
def test_regex(options, response, label, expected):
    assert one(reward("regex", **options), response, label) == expected


def test_regex_options_are_checked_when_validated_and_built():
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        get_registry().build_config("rewards", "regex", {"pattern": "(unclosed"})
    with pytest.raises(ValueError, match="compare_label needs a capturing group"):
        reward("regex", pattern=r"\d+", compare_label=True)
    with pytest.raises(ValueError, match="has no label"):
        one(reward("regex", compare_label=True), "Answer: 1", None)


@pytest.mark.parametrize(("options", "response", "expected"), [
    ({}, "<think>2+2 is 4\nso</think>\n<answer>4</answer>", 1.0),
    ({}, "  <think>a</think><answer>4</answer>\n", 1.0),
    ({}, "<answer>4</answer>", 0.0),
    ({}, "<think>a</think><answer>4</answer> trailing", 0.0),
    ({}, "<think>a<answer>4</answer>", 0.0),
    ({"pattern": r".*\\boxed\{.+\}", "match_score": 0.5, "miss_score": -0.5}, "so \\boxed{3}", 0.5),
    ({"pattern": r".*\\boxed\{.+\}", "match_score": 0.5, "miss_score": -0.5}, "so 3", -0.5),
])
def test_format(options, response, expected):
    assert one(reward("format", **options), response) == expected


@pytest.mark.parametrize(("response", "chosen"), [
    ("B", "B"), ("(B)", "B"), ("**B**", "B"), ("b.", "B"), ("B) Paris", "B"), ("C. because ...", "C"),
    ("The answer is B.", "B"), ("Answer: (b)", "B"), ("\\boxed{B}", "B"), ("\\boxed{\\text{D}}", "D"),
    ("A cat sat. The answer is D", "D"), ("The correct option is C", "C"), ("Option (d) is right", "D"),
    ("Between A and B, the answer is B", "B"), ("Final answer: **C**", "C"), ("The answer is: A", "A"),
    ("the answer is a bit unclear, but B", "B"), ("My answer is b because", "B"), ("I think it is C", "C"),
    ("A is wrong, B is wrong, so C", "C"), ("I don't know", None), ("E", None), ("answered", None),
])
def test_multiple_choice_extraction(response, chosen):
    assert reward("multiple_choice").chosen(response) == chosen


def test_multiple_choice_scores_and_labels():
    mc = reward("multiple_choice", correct_score=1.0, wrong_score=-0.5, unparsed_score=-1.0)
    assert one(mc, "The answer is (C)", "C") == 1.0
    assert one(mc, "The answer is (C)", 2) == 1.0       # 0-based option index
    assert one(mc, "The answer is (C)", "b") == -0.5
    assert one(mc, "no idea", "B") == -1.0
    assert one(reward("multiple_choice", choices="ABCDE"), "E", "E") == 1.0
    with pytest.raises(ValueError, match="label 'F' of sample 0 is neither one of the letters ABCD"):
        one(mc, "A", "F")
    with pytest.raises(ValidationError, match="distinct ASCII letters"):
        get_registry().build_config("rewards", "multiple_choice", {"choices": "AAB"})


@pytest.mark.parametrize(("tokens", "expected"), [(0, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (20, -1.0), (25, -1.0)])
def test_overlong_penalty_is_dapo_soft_punishment(tokens, expected):
    # max_tokens 20 (from the rollout's max_new_tokens), buffer 4: free up to 16, linear to -1 at 20.
    assert one(reward("overlong_penalty", buffer=4), "r", response_tokens=tokens, max_new_tokens=20) == expected


def test_overlong_penalty_options():
    assert one(reward("overlong_penalty", max_tokens=10, buffer=5, penalty=0.5), "r", response_tokens=9,
               max_new_tokens=99) == -0.4
    assert one(reward("overlong_penalty"), "r", response_tokens=9, max_new_tokens=10) == -1.0 * 1 / 2  # buffer 10//5
    with pytest.raises(ValueError, match="no metadata\\['response_tokens'\\]"):
        one(reward("overlong_penalty"), "r", max_new_tokens=10)
    with pytest.raises(ValueError, match="buffer 50 exceeds the length limit 10"):
        one(reward("overlong_penalty", buffer=50), "r", response_tokens=1, max_new_tokens=10)
