"""The exact-match reward."""

from __future__ import annotations

import pytest

from relax.contracts import RewardSample
from relax.registry import get_registry


def _reward(**options):
    registry = get_registry()
    cls = registry.load("rewards", "exact_match")
    return cls(registry.build_config("rewards", "exact_match", options))


def _score(reward, response, label):
    return reward.score([RewardSample(prompt="p", response=response, label=label)])[0]


def test_exact_match_defaults():
    reward = _reward()
    assert _score(reward, "8", "8") == 1.0
    assert _score(reward, " 8 ", 8) == 1.0          # stripped; label compared as str
    assert _score(reward, "8\nmore text", "8") == 1.0  # cut at the first newline
    assert _score(reward, "8<|endoftext|>junk", "8") == 1.0
    assert _score(reward, "8 1", "8") == 0.0
    assert _score(reward, "", "8") == 0.0
    assert _score(reward, "Paris", "paris") == 1.0   # case-insensitive by default


def test_options():
    assert _score(_reward(case_sensitive=True), "Paris", "paris") == 0.0
    assert _score(_reward(strip=False), " 8", "8") == 0.0
    assert _score(_reward(stop=[]), "8\n", "8") == 1.0  # strip still removes the newline
    assert _score(_reward(stop=[], strip=False), "8\n", "8") == 0.0


def test_several_accepted_answers_and_batch():
    reward = _reward()
    samples = [RewardSample("p", "4", ["four", "4"]), RewardSample("p", "five", ("4", "four"))]
    assert reward.score(samples) == [1.0, 0.0]


def test_missing_label_is_an_error():
    with pytest.raises(ValueError, match="label_key"):
        _reward().score([RewardSample("p", "8", None)])
