"""Tests of the length_penalty plugin: the formula, the options, and the Relax contract."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from relax.contracts import PluginKind, RewardSample
from relax.registry import PluginEntry, check_contract
from relax_reward_length import LengthPenalty


def make(**options) -> LengthPenalty:
    return LengthPenalty(LengthPenalty.Config(**options))


def sample(response: str) -> RewardSample:
    return RewardSample(prompt="2+2=", response=response, label="4")


def test_within_target_scores_zero():
    assert make(target_chars=4).score([sample("4"), sample("1234")]) == [0.0, 0.0]


def test_penalty_grows_linearly_beyond_target():
    # excess 4 over a target of 4 -> -scale * 4 / 4; excess 2 -> half of that
    assert make(target_chars=4, scale=0.5).score([sample("12345678"), sample("123456")]) == [-0.5, -0.25]


def test_penalty_is_capped():
    assert make(target_chars=1, scale=1.0, max_penalty=2.0).score([sample("x" * 100)]) == [-2.0]


def test_whitespace_is_stripped_unless_asked_not_to():
    assert make(target_chars=1).score([sample("  4  ")]) == [0.0]
    assert make(target_chars=1, strip=False).score([sample("  4  ")]) == [-1.0]


@pytest.mark.parametrize("options", [{"target_chars": 0}, {"scale": -1}, {"targt_chars": 3}])
def test_bad_options_are_rejected(options):
    with pytest.raises(ValidationError):
        LengthPenalty.Config(**options)


def test_matches_the_published_reward_contract():
    entry = PluginEntry(PluginKind.rewards, "length_penalty", "relax_reward_length.reward:LengthPenalty",
                        "relax-reward-length", "0.1.0")
    check_contract(PluginKind.rewards, entry, LengthPenalty)  # raises PluginError if it does not
