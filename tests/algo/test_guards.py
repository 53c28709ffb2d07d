"""Numeric guards: k3 capped at +-10 with zero gradient past the cap, and every policy loss's
log-ratio clamped, so extreme ratios give finite losses and finite gradients."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algo.corrections import correction_weight
from relax.contracts import AlgorithmContext
from relax.algo.kl import K3_CAP, kl_divergence
from relax.algo.losses import POLICY_LOG_RATIO_BOUND, cispo_loss, gspo_loss, ppo_clip_loss, sapo_loss


def test_k3_hand_values_and_the_cap():
    # log_r = ref - logp: 0 -> 0; 1 -> e - 2; -2 -> e^-2 + 1; 3 -> e^3 - 4 = 16.09 -> 10; -15 -> 14 -> 10
    log_r = torch.tensor([[0.0, 1.0, -2.0, 3.0, -15.0, 90.0]])
    logp = torch.zeros_like(log_r, requires_grad=True)
    k3 = kl_divergence(logp, log_r, "k3")
    expected = [0.0, math.e - 2.0, math.exp(-2.0) + 1.0, 10.0, 10.0, 10.0]
    assert k3[0].tolist() == pytest.approx(expected, rel=1e-6)
    assert K3_CAP == 10.0
    k3.sum().backward()
    # d k3 / d logp = 1 - exp(log_r) under the cap, exactly 0 past it (never NaN from exp overflow)
    assert logp.grad[0].tolist() == pytest.approx([0.0, 1.0 - math.e, 1.0 - math.exp(-2.0), 0.0, 0.0, 0.0],
                                                  rel=1e-6)


def test_k3_just_under_the_cap_still_has_its_gradient():
    log_r = torch.tensor([[2.0]])  # k3 = e^2 - 3 = 4.39 < 10
    logp = torch.zeros_like(log_r, requires_grad=True)
    kl_divergence(logp, log_r, "k3").sum().backward()
    assert logp.grad.item() == pytest.approx(1.0 - math.exp(2.0))


LOSSES = {
    "ppo_clip": lambda lp, old, adv, m, **kw: ppo_clip_loss(lp, old, adv, m, 0.2, 0.28, **kw),
    "ppo_clip_dual": lambda lp, old, adv, m, **kw: ppo_clip_loss(lp, old, adv, m, 0.2, 0.28, clip_c=3.0, **kw),
    "gspo": lambda lp, old, adv, m, **kw: gspo_loss(lp, old, adv, m, 3e-4, 4e-4, **kw),
    "cispo": lambda lp, old, adv, m, **kw: cispo_loss(lp, old, adv, m, None, 0.28, **kw),
    "sapo": lambda lp, old, adv, m, **kw: sapo_loss(lp, old, adv, m, 1.0, 1.05, **kw),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("log_ratio", [30.0, 90.0, -90.0])
@pytest.mark.parametrize("advantage", [1.5, -1.5])
def test_extreme_ratios_give_finite_losses_and_gradients(name, log_ratio, advantage):
    # Row 0: one extreme token and one ordinary token; row 1 ordinary. Behaviour log-probs as
    # extreme too (the TIS weight takes exp(old - behaviour)).
    old = torch.tensor([[-1.0, -1.0], [-2.0, -0.5]])
    leaf = torch.tensor([[-1.0 + log_ratio, -0.9], [-2.0, -0.5]], requires_grad=True)  # row 1 on-policy
    behaviour = old - torch.tensor([[log_ratio, 0.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    adv = torch.tensor([advantage, -advantage])
    loss, metrics = LOSSES[name](leaf, old, adv, mask, behaviour_logprobs=behaviour, tis_cap=2.0)
    loss.backward()
    assert math.isfinite(loss.item()), (name, log_ratio, loss.item())
    assert torch.isfinite(leaf.grad).all(), (name, log_ratio, leaf.grad)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    # The ordinary tokens keep a gradient: the guard did not zero the whole batch.
    assert leaf.grad[1].abs().sum() > 0


def test_the_log_ratio_bound_caps_the_ppo_loss_of_a_negative_advantage_token():
    # Dual clip off, A = -1, log-ratio 30: unguarded the loss is e^30 ~ 1.07e13; guarded e^20.
    leaf = torch.tensor([[30.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(leaf, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), 0.2, 0.28)
    assert loss.item() == pytest.approx(math.exp(POLICY_LOG_RATIO_BOUND), rel=1e-5)
    loss.backward()
    assert leaf.grad.item() == 0.0  # past the bound: no gradient through the ratio


@pytest.mark.parametrize("name", ["seq_tis", "token_mis", "seq_mis", "geo_reject", "icepop", "opsm", "tis"])
def test_every_correction_weight_is_finite_for_extreme_ratios(name):
    proximal = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    behaviour = torch.tensor([[-90.0, -90.0, -90.0], [90.0, 30.0, -30.0]])
    weight = correction_weight(name, logprobs=proximal, proximal=proximal, behaviour=behaviour,
                               advantages=torch.tensor([-1.0, 1.0]), mask=torch.ones(2, 3),
                               bounds=AlgorithmContext())
    assert torch.isfinite(weight).all() and (weight >= 0).all()
