"""Group advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algo.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages


def _t(values):
    return torch.tensor(values, dtype=torch.float32)


def test_grpo_one_success_in_four():
    # mean 0.25; unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt(0.25) = 0.5
    adv = grpo_advantages(_t([1, 0, 0, 0]), torch.tensor([0, 0, 0, 0]), eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])


def test_grpo_two_of_four_uses_bessel_std():
    # mean 0.5; unbiased std sqrt(4 * 0.25 / 3) = 1 / sqrt(3)
    adv = grpo_advantages(_t([0, 1, 0, 1]), torch.tensor([7, 7, 7, 7]), eps=0.0)
    s = 0.5 * math.sqrt(3)
    assert adv.tolist() == pytest.approx([-s, s, -s, s])


def test_grpo_eps_is_added_to_std():
    adv = grpo_advantages(_t([1, 0]), torch.tensor([0, 0]), eps=0.5)
    # std of [1, 0] (n-1) is sqrt(0.5)
    assert adv[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 0.5))


def test_equal_rewards_give_exact_zeros():
    rewards = _t([0.3, 0.3, 0.3, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        assert fn(rewards, groups).tolist() == [0.0] * 5


def test_group_of_one_gets_zero():
    rewards = _t([1.0, 0.0, 1.0, 0.5])
    groups = torch.tensor([0, 1, 1, 2])  # groups 0 and 2 have one sample
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        adv = fn(rewards, groups)
        assert adv[0].item() == 0.0 and adv[3].item() == 0.0
        assert adv[1].item() < 0 < adv[2].item()


def test_interleaved_group_ids_match_contiguous():
    rewards = _t([1, 0, 0, 1, 1, 0])
    interleaved = torch.tensor([5, 9, 5, 9, 5, 9])
    order = [0, 2, 4, 1, 3, 5]
    contiguous = grpo_advantages(rewards[order], torch.tensor([0, 0, 0, 1, 1, 1]))
    assert grpo_advantages(rewards, interleaved)[order].tolist() == pytest.approx(contiguous.tolist())


def test_dr_grpo_is_centred_reward():
    adv = dr_grpo_advantages(_t([1, 0, 0, 0, 2, 4]), torch.tensor([0, 0, 0, 0, 1, 1]))
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -1.0, 1.0])


def test_grpo_without_std_equals_dr_grpo():
    rewards, groups = _t([0.2, 0.9, 0.4, 0.0]), torch.tensor([0, 0, 1, 1])
    assert grpo_advantages(rewards, groups, normalize_std=False).tolist() == \
        dr_grpo_advantages(rewards, groups).tolist()


def test_rloo_leave_one_out():
    # sample 0: 1 - mean(0, 0, 0) = 1; others: 0 - mean(1, 0, 0) = -1/3
    adv = rloo_advantages(_t([1, 0, 0, 0]), torch.tensor([0, 0, 0, 0]))
    assert adv.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_rloo_is_scaled_centred_reward():
    rewards, groups = _t([0.1, 0.7, 0.4, 3.0, 1.0]), torch.tensor([0, 0, 0, 1, 1])
    centred = dr_grpo_advantages(rewards, groups)
    n = torch.tensor([3.0, 3, 3, 2, 2])
    assert rloo_advantages(rewards, groups).tolist() == pytest.approx((n / (n - 1) * centred).tolist(), abs=1e-6)


def test_integer_rewards_are_accepted():
    adv = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert adv.dtype == torch.float32


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="same length"):
        grpo_advantages(_t([1, 0, 1]), torch.tensor([0, 0]))
