"""The correction menu (relax.algo.corrections) against weights and masks computed by hand."""

from __future__ import annotations

import pytest
import torch

from relax.algo.corrections import correction_weight
from relax.contracts import AlgorithmContext
from relax.algo.losses import aggregate, ppo_clip_loss

# Three rows; row 1 has two response tokens (its third entry is padding with a wild value that must
# not matter). rho = proximal / behaviour per token:
#   row 0: [3, 0.4, 1]          S = ln 1.2,        geometric mean 1.2^(1/3) = 1.0627
#   row 1: [1.5, 1, pad]        S = ln 1.5,        geometric mean sqrt(1.5) = 1.2247
#   row 2: [1.0005, 1, 0.9999]  S = ln 1.00039995, geometric mean 1.000133
RHO = [[3.0, 0.4, 1.0], [1.5, 1.0, 1.0], [1.0005, 1.0, 0.9999]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -0.5], [-1.2, -0.7, 50.0], [-0.3, -1.1, -2.2]])
PROXIMAL = BEHAVIOUR + torch.log(torch.tensor(RHO))
S2 = 1.0005 * 0.9999


def weight(name, bounds=AlgorithmContext(), logprobs=PROXIMAL, advantages=torch.tensor([1.0, 1.0, 1.0]),
           behaviour=BEHAVIOUR, mask=MASK):
    return correction_weight(name, logprobs=logprobs, proximal=PROXIMAL, behaviour=behaviour,
                             advantages=advantages, mask=mask, bounds=bounds).tolist()


def close(actual, expected):
    for got, want in zip(actual, expected):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_none_gives_no_weight():
    assert correction_weight("none", logprobs=PROXIMAL, proximal=PROXIMAL, behaviour=BEHAVIOUR,
                             advantages=torch.ones(3), mask=MASK, bounds=AlgorithmContext()) is None


def test_token_tis():
    got = torch.tensor(weight("tis")) * MASK
    close(got.tolist(), [[2.0, 0.4, 1.0], [1.5, 1.0, 0.0], [1.0005, 1.0, 0.9999]])


def test_seq_tis():
    close(weight("seq_tis"), [[1.2] * 3, [1.5, 1.5, 0.0], [S2] * 3])
    close(weight("seq_tis", AlgorithmContext(tis_cap=1.3)), [[1.2] * 3, [1.3, 1.3, 0.0], [S2] * 3])


def test_token_mis_drops_tokens_outside_the_band():
    close(weight("token_mis"), [[0.0, 0.0, 1.0], [1.5, 1.0, 0.0], [1.0005, 1.0, 0.9999]])
    # one-sided (low 0): 0.4 is kept with its ratio
    close(weight("token_mis", AlgorithmContext(mis_low=0.0)), [[0.0, 0.4, 1.0], [1.5, 1.0, 0.0],
                                                              [1.0005, 1.0, 0.9999]])


def test_seq_mis_drops_whole_sequences_outside_the_band():
    close(weight("seq_mis"), [[1.2] * 3, [1.5, 1.5, 0.0], [S2] * 3])
    close(weight("seq_mis", AlgorithmContext(mis_low=0.5, mis_high=1.3)), [[1.2] * 3, [0.0, 0.0, 0.0], [S2] * 3])
    close(weight("seq_mis", AlgorithmContext(mis_low=1.25, mis_high=2.0)), [[0.0] * 3, [1.5, 1.5, 0.0], [0.0] * 3])


def test_geo_reject_keeps_only_sequences_whose_geometric_mean_ratio_is_in_the_band():
    close(weight("geo_reject"), [[0.0] * 3, [0.0, 0.0, 0.0], [1.0] * 3])
    close(weight("geo_reject", AlgorithmContext(geo_low=0.9, geo_high=1.1)), [[1.0] * 3, [0.0, 0.0, 0.0], [1.0] * 3])


def test_icepop_keeps_tokens_in_its_two_sided_band_with_their_ratio():
    close(weight("icepop"), [[3.0, 0.0, 1.0], [1.5, 1.0, 0.0], [1.0005, 1.0, 0.9999]])
    close(weight("icepop", AlgorithmContext(icepop_low=0.3, icepop_high=2.0)),
          [[0.0, 0.4, 1.0], [1.5, 1.0, 0.0], [1.0005, 1.0, 0.9999]])


def test_opsm_masks_drifted_negative_advantage_sequences():
    behaviour = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    # behaviour - current per token: row 0 [0.2, 0] (mean 0.1 > 0.05), row 1 [0.04, 0.04] (0.04),
    # row 2 [0.3, 0.3] (0.3, but a positive advantage)
    current = behaviour - torch.tensor([[0.2, 0.0], [0.04, 0.04], [0.3, 0.3]])
    mask = torch.ones(3, 2)

    def opsm(advantages, delta=0.05):
        return correction_weight("opsm", logprobs=current, proximal=behaviour, behaviour=behaviour,
                                 advantages=advantages, mask=mask, bounds=AlgorithmContext(opsm_delta=delta)).tolist()

    assert opsm(torch.tensor([-1.0, -1.0, 1.0])) == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert opsm(torch.tensor([-1.0, -1.0, 1.0]), delta=0.03) == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    # token advantages: each token's own sign decides within a drifted row
    token_adv = torch.tensor([[-1.0, 1.0], [-1.0, -1.0], [-1.0, 1.0]])
    assert opsm(token_adv) == [[0.0, 1.0], [1.0, 1.0], [0.0, 1.0]]


def test_a_correction_weight_scales_the_per_token_loss_and_drops_tokens():
    # On-policy ratio (logprobs = old): ppo_clip's per-token loss is -A; token_mis keeps row 0's
    # last token only, row 1 and 2 whole. token-mean over all 8 response tokens (dropped ones count).
    w = torch.tensor(weight("token_mis"))
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, _ = ppo_clip_loss(PROXIMAL.clone(), PROXIMAL, adv, MASK, 0.2, 0.28, weight=w)
    expected = -(1.0 * 1.0 + (-2.0) * (1.5 + 1.0) + 0.5 * (1.0005 + 1.0 + 0.9999)) / 8
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    by_hand = aggregate(-adv.unsqueeze(-1) * w, MASK)
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_sequence_ratios_stay_finite_for_long_sequences():
    # 400 tokens each at ratio e^0.5: exp(S) = e^200 overflows float32; seq_tis caps it in log space
    log_r = torch.full((1, 400), 0.5)
    zeros = torch.zeros(1, 400)
    w = correction_weight("seq_tis", logprobs=log_r, proximal=log_r, behaviour=zeros, advantages=torch.ones(1),
                          mask=torch.ones(1, 400), bounds=AlgorithmContext())
    assert torch.isfinite(w).all() and w.max().item() == pytest.approx(2.0)
    w = correction_weight("seq_mis", logprobs=log_r, proximal=log_r, behaviour=zeros, advantages=torch.ones(1),
                          mask=torch.ones(1, 400), bounds=AlgorithmContext())
    assert w.abs().sum().item() == 0.0


def test_an_unknown_correction_is_named():
    with pytest.raises(ValueError, match="unknown async_policy.correction 'nope'"):
        weight("nope")
