"""Policy and value losses: tensors in, a scalar loss and metrics out.

Token tensors are ``[B, T]`` and aligned as in ``relax.algo.batch`` (entry ``t`` is about the token
at column ``t``); ``mask`` is 1 on the tokens the loss covers (the response tokens). Advantages are
``[B]`` (one per sample, applied to all its tokens) or ``[B, T]`` (one per token).

Every policy loss builds a per-token loss ``l_t`` and reduces it with one of four aggregations
(``aggregate``); the ratio is taken against ``old_logprobs`` (the proximal policy), and an optional
truncated importance weight ``w_t = min(exp(old_t - behaviour_t), tis_cap)`` (detached) multiplies
``l_t`` to correct for samples drawn by a behaviour policy other than the proximal one (the
``tis`` and ``decoupled`` corrections). Metrics are token means over the mask whatever the
aggregation, so they read the same under every mode. Masked-out entries never contribute, even
when NaN, and a fully masked batch gives a loss of 0 with a gradient of 0. A loss may instead be
given ``weight``, the per-token weight of any ``async_policy.correction``
(``relax.algo.corrections``; 0 on the tokens a correction drops).

Numeric guard: every log-ratio that goes into an ``exp`` (policy / proximal and proximal /
behaviour) is clamped to ``+-POLICY_LOG_RATIO_BOUND`` first, with zero gradient past the bound.
Without it a negative-advantage token at log-ratio 30 costs 1e13 with dual clip off, and at 90 the
ratio overflows float32, so the loss and every gradient of the batch become inf or NaN.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOG_RATIO_BOUND",
    "LossAggregation",
    "aggregate",
    "cispo_loss",
    "gspo_loss",
    "importance_weight",
    "masked_mean",
    "pg_loss",
    "ppo_clip_loss",
    "sapo_loss",
    "value_loss",
]

LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm")

#: Every policy loss clamps its log-ratios to ``[-POLICY_LOG_RATIO_BOUND, POLICY_LOG_RATIO_BOUND]``
#: before ``exp``: the largest ratio is then e^20 (about 4.85e8), finite in float32 and bfloat16 even
#: times a large advantage, and a token past the bound gets no gradient through its ratio. Any
#: healthy token is many orders of magnitude inside it (PPO's clip acts at log-ratio ~0.2), so it
#: changes nothing but the outliers that would otherwise turn a whole step's gradient into inf/NaN.
POLICY_LOG_RATIO_BOUND = 20.0


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``sum(values * mask) / max(sum(mask), 1)``; masked-out entries never contribute, even NaN."""
    mask = mask.to(values.dtype)
    kept = torch.where(mask > 0, values, torch.zeros_like(values))
    return (kept * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(values: Tensor, mask: Tensor, mode: str = "token-mean", norm_tokens: int | None = None) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    With ``n_i = sum_t mask_it`` the response tokens of row ``i`` and ``B`` the rows::

        token-mean               sum_i sum_t l_it / sum_i n_i         every token weighs the same
        seq-mean-token-sum       (1/B) sum_i sum_t l_it               long responses weigh more
        seq-mean-token-mean      (1/B) sum_i (1/n_i) sum_t l_it       every sample weighs the same
        seq-mean-token-sum-norm  (1/B) sum_i sum_t l_it / L           L = norm_tokens, a constant

    The ``seq-mean`` modes average over all ``B`` rows, a row without response tokens counting 0,
    so a batch split into parts of ``b_k`` rows has the loss ``sum_k (b_k / B) * loss_k`` (trainers
    weight micro-batches by their share of rows; by their share of tokens for ``token-mean``).
    ``seq-mean-token-sum-norm`` is Dr. GRPO's unbiased form; ``L`` must be the same for every part
    of a batch (the generation budget, ``max_new_tokens``), so it is not taken from the tensor.
    """
    mask = mask.to(values.dtype)
    kept = torch.where(mask > 0, values, torch.zeros_like(values)) * mask
    if mode == "token-mean":
        return kept.sum() / mask.sum().clamp(min=1.0)
    rows = max(values.shape[0], 1)
    if mode == "seq-mean-token-sum":
        return kept.sum() / rows
    if mode == "seq-mean-token-mean":
        return (kept.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).sum() / rows
    if mode == "seq-mean-token-sum-norm":
        if norm_tokens is None or norm_tokens < 1:
            raise ValueError("seq-mean-token-sum-norm needs norm_tokens >= 1 (the generation budget, "
                             f"e.g. roles.rollout.sampling.max_new_tokens), got {norm_tokens}")
        return kept.sum() / (rows * float(norm_tokens))
    raise ValueError(f"unknown loss aggregation '{mode}'; use one of {', '.join(AGGREGATIONS)}")


def importance_weight(old_logprobs: Tensor, behaviour_logprobs: Tensor | None, mask: Tensor,
                      tis_cap: float | None) -> Tensor:
    """``min(exp(old - behaviour), tis_cap)`` per token, detached; 1 without a cap or behaviour.
    The log-ratio is clamped to ``+-POLICY_LOG_RATIO_BOUND`` before ``exp``."""
    if tis_cap is None or behaviour_logprobs is None:
        return torch.ones_like(old_logprobs)
    gap = torch.where(mask > 0, old_logprobs - behaviour_logprobs, torch.zeros_like(old_logprobs))
    gap = gap.clamp(-POLICY_LOG_RATIO_BOUND, POLICY_LOG_RATIO_BOUND)
    return torch.exp(gap).clamp(max=tis_cap).detach()


def _weight(weight: Tensor | None, old_logprobs: Tensor, behaviour_logprobs: Tensor | None, mask: Tensor,
            tis_cap: float | None) -> Tensor:
    """The per-token correction weight a loss multiplies by: ``weight`` when given (detached),
    else the truncated IS weight of ``behaviour_logprobs`` and ``tis_cap``."""
    if weight is not None:
        if weight.shape != old_logprobs.shape:
            raise ValueError(f"the correction weight has shape {tuple(weight.shape)} but the log-probs have "
                             f"{tuple(old_logprobs.shape)}; give one weight per token")
        return weight.detach().to(old_logprobs.dtype)
    return importance_weight(old_logprobs, behaviour_logprobs, mask, tis_cap)


def _token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != like.shape:
        raise ValueError(f"token advantages have shape {tuple(advantages.shape)} but log-probs have "
                         f"{tuple(like.shape)}; give [B] or [B, T] advantages")
    return advantages.detach().to(like.dtype).expand_as(like)


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, on: Tensor) -> Tensor:
    """``logprobs - old`` clamped to ``+-POLICY_LOG_RATIO_BOUND`` (no gradient past it); masked
    entries are 0, so nothing there can leak a NaN into the sum or the gradient."""
    log_ratio = torch.where(on, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    return log_ratio.clamp(-POLICY_LOG_RATIO_BOUND, POLICY_LOG_RATIO_BOUND)


def _ratio_metrics(ratio: Tensor, log_ratio: Tensor, weight: Tensor, mask: Tensor) -> dict[str, float]:
    return {
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask).item(),
        "ratio_mean": masked_mean(ratio, mask).item(),
        "tis_weight_mean": masked_mean(weight, mask).item(),
    }


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    behaviour_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    *,
    clip_c: float | None = None,
    aggregation: str = "token-mean",
    norm_tokens: int | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip with an asymmetric clip range, an optional dual clip and truncated IS.

    Per token ``t`` (``A`` the token's advantage)::

        ratio_t = exp(logprobs_t - old_logprobs_t)
        l_t     = max( -A * ratio_t,  -A * clip(ratio_t, 1 - clip_low, 1 + clip_high) )
        l_t     = min( l_t, -A * clip_c )            if A < 0 and clip_c is given (dual clip)
        w_t     = min( exp(old_logprobs_t - behaviour_logprobs_t), tis_cap )     # detached
        loss    = aggregate(w_t * l_t)

    ``clip_high > clip_low`` is DAPO's clip-higher. The dual clip (Ye et al. 2020) bounds the loss
    of a negative-advantage token whose ratio has grown past ``clip_c`` (> 1), where plain PPO's
    loss is unbounded. ``w_t = 1`` when ``tis_cap`` is None or no ``behaviour_logprobs`` are given;
    a given ``weight`` (any ``async_policy.correction``, ``relax.algo.corrections``) replaces ``w_t``.
    The log-ratio is clamped to ``+-POLICY_LOG_RATIO_BOUND`` (see the module docstring).

    Metrics (token means): ``clip_fraction`` (share of tokens whose gradient a clip cuts),
    ``dual_clip_fraction`` (with ``clip_c``), ``approx_kl`` (k3 of KL(old || new):
    ``mean(ratio - 1 - log ratio)``), ``ratio_mean`` and ``tis_weight_mean``.
    """
    advantages = _token_advantages(advantages, logprobs)
    mask = mask.to(logprobs.dtype)
    on = mask > 0
    log_ratio = _log_ratio(logprobs, old_logprobs, on)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(on)
    if clip_c is not None:
        bound = -advantages * clip_c
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
    weight = _weight(weight, old_logprobs, behaviour_logprobs, mask, tis_cap)
    loss = aggregate(per_token * weight, mask, aggregation, norm_tokens)

    with torch.no_grad():
        cut = (clipped > unclipped) | dual
        metrics = {"clip_fraction": masked_mean(cut.to(logprobs.dtype), mask).item(),
                   **_ratio_metrics(ratio, log_ratio, weight, mask)}
        if clip_c is not None:
            metrics["dual_clip_fraction"] = masked_mean(dual.to(logprobs.dtype), mask).item()
    return loss, metrics


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    behaviour_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    *,
    aggregation: str = "seq-mean-token-mean",
    norm_tokens: int | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): PPO-clip on the length-normalised sequence ratio.

    Per sample ``i`` with response tokens ``t = 1..n_i``::

        log s_i  = (1/n_i) * sum_t (logprobs_t - old_logprobs_t)      # geometric-mean ratio
        s_it     = sg(s_i) * exp(logprobs_t - sg(logprobs_t))         # = s_i in value
        l_t      = max( -A_t * s_it, -A_t * clip(s_it, 1 - clip_low, 1 + clip_high) )
        loss     = aggregate(w_t * l_t)

    This is the paper's GSPO-token form: its value is the sequence ratio, its gradient
    ``s_i * grad log pi_t``, and with ``seq-mean-token-mean`` and one advantage per sample it is
    exactly GSPO's ``(1/B) sum_i max(-A_i s_i, -A_i clip(s_i))``; it also takes ``[B, T]``
    advantages. The paper's clip range is ~1e-3 wide (``low=3e-4, high=4e-4``), far narrower than
    PPO's, because a sequence ratio moves less than a token ratio. A row without response tokens
    has ``s_i = 1`` and no tokens. Metrics as ``ppo_clip_loss``; ``clip_fraction`` counts tokens.
    """
    advantages = _token_advantages(advantages, logprobs)
    mask = mask.to(logprobs.dtype)
    on = mask > 0
    log_ratio = _log_ratio(logprobs, old_logprobs, on)
    seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    kept_logprobs = torch.where(on, logprobs, torch.zeros_like(logprobs))
    token_log_ratio = seq_log_ratio.detach() + kept_logprobs - kept_logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    weight = _weight(weight, old_logprobs, behaviour_logprobs, mask, tis_cap)
    loss = aggregate(per_token * weight, mask, aggregation, norm_tokens)

    with torch.no_grad():
        token_ratio = torch.exp(log_ratio)
        metrics = {"clip_fraction": masked_mean((clipped > unclipped).to(logprobs.dtype), mask).item(),
                   **_ratio_metrics(token_ratio, log_ratio, weight, mask),
                   "seq_ratio_mean": masked_mean(ratio, mask).item()}
    return loss, metrics


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float | None,
    clip_high: float,
    behaviour_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    *,
    aggregation: str = "token-mean",
    norm_tokens: int | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): a clipped, stop-gradient importance weight times the log-prob.

    Per token::

        ratio_t = exp(logprobs_t - old_logprobs_t)
        c_t     = sg( clip(ratio_t, 1 - clip_low, 1 + clip_high) )    # no lower bound if None
        l_t     = -c_t * A_t * logprobs_t
        loss    = aggregate(w_t * l_t)

    Unlike PPO-clip, no token's gradient is ever dropped: a clip bounds the *weight* of the token's
    REINFORCE gradient ``-c_t * A_t * grad log pi_t``, it does not zero it. The loss value is not
    a surrogate of the objective (it contains ``logprobs``); only its gradient means something.
    Metrics as ``ppo_clip_loss``; ``clip_fraction`` is the share of tokens whose weight was clipped.
    """
    advantages = _token_advantages(advantages, logprobs)
    mask = mask.to(logprobs.dtype)
    on = mask > 0
    log_ratio = _log_ratio(logprobs, old_logprobs, on)
    ratio = torch.exp(log_ratio)
    low = None if clip_low is None else 1.0 - clip_low
    clipped_weight = torch.clamp(ratio, min=low, max=1.0 + clip_high).detach()
    kept_logprobs = torch.where(on, logprobs, torch.zeros_like(logprobs))
    per_token = -clipped_weight * advantages * kept_logprobs
    weight = _weight(weight, old_logprobs, behaviour_logprobs, mask, tis_cap)
    loss = aggregate(per_token * weight, mask, aggregation, norm_tokens)

    with torch.no_grad():
        cut = (clipped_weight != ratio).to(logprobs.dtype)
        metrics = {"clip_fraction": masked_mean(cut, mask).item(),
                   **_ratio_metrics(ratio, log_ratio, weight, mask)}
    return loss, metrics


def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    tau_pos: float,
    tau_neg: float,
    behaviour_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    *,
    aggregation: str = "token-mean",
    norm_tokens: int | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """SAPO (Gao et al. 2025): a soft, temperature-controlled gate in place of PPO's hard clip.

    Per token, with ``tau = tau_pos`` where ``A_t > 0`` and ``tau_neg`` otherwise::

        ratio_t = exp(logprobs_t - old_logprobs_t)
        f(r)    = (4 / tau) * sigmoid(tau * (r - 1))
        l_t     = -f(ratio_t) * A_t
        loss    = aggregate(w_t * l_t)

    The gradient is ``-A_t * g_t * ratio_t * grad log pi_t`` with the gate
    ``g_t = 4 * sigmoid(x) * (1 - sigmoid(x))``, ``x = tau * (ratio_t - 1)``: 1 on-policy, decaying
    smoothly as the ratio drifts (where PPO drops the gradient at once). ``tau_neg > tau_pos`` damps
    negative-advantage tokens sooner. Metrics as ``ppo_clip_loss`` plus ``gate_mean`` (mean ``g_t``);
    there is no hard clip, so no ``clip_fraction``.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    advantages = _token_advantages(advantages, logprobs)
    mask = mask.to(logprobs.dtype)
    on = mask > 0
    log_ratio = _log_ratio(logprobs, old_logprobs, on)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -(4.0 / tau) * gate * advantages
    weight = _weight(weight, old_logprobs, behaviour_logprobs, mask, tis_cap)
    loss = aggregate(per_token * weight, mask, aggregation, norm_tokens)

    with torch.no_grad():
        metrics = {"gate_mean": masked_mean(4.0 * gate * (1.0 - gate), mask).item(),
                   **_ratio_metrics(ratio, log_ratio, weight, mask)}
    return loss, metrics


def pg_loss(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    aggregation: str = "token-mean",
    norm_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Vanilla policy gradient (REINFORCE): ``l_t = -A_t * logprobs_t``, ``loss = aggregate(l)``.

    No importance ratio: the gradient is unbiased only for samples of the policy being trained, so
    it suits strictly on-policy training (``max_staleness: 0``) with matching rollout and trainer
    log-probs. Like CISPO's, the loss value itself is not an objective; only its gradient is.
    """
    advantages = _token_advantages(advantages, logprobs)
    mask = mask.to(logprobs.dtype)
    kept_logprobs = torch.where(mask > 0, logprobs, torch.zeros_like(logprobs))
    loss = aggregate(-advantages * kept_logprobs, mask, aggregation, norm_tokens)
    return loss, {}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None,
    *,
    aggregation: str = "token-mean",
    norm_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The critic's clipped value loss (PPO2).

    Per token, with ``V`` the critic's new values, ``V_old`` those that computed the advantages and
    ``R`` the returns (``gae_advantages``)::

        V_clip = V_old + clip(V - V_old, -clip, clip)
        l_t    = 0.5 * max( (V - R)^2, (V_clip - R)^2 )        # 0.5 * (V - R)^2 if clip is None
        loss   = aggregate(l)

    The clip keeps the value function from moving far from the one the advantages were computed
    with in one update. Metrics (token means): ``value_clip_fraction`` (tokens where the clipped
    error is the larger), ``value_error`` (mean ``(V - R)^2``) and ``value_mean``.
    """
    mask = mask.to(values.dtype)
    on = mask > 0
    zeros = torch.zeros_like(values)
    values_kept = torch.where(on, values, zeros)
    old = torch.where(on, old_values.detach().to(values.dtype), zeros)
    target = torch.where(on, returns.detach().to(values.dtype), zeros)
    error = (values_kept - target) ** 2
    if clip is None:
        per_token = 0.5 * error
        clipped_larger = torch.zeros_like(on)
    else:
        clipped_values = old + torch.clamp(values_kept - old, -clip, clip)
        clipped_error = (clipped_values - target) ** 2
        per_token = 0.5 * torch.maximum(error, clipped_error)
        clipped_larger = clipped_error > error
    loss = aggregate(per_token, mask, aggregation, norm_tokens)
    with torch.no_grad():
        metrics = {"value_clip_fraction": masked_mean(clipped_larger.to(values.dtype), mask).item(),
                   "value_error": masked_mean(error, mask).item(),
                   "value_mean": masked_mean(values_kept, mask).item()}
    return loss, metrics
