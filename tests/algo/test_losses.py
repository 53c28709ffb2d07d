"""PPO-clip loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algo.losses import masked_mean, ppo_clip_loss


def _loss(logprobs, old, adv, mask, **kw):
    kw.setdefault("clip_low", 0.2)
    kw.setdefault("clip_high", 0.28)
    return ppo_clip_loss(torch.tensor(logprobs), torch.tensor(old), torch.tensor(adv),
                         torch.tensor(mask), **kw)


def test_on_policy_loss_is_minus_token_mean_advantage():
    # ratio 1 everywhere; tokens: row 0 two (A=1), row 1 one (A=-2) -> -(1 + 1 - 2) / 3 = 0
    loss, m = _loss([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], [[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]],
                    [1.0, -2.0], [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["clip_fraction"] == 0.0 and m["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["tis_weight_mean"] == 1.0
    loss, _ = _loss([[-1.0, -2.0]], [[-1.0, -2.0]], [0.5], [[1.0, 1.0]])
    assert loss.item() == pytest.approx(-0.5)


@pytest.mark.parametrize(
    "ratio, adv, expected, clipped",
    [
        (1.5, 1.0, -1.28, True),     # above 1 + high with A > 0: clipped at 1.28
        (1.5, -1.0, 1.5, False),     # above 1 + high with A < 0: the unclipped (larger) term
        (0.5, 1.0, -0.5, False),     # below 1 - low with A > 0: the unclipped (larger) term
        (0.5, -1.0, 0.8, True),      # below 1 - low with A < 0: clipped at 0.8
        (1.1, 1.0, -1.1, False),     # inside the range
    ],
)
def test_asymmetric_clip(ratio, adv, expected, clipped):
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, m = ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), 0.2, 0.28)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["clip_fraction"] == (1.0 if clipped else 0.0)
    loss.backward()
    # d/dlogp of -A * ratio is -A * ratio; a clipped token has no gradient
    assert logprobs.grad.item() == pytest.approx(0.0 if clipped else -adv * ratio, rel=1e-6)


def test_approx_kl_is_k3():
    lr = math.log(1.2)
    _, m = _loss([[lr, 0.0]], [[0.0, 0.0]], [1.0], [[1.0, 0.0]])
    assert m["approx_kl"] == pytest.approx(1.2 - 1 - lr, rel=1e-5)
    assert m["ratio_mean"] == pytest.approx(1.2, rel=1e-6)


def test_truncated_importance_weight():
    # old - behaviour = log 3 (capped at 2) on token 0 and log 0.5 on token 1; ratio 1; A = 1
    old = [[0.0, 0.0]]
    behaviour = torch.tensor([[-math.log(3.0), math.log(2.0)]])
    loss, m = _loss(old, old, [1.0], [[1.0, 1.0]], behaviour_logprobs=behaviour, tis_cap=2.0)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2, rel=1e-6)
    assert m["tis_weight_mean"] == pytest.approx(1.25, rel=1e-6)
    plain, _ = _loss(old, old, [1.0], [[1.0, 1.0]], behaviour_logprobs=behaviour, tis_cap=None)
    assert plain.item() == pytest.approx(-1.0)


def test_tis_weight_carries_no_gradient():
    old = torch.zeros(1, 1, requires_grad=True)
    logprobs = torch.zeros(1, 1, requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28,
                            behaviour_logprobs=torch.full((1, 1), -0.5), tis_cap=2.0)
    loss.backward()
    assert old.grad is None or old.grad.abs().sum().item() == 0.0
    assert logprobs.grad.item() == pytest.approx(-math.exp(0.5))


def test_fully_masked_batch_gives_zero_loss_and_gradient():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, m = ppo_clip_loss(logprobs, torch.zeros(1, 2), torch.tensor([3.0]), torch.zeros(1, 2), 0.2, 0.28)
    loss.backward()
    assert loss.item() == 0.0
    assert logprobs.grad.abs().sum().item() == 0.0
    assert all(math.isfinite(v) for v in m.values())


def test_masked_nan_does_not_leak():
    logprobs = torch.tensor([[float("nan"), -1.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, torch.tensor([[0.0, -1.0]]), torch.tensor([1.0]),
                            torch.tensor([[0.0, 1.0]]), 0.2, 0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(logprobs.grad).all()


def test_token_mean_weights_long_rows_more():
    # row 0: 3 tokens with A=1, row 1: 1 token with A=-1 -> -(3 - 1) / 4
    loss, _ = _loss([[0.0] * 3, [0.0] * 3], [[0.0] * 3, [0.0] * 3], [1.0, -1.0],
                    [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert loss.item() == pytest.approx(-0.5)


def test_masked_mean():
    assert masked_mean(torch.tensor([1.0, 5.0, 3.0]), torch.tensor([1, 0, 1])).item() == 2.0
    assert masked_mean(torch.tensor([1.0]), torch.tensor([0])).item() == 0.0
