"""The rollout-trainer mismatch figures (relax.algo.mismatch) against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algo.mismatch import MismatchTally, mismatch_metrics, same_version_mask


def k3(log_r: float) -> float:
    return math.exp(log_r) - 1.0 - log_r


def test_figures_by_hand():
    # counted log-ratios (trainer - rollout): 0.1, -0.8, 0 and 1.0; the padding entry is wild
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, 0.0]])
    logprobs = behaviour + torch.tensor([[0.1, -0.8, 0.0], [1.0, 40.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    got = mismatch_metrics(logprobs, behaviour, mask, ratio_bound=2.0)
    assert got["mismatch/tokens"] == 4
    assert got["mismatch/kl"] == pytest.approx((k3(0.1) + k3(-0.8) + k3(0.0) + k3(1.0)) / 4, rel=1e-5)
    assert got["mismatch/max_abs"] == pytest.approx(1.0, rel=1e-5)
    assert got["mismatch/frac_over"] == pytest.approx(2 / 4)  # |-0.8| and |1.0| exceed log 2 = 0.693


def test_identical_log_probs_have_no_mismatch():
    lp = torch.tensor([[-1.0, -2.0]])
    got = mismatch_metrics(lp, lp.clone(), torch.ones(1, 2))
    assert got == {"mismatch/tokens": 2.0, "mismatch/kl": 0.0, "mismatch/max_abs": 0.0, "mismatch/frac_over": 0.0}


def test_the_tally_sums_micro_batches_exactly():
    g = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(6, 5, generator=g) * 3
    logprobs = behaviour + torch.randn(6, 5, generator=g) * 0.5
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    whole = mismatch_metrics(logprobs, behaviour, mask)
    tally = MismatchTally()
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        tally.add(logprobs[rows], behaviour[rows], mask[rows])
    parts = tally.metrics()
    assert parts.keys() == whole.keys()
    for key in whole:
        assert parts[key] == pytest.approx(whole[key], rel=1e-9)


def test_only_rows_of_the_trainers_version_count():
    mask = torch.ones(3, 2)
    got = same_version_mask(mask, torch.tensor([4, 3, 4]), 4)
    assert got.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    assert mismatch_metrics(torch.zeros(3, 2), torch.ones(3, 2), same_version_mask(mask, torch.tensor([3, 3, 3]), 4)) \
        == {"mismatch/tokens": 0.0}
