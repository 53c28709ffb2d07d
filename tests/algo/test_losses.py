"""Policy and value losses and their aggregations against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from relax.algo.losses import (
    aggregate,
    cispo_loss,
    gspo_loss,
    masked_mean,
    pg_loss,
    ppo_clip_loss,
    sapo_loss,
    value_loss,
)


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


# --- aggregation ----------------------------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 0.0], [6.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
MASK3 = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # lengths 2, 1 and 0


@pytest.mark.parametrize("mode, two_rows, three_rows", [
    ("token-mean", 9 / 3, 9 / 3),                       # every token counts once
    ("seq-mean-token-sum", (3 + 6) / 2, (3 + 6) / 3),   # row sums, averaged over all rows
    ("seq-mean-token-mean", (1.5 + 6) / 2, (1.5 + 6) / 3),
    ("seq-mean-token-sum-norm", 9 / (2 * 4), 9 / (3 * 4)),  # constant L = 4
])
def test_aggregation_modes(mode, two_rows, three_rows):
    assert aggregate(PER_TOKEN[:2], MASK3[:2], mode, norm_tokens=4).item() == pytest.approx(two_rows)
    # A fully masked row counts 0 in every seq-mean mode, and is left out of token-mean.
    assert aggregate(PER_TOKEN, MASK3, mode, norm_tokens=4).item() == pytest.approx(three_rows)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_parts_weighted_by_the_trainer_share_give_the_whole_loss(mode):
    values = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    whole = aggregate(values, mask, mode, norm_tokens=4)
    parts = 0.0
    for rows in (slice(0, 2), slice(2, 5)):
        share = (mask[rows].sum() / mask.sum() if mode == "token-mean" else (rows.stop - rows.start) / 5)
        parts += share * aggregate(values[rows], mask[rows], mode, norm_tokens=4)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_aggregation_errors_name_the_fix():
    with pytest.raises(ValueError, match="norm_tokens"):
        aggregate(PER_TOKEN, MASK3, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(PER_TOKEN, MASK3, "sequence-mean")


def test_ppo_clip_seq_mean_token_mean_weighs_rows_equally():
    # row 0: 3 tokens A=1, row 1: 1 token A=-1 -> mean of row means (-1 + 1) / 2 = 0
    loss, _ = _loss([[0.0] * 3, [0.0] * 3], [[0.0] * 3, [0.0] * 3], [1.0, -1.0],
                    [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx(0.0, abs=1e-7)


def test_token_level_advantages():
    adv = torch.tensor([[0.0, 2.0, -1.0]])
    loss, _ = _loss([[0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0]], adv.tolist(), [[0.0, 1.0, 1.0]])
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    with pytest.raises(ValueError, match=r"\[B\] or \[B, T\]"):
        _loss([[0.0, 0.0]], [[0.0, 0.0]], [[1.0, 1.0, 1.0]], [[1.0, 1.0]])


# --- dual clip ------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio, expected, grad, dual", [
    (5.0, 3.0, 0.0, True),    # A = -1, ratio past c = 3: the loss stops at -A * c, no gradient
    (2.0, 2.0, 2.0, False),   # below c: plain PPO (the unclipped, larger term)
    (0.5, 0.8, 0.0, False),   # below 1 - low: clipped as usual
])
def test_dual_clip_bounds_negative_advantages(ratio, expected, grad, dual):
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, m = ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), 0.2, 0.28,
                            clip_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert logprobs.grad.item() == pytest.approx(grad, abs=1e-6)
    assert m["dual_clip_fraction"] == (1.0 if dual else 0.0)


def test_dual_clip_leaves_positive_advantages_alone():
    logprobs = torch.tensor([[math.log(5.0)]])
    loss, _ = ppo_clip_loss(logprobs, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28, clip_c=3.0)
    assert loss.item() == pytest.approx(-1.28)


# --- GSPO -----------------------------------------------------------------------------------------


def test_gspo_uses_the_geometric_mean_ratio():
    # token log-ratios log 2 and 0: s = exp(log 2 / 2) = sqrt 2, inside [1 - 0.2, 1 + 0.5]
    logprobs = torch.tensor([[0.0, math.log(2.0), 0.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, m = gspo_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), mask, 0.2, 0.5)
    loss.backward()
    assert loss.item() == pytest.approx(-math.sqrt(2), rel=1e-6)
    # d/dlogp_t of -(1/n) sum_t s = -s / n for every token of the sequence, whatever its own ratio
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -math.sqrt(2) / 2, -math.sqrt(2) / 2], rel=1e-6)
    assert m["seq_ratio_mean"] == pytest.approx(math.sqrt(2), rel=1e-6)
    assert m["clip_fraction"] == 0.0


def test_gspo_clips_the_whole_sequence():
    logprobs = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    loss, m = gspo_loss(logprobs, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-1.2, rel=1e-6)
    assert logprobs.grad.abs().sum().item() == 0.0
    assert m["clip_fraction"] == 1.0


def test_gspo_matches_the_sequence_level_formula():
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    logprobs = (old + 0.1 * torch.randn(3, 5, generator=gen)).requires_grad_(True)
    loss, _ = gspo_loss(logprobs, old, adv, mask, 0.05, 0.08)
    loss.backward()
    token_grad = logprobs.grad.clone()

    reference = logprobs.detach().clone().requires_grad_(True)
    seq = torch.exp(((reference - old) * mask).sum(-1) / mask.sum(-1))
    expected = torch.maximum(-adv * seq, -adv * seq.clamp(0.95, 1.08)).mean()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(token_grad * mask, reference.grad * mask)


# --- CISPO ----------------------------------------------------------------------------------------


def test_cispo_weight_is_clipped_and_carries_no_gradient():
    old = torch.tensor([[-1.0]])
    logprobs = (old + math.log(1.1)).requires_grad_(True)   # ratio 1.1, inside the clip
    loss, m = cispo_loss(logprobs, old, torch.tensor([1.0]), torch.ones(1, 1), None, 0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.1 * (-1.0 + math.log(1.1)), rel=1e-6)
    # Only the log-prob carries the gradient: -c * A, not -c * A * (1 + logp) as through the ratio.
    assert logprobs.grad.item() == pytest.approx(-1.1, rel=1e-6)
    assert m["clip_fraction"] == 0.0


@pytest.mark.parametrize("ratio, clip_low, weight", [
    (2.0, None, 1.28),   # above 1 + high: truncated, but the token keeps its gradient
    (0.5, None, 0.5),    # no lower bound by default (MiniMax-M1)
    (0.5, 0.2, 0.8),     # with a lower bound
])
def test_cispo_bounds(ratio, clip_low, weight):
    old = torch.tensor([[-1.0]])
    logprobs = (old + math.log(ratio)).requires_grad_(True)
    loss, m = cispo_loss(logprobs, old, torch.tensor([2.0]), torch.ones(1, 1), clip_low, 0.28)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(-weight * 2.0, rel=1e-6)
    assert m["clip_fraction"] == (0.0 if weight == ratio else 1.0)


# --- SAPO -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio, adv, tau, expected_loss, expected_grad", [
    (1.0, 1.0, 1.0, -2.0, -1.0),                # on-policy: f = 4/tau * 1/2, gate 1
    (1.0, -1.0, 1.05, 2.0 / 1.05, 1.0),          # tau_neg for a negative advantage
    (2.0, 1.0, 1.0, None, None),                 # off-policy: computed below
])
def test_sapo_soft_gate(ratio, adv, tau, expected_loss, expected_grad):
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, m = sapo_loss(logprobs, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), 1.0, 1.05)
    loss.backward()
    sig = 1 / (1 + math.exp(-tau * (ratio - 1)))
    if expected_loss is None:
        expected_loss = -adv * 4 / tau * sig
        expected_grad = -adv * 4 * sig * (1 - sig) * ratio
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert logprobs.grad.item() == pytest.approx(expected_grad, rel=1e-6)
    assert m["gate_mean"] == pytest.approx(4 * sig * (1 - sig), rel=1e-6)


# --- policy gradient and value loss ----------------------------------------------------------------


def test_pg_loss_and_gradient():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    loss, _ = pg_loss(logprobs, torch.tensor([1.0, -2.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    loss.backward()
    assert loss.item() == pytest.approx(-(1 * -1 + 1 * -2 + -2 * -0.5) / 3)
    assert logprobs.grad.tolist() == [[pytest.approx(-1 / 3), pytest.approx(-1 / 3)], [pytest.approx(2 / 3), 0.0]]


def test_value_loss_clip():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old, returns, mask = torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.4]]), torch.ones(1, 2)
    loss, m = value_loss(values, old, returns, mask, 0.2)
    loss.backward()
    # token 0: clipped value 0.7 has the larger error (1.69 > 1); token 1: plain error 0.16 > 0.01
    assert loss.item() == pytest.approx((0.5 * 1.69 + 0.5 * 0.16) / 2)
    assert values.grad.tolist()[0] == pytest.approx([0.0, (0.0 - 0.4) / 2])
    assert m["value_clip_fraction"] == 0.5
    assert m["value_error"] == pytest.approx((1.0 + 0.16) / 2)
    plain, _ = value_loss(values, old, returns, mask, None)
    assert plain.item() == pytest.approx(0.5 * (1.0 + 0.16) / 2)


def test_value_loss_ignores_masked_tokens():
    values = torch.tensor([[float("nan"), 1.0]], requires_grad=True)
    loss, _ = value_loss(values, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[0.0, 1.0]]), 0.2,
                         aggregation="seq-mean-token-sum")
    loss.backward()
    # token 1 only: V = 1 is right, but the clipped value 0 + 0.2 misses by 0.8 and wins the max
    assert loss.item() == pytest.approx(0.5 * 0.8 ** 2)
    assert torch.isfinite(values.grad).all() and values.grad[0, 0].item() == 0.0


@pytest.mark.parametrize("name, call", [
    ("ppo_clip", lambda lp, old, adv, m, **kw: ppo_clip_loss(lp, old, adv, m, 0.2, 0.28, clip_c=3.0, **kw)),
    ("gspo", lambda lp, old, adv, m, **kw: gspo_loss(lp, old, adv, m, 0.2, 0.28, **kw)),
    ("cispo", lambda lp, old, adv, m, **kw: cispo_loss(lp, old, adv, m, None, 0.28, **kw)),
    ("sapo", lambda lp, old, adv, m, **kw: sapo_loss(lp, old, adv, m, 1.0, 1.05, **kw)),
    ("pg", lambda lp, old, adv, m, **kw: pg_loss(lp, adv, m, **kw)),
])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_a_fully_masked_row_with_garbage_changes_nothing(name, call, mode):
    # rows of 3 and 1 response tokens, then an empty response whose entries hold NaN
    old = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, 0.0, 0.0], [float("nan")] * 3])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 0.5, -1.0], [2.0, 0.0, 0.0], [float("nan")] * 3])
    logprobs = (torch.nan_to_num(old) + 0.1).requires_grad_(True)
    loss, metrics = call(logprobs, old, adv, mask, aggregation=mode, norm_tokens=4)
    loss.backward()
    assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in metrics.values())
    assert logprobs.grad[2].abs().sum().item() == 0.0 and torch.isfinite(logprobs.grad).all()
    # The two real rows alone give the same loss, scaled by the row count in the seq-mean modes.
    alone, _ = call(logprobs.detach()[:2], old[:2], adv[:2], mask[:2], aggregation=mode, norm_tokens=4)
    scale = 1.0 if mode == "token-mean" else 2 / 3
    assert loss.item() == pytest.approx(scale * alone.item(), rel=1e-5)
