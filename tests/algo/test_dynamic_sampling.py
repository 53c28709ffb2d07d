"""DAPO's group filter: which groups are kept and the filter rate."""

from __future__ import annotations

import torch

from relax.algo.dynamic_sampling import filter_groups


def test_groups_with_equal_rewards_and_groups_of_one_are_dropped():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([3, 3, 8, 8, 5, 5, 9])  # 3 mixed; 8 all right; 5 all wrong; 9 alone
    result = filter_groups(rewards, groups)
    assert result.keep.tolist() == [True, True, False, False, False, False, False]
    assert result.kept_groups.tolist() == [3]
    assert result.dropped_groups.tolist() == [5, 8, 9]
    assert result.filter_rate == 0.75


def test_interleaved_groups_and_nothing_to_drop():
    result = filter_groups(torch.tensor([1.0, 0.2, 0.0, 0.3]), torch.tensor([0, 1, 0, 1]))
    assert result.keep.all() and result.filter_rate == 0.0
    assert result.kept_groups.tolist() == [0, 1]
