"""Token-level advantage estimators (REINFORCE++, REINFORCE++-baseline, GAE) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algo.advantages import (
    discounted_returns,
    gae_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    token_rewards,
    whiten,
)


def _t(values):
    return torch.tensor(values, dtype=torch.float32)


def assert_close(actual, expected):
    torch.testing.assert_close(actual, _t(expected), rtol=1e-5, atol=1e-6)


# Three rows over 4 columns: a 2-token response, a 1-token response, and an empty response.
MASK = _t([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])


def test_outcome_reward_lands_on_the_last_response_token():
    out = token_rewards(_t([1.0, 0.5, 7.0]), MASK)
    assert out.tolist() == [[0, 0, 1.0, 0], [0, 0.5, 0, 0], [0, 0, 0, 0]]  # the empty row drops its reward


def test_kl_penalty_is_on_every_response_token():
    kl = _t([[9, 0.2, 0.4, 9], [9, 1.0, 9, 9], [9, 9, 9, 9]])  # 9s are off the mask
    out = token_rewards(_t([1.0, 0.0, 0.0]), MASK, kl, kl_coef=0.5)
    assert_close(out, [[0, -0.1, 0.8, 0], [0, -0.5, 0, 0], [0, 0, 0, 0]])


def test_discounted_returns():
    rewards = _t([[0, -0.1, 0.8, 0]])
    out = discounted_returns(rewards, MASK[:1], gamma=0.5)
    assert_close(out, [[0, -0.1 + 0.5 * 0.8, 0.8, 0]])


def test_discounting_skips_holes_in_the_mask():
    mask = _t([[1, 0, 1]])  # e.g. a tool's output inside the response is not the policy's
    out = discounted_returns(_t([[0, 5, 2]]), mask, gamma=0.5)
    assert out.tolist() == [[1.0, 0.0, 2.0]]  # one step of discount, and the hole's 5 is not counted


def test_whiten_uses_unbiased_std_over_response_tokens():
    values = _t([[99, 1, 1, 99], [99, 0, 99, 99], [99, 99, 99, 99]])
    # tokens 1, 1, 0: mean 2/3, unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3
    s = math.sqrt(1 / 3)
    assert_close(whiten(values, MASK, eps=0.0),
                 [[0, (1 / 3) / s, (1 / 3) / s, 0], [0, (-2 / 3) / s, 0, 0], [0, 0, 0, 0]])


def test_whiten_of_equal_values_or_one_token_is_zero():
    assert whiten(_t([[2, 2], [2, 0]]), _t([[1, 1], [1, 0]])).tolist() == [[0, 0], [0, 0]]
    assert whiten(_t([[3.0, 0]]), _t([[1, 0]])).tolist() == [[0, 0]]
    assert_close(whiten(_t([[float("nan"), 1, 2]]), _t([[0, 1, 1]]), eps=0.0),
                 [[0, -1 / math.sqrt(2), 1 / math.sqrt(2)]])


def test_reinforce_pp_whitens_the_returns():
    adv = reinforce_pp_advantages(_t([1.0, 0.0, 3.0]), MASK, eps=0.0)
    s = math.sqrt(1 / 3)  # returns 1, 1, 0 as in the whitening test
    assert_close(adv, [[0, (1 / 3) / s, (1 / 3) / s, 0], [0, (-2 / 3) / s, 0, 0], [0] * 4])


def test_reinforce_pp_with_kl_to_go_and_discount():
    mask = _t([[1, 1], [1, 1]])
    kl = _t([[0.2, 0.4], [0.0, 0.0]])
    adv = reinforce_pp_advantages(_t([1.0, 0.0]), mask, kl, kl_coef=0.5, gamma=0.5, eps=0.0)
    returns = torch.tensor([0.3, 0.8, 0.0, 0.0])  # row 0: r = [-0.1, 0.8], G = [-0.1 + 0.4, 0.8]
    expected = (returns - returns.mean()) / returns.std()
    assert adv.flatten().tolist() == pytest.approx(expected.tolist(), rel=1e-5)


def test_reinforce_pp_equal_rewards_give_zero():
    assert reinforce_pp_advantages(_t([1.0, 1.0, 1.0]), MASK).abs().sum().item() == 0.0


def test_reinforce_pp_baseline_centres_per_group_then_whitens():
    mask = _t([[1], [1], [1], [1], [1]])
    groups = torch.tensor([0, 0, 1, 2, 2])  # group 1 has one sample; group 2 is all equal
    adv = reinforce_pp_baseline_advantages(_t([1.0, 0.0, 5.0, 2.0, 2.0]), groups, mask, eps=0.0)
    # centred rewards 0.5, -0.5, 0, 0, 0: mean 0, unbiased std sqrt(0.5 / 4)
    s = math.sqrt(0.5 / 4)
    assert adv.flatten().tolist() == pytest.approx([0.5 / s, -0.5 / s, 0, 0, 0])


def test_gae_by_hand():
    mask = _t([[0, 1, 1]])
    values = _t([[7.0, 0.5, 0.8]])  # the prompt column's value is never read
    adv, returns = gae_advantages(_t([1.0]), values, mask, gamma=1.0, lam=0.5, whiten_advantages=False)
    # t=2 (last): delta = 1 - 0.8 = 0.2; t=1: delta = 0.8 - 0.5 = 0.3, A = 0.3 + 0.5 * 0.2 = 0.4
    assert_close(adv, [[0, 0.4, 0.2]])
    assert_close(returns, [[0, 0.9, 1.0]])


def test_gae_with_lambda_one_is_the_discounted_return_minus_value():
    mask = _t([[1, 1, 1]])
    values = _t([[0.1, 0.2, 0.3]])
    adv, returns = gae_advantages(_t([2.0]), values, mask, gamma=0.9, lam=1.0, whiten_advantages=False)
    assert_close(returns, [[2.0 * 0.81, 2.0 * 0.9, 2.0]])
    assert_close(adv, [[1.62 - 0.1, 1.8 - 0.2, 2.0 - 0.3]])


def test_gae_kl_penalty_and_whitening():
    mask = _t([[1, 1], [1, 0]])
    values = torch.zeros(2, 2)
    kl = _t([[1.0, 0.0], [0.0, 0.0]])
    raw, returns = gae_advantages(_t([1.0, 0.0]), values, mask, kl, kl_coef=0.5, lam=1.0, whiten_advantages=False)
    assert_close(raw, [[0.5, 1.0], [0.0, 0.0]])
    assert returns.tolist() == raw.tolist()  # values are 0
    white, _ = gae_advantages(_t([1.0, 0.0]), values, mask, kl, kl_coef=0.5, lam=1.0, eps=0.0)
    tokens = torch.tensor([0.5, 1.0, 0.0])
    expected = (tokens - tokens.mean()) / tokens.std()
    assert white[mask > 0].tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    assert white[1, 1].item() == 0.0


def test_fully_masked_rows_get_zero_advantages():
    mask = _t([[0, 0], [1, 1]])
    adv, returns = gae_advantages(_t([5.0, 1.0]), _t([[3.0, 3.0], [0.0, 0.0]]), mask, whiten_advantages=False)
    assert adv[0].tolist() == [0, 0] and returns[0].tolist() == [0, 0]


def test_shape_mismatch_names_the_tensor():
    with pytest.raises(ValueError, match="values"):
        gae_advantages(_t([1.0]), torch.zeros(1, 3), torch.ones(1, 2))
