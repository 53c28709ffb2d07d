"""KL estimators k1, k2, k3 against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algo.kl import kl_divergence

LOGP = torch.tensor([[math.log(0.5)]])
REF = torch.tensor([[math.log(0.25)]])  # log_r = log(0.25 / 0.5) = -log 2


@pytest.mark.parametrize("estimator, expected", [
    ("k1", math.log(2)),
    ("k2", 0.5 * math.log(2) ** 2),
    ("k3", 0.5 - 1 + math.log(2)),
])
def test_estimators(estimator, expected):
    assert kl_divergence(LOGP, REF, estimator).item() == pytest.approx(expected, rel=1e-6)


def test_k3_is_non_negative_and_zero_at_equality():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-3.0, -2.0, -0.1]])
    out = kl_divergence(logp, ref, "k3")
    assert (out >= 0).all() and out[0, 1].item() == 0.0


def test_gradient_of_k1_and_k3():
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    kl_divergence(logp, REF, "k1").sum().backward()
    assert logp.grad.item() == pytest.approx(1.0)
    logp.grad = None
    kl_divergence(logp, REF, "k3").sum().backward()  # d/dlogp (e^{ref-logp} - 1 - ref + logp) = 1 - r
    assert logp.grad.item() == pytest.approx(1.0 - 0.5)


def test_mask_hides_nan_and_unknown_estimator_is_rejected():
    logp = torch.tensor([[float("nan"), -1.0]])
    out = kl_divergence(logp, torch.zeros(1, 2), "k2", mask=torch.tensor([[0.0, 1.0]]))
    assert out.tolist() == [[0.0, 0.5]]
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_divergence(LOGP, REF, "k4")
