"""The off-policy correction menu (``async_policy.correction``): per-token weights for the policy loss.

The samples of a step were drawn by the behaviour policy ``mu`` (the rollout engine, maybe some
versions old); the loss is about the proximal policy ``pi_old`` (the trainer's log-probs of the
same tokens, recomputed by ``roles.actor_fwd`` as ``old_logprobs``). Their per-token log-ratio::

    log rho_t = old_t - behaviour_t                    # clamped to +-POLICY_LOG_RATIO_BOUND

measures both staleness and the rollout-trainer mismatch (kernels, precision, MoE routing). Each
correction turns it into a detached per-token weight ``w_t`` that multiplies the loss's per-token
term ``l_t`` (``loss = aggregate(w_t * l_t)``); a token or sequence a correction drops has
``w_t = 0``. Dropped tokens still count in the aggregation's denominator (as in IcePop's
objective), so a micro-batched step stays equal to the whole batch at once; the loss is scaled
by the kept share. With ``S_i = sum_t log rho_it`` and ``n_i`` the response tokens of row ``i``::

    tis         w_t = min(rho_t, C)                                      token TIS
    seq_tis     w_t = min(exp(S_i), C)                                   sequence TIS
    token_mis   w_t = rho_t * [low <= rho_t <= high]                     token masked IS
    seq_mis     w_t = exp(S_i) * [low <= exp(S_i) <= high]               sequence masked IS
    geo_reject  w_t = [low <= exp(S_i / n_i) <= high]                    geometric-mean rejection
    icepop      w_t = rho_t * [low <= rho_t <= high]                     IcePop (token, two-sided)
    opsm        w_t = 0 if A_t < 0 and (1/n_i) sum_t (behaviour_t - logprobs_t) > delta, else 1

OPSM (off-policy sequence masking, DeepSeek-V3.2) looks at the policy being trained
(``logprobs``, detached), not the proximal one: it drops negative-advantage samples the current
policy has drifted away from, whatever the reason. Sequence quantities are computed in log space
(``exp(S_i)`` is never formed past its bound), so a long sequence cannot overflow. Every function
is pure: tensors ``[B, T]`` in the ``relax.algo.batch`` alignment, a weight ``[B, T]`` out, 0 off
the ``mask``. ``correction_weight`` dispatches by name.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from relax.algo.losses import POLICY_LOG_RATIO_BOUND, importance_weight

__all__ = [
    "RATIO_CORRECTIONS",
    "CorrectionBounds",
    "correction_weight",
    "geo_reject_weight",
    "icepop_weight",
    "log_rho",
    "opsm_weight",
    "seq_mis_weight",
    "seq_tis_weight",
    "token_mis_weight",
]

#: Corrections new to the menu whose weight is a function of the proximal / behaviour ratio (with
#: ``decoupled``, ``relax.contracts.PROXIMAL_CORRECTIONS``: they need ``roles.actor_fwd``).
RATIO_CORRECTIONS = frozenset({"seq_tis", "token_mis", "seq_mis", "geo_reject", "icepop"})


class CorrectionBounds(Protocol):
    """The bounds the corrections read: ``relax.contracts.AlgorithmContext`` has them (filled from
    ``async_policy``, whose fields say where each default comes from)."""

    tis_cap: float
    mis_low: float
    mis_high: float
    geo_low: float
    geo_high: float
    icepop_low: float
    icepop_high: float
    opsm_delta: float


def log_rho(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    """``proximal - behaviour`` per token, detached, clamped to ``+-POLICY_LOG_RATIO_BOUND``; 0 off the mask."""
    on = mask > 0
    gap = torch.where(on, proximal.detach() - behaviour.detach().to(proximal.dtype), torch.zeros_like(proximal))
    return gap.clamp(-POLICY_LOG_RATIO_BOUND, POLICY_LOG_RATIO_BOUND)


def _seq_log(log_r: Tensor, mask: Tensor) -> Tensor:
    """``S_i = sum_t log rho_it`` as ``[B, 1]``."""
    return (log_r * mask.to(log_r.dtype)).sum(dim=-1, keepdim=True)


def _in(log_value: Tensor, low: float, high: float) -> Tensor:
    """``low <= exp(log_value) <= high``, decided in log space (``low`` may be 0)."""
    lower = -math.inf if low <= 0 else math.log(low)
    return (log_value >= lower) & (log_value <= math.log(high))


def _on(weight: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask > 0, weight, torch.zeros_like(weight))


def seq_tis_weight(log_r: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Sequence TIS: every token of row ``i`` weighs ``min(exp(S_i), cap)``."""
    seq = _seq_log(log_r, mask).clamp(max=math.log(cap))
    return _on(torch.exp(seq).expand_as(log_r), mask)


def token_mis_weight(log_r: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """Token masked IS: ``rho_t`` where ``low <= rho_t <= high``, else 0 (the token is dropped)."""
    keep = _in(log_r, low, high)
    return _on(torch.where(keep, torch.exp(log_r), torch.zeros_like(log_r)), mask)


def seq_mis_weight(log_r: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """Sequence masked IS: ``exp(S_i)`` on every token of a row whose ``exp(S_i)`` is in
    ``[low, high]``, else 0 (the whole sequence is dropped)."""
    seq = _seq_log(log_r, mask)
    keep = _in(seq, low, high)
    weight = torch.where(keep, torch.exp(seq.clamp(max=math.log(high))), torch.zeros_like(seq))
    return _on(weight.expand_as(log_r), mask)


def geo_reject_weight(log_r: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """Geometric-mean rejection: 1 on the tokens of a row whose geometric-mean ratio
    ``exp(S_i / n_i)`` is in ``[low, high]``, else 0. No importance weight: only rejection."""
    tokens = mask.to(log_r.dtype).sum(dim=-1, keepdim=True).clamp(min=1.0)
    keep = _in(_seq_log(log_r, mask) / tokens, low, high)
    return _on(keep.to(log_r.dtype).expand_as(log_r), mask)


def icepop_weight(log_r: Tensor, mask: Tensor, low: float, high: float) -> Tensor:
    """IcePop (Ring-1T, 2025): ``rho_t`` inside ``[low, high]``, 0 outside (two-sided token mask)."""
    return token_mis_weight(log_r, mask, low, high)


def opsm_weight(logprobs: Tensor, behaviour: Tensor, advantages: Tensor, mask: Tensor, delta: float) -> Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2): 0 on the negative-advantage tokens of a row
    whose mean ``behaviour - logprobs`` (a per-token KL estimate from the behaviour policy to the
    policy being trained) exceeds ``delta``; 1 elsewhere. ``advantages`` are ``[B]`` or ``[B, T]``
    (with token advantages each token's own sign decides)."""
    log_r = log_rho(behaviour.to(logprobs.dtype), logprobs.detach(), mask)  # behaviour - logprobs
    tokens = mask.to(log_r.dtype).sum(dim=-1, keepdim=True).clamp(min=1.0)
    drifted = _seq_log(log_r, mask) / tokens > delta
    adv = advantages.detach().to(log_r.dtype)
    adv = adv.unsqueeze(-1).expand_as(log_r) if adv.ndim == 1 else adv
    dropped = drifted & (adv < 0)
    return _on(torch.where(dropped, torch.zeros_like(log_r), torch.ones_like(log_r)), mask)


def correction_weight(name: str, *, logprobs: Tensor, proximal: Tensor, behaviour: Tensor | None,
                      advantages: Tensor, mask: Tensor, bounds: CorrectionBounds) -> Tensor | None:
    """The detached per-token weight ``[B, T]`` of correction ``name`` (see the module docstring);
    None for ``none`` (no weight). ``tis`` and ``decoupled`` use the truncated weight
    ``min(exp(proximal - behaviour), tis_cap)`` (``relax.algo.losses.importance_weight``)."""
    if name == "none":
        return None
    if behaviour is None:
        raise ValueError(f"async_policy.correction {name} needs the behaviour log-probs (the rollout's "
                         "rollout_logprobs column), but the batch has none")
    if name in ("tis", "decoupled"):
        return importance_weight(proximal.detach(), behaviour, mask, bounds.tis_cap)
    if name == "opsm":
        return opsm_weight(logprobs, behaviour, advantages, mask, bounds.opsm_delta)
    log_r = log_rho(proximal, behaviour, mask)
    if name == "seq_tis":
        return seq_tis_weight(log_r, mask, bounds.tis_cap)
    if name == "token_mis":
        return token_mis_weight(log_r, mask, bounds.mis_low, bounds.mis_high)
    if name == "seq_mis":
        return seq_mis_weight(log_r, mask, bounds.mis_low, bounds.mis_high)
    if name == "geo_reject":
        return geo_reject_weight(log_r, mask, bounds.geo_low, bounds.geo_high)
    if name == "icepop":
        return icepop_weight(log_r, mask, bounds.icepop_low, bounds.icepop_high)
    raise ValueError(f"unknown async_policy.correction '{name}'; use one of none, tis, decoupled, "
                     f"{', '.join(sorted(RATIO_CORRECTIONS))}, opsm")
