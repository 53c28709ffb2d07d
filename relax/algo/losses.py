"""Policy losses: tensors in, a scalar loss and metrics out.

Token tensors are ``[B, T]`` and aligned as in ``relax.algo.batch`` (entry ``t`` is about the token
at column ``t``); ``mask`` is 1 on the tokens the loss covers (the response tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["masked_mean", "ppo_clip_loss"]


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``sum(values * mask) / max(sum(mask), 1)``; masked-out entries never contribute, even NaN."""
    mask = mask.to(values.dtype)
    kept = torch.where(mask > 0, values, torch.zeros_like(values))
    return (kept * mask).sum() / mask.sum().clamp(min=1.0)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    behaviour_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip with an asymmetric clip range, token-mean over the mask, optional truncated IS.

    Per token ``t`` (``A`` is the token's advantage; a ``[B]`` advantage applies to every token of
    its row)::

        ratio_t = exp(logprobs_t - old_logprobs_t)
        loss_t  = max( -A * ratio_t,  -A * clip(ratio_t, 1 - clip_low, 1 + clip_high) )
        w_t     = min( exp(old_logprobs_t - behaviour_logprobs_t), tis_cap )     # detached
        loss    = sum_t mask_t * w_t * loss_t / sum_t mask_t                      # token mean

    ``w_t = 1`` when ``tis_cap`` is None (no truncated importance sampling) or when no
    ``behaviour_logprobs`` are given. The weight corrects for samples drawn by a behaviour policy
    other than the old (proximal) policy; it carries no gradient. A fully masked batch gives a loss
    of 0 (with a gradient of 0).

    Metrics, all token means over the mask: ``clip_fraction`` (share of tokens where the clipped
    term is the one chosen, i.e. the gradient is cut), ``approx_kl`` (the k3 estimator of
    KL(old || new): ``mean(ratio - 1 - log ratio)``), ``ratio_mean`` and ``tis_weight_mean``.
    """
    if advantages.ndim == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype)
    mask = mask.to(logprobs.dtype)
    on = mask > 0
    zeros = torch.zeros_like(logprobs)
    # Keep masked entries finite so that nothing there can leak a NaN into the sum or the gradient.
    log_ratio = torch.where(on, logprobs - old_logprobs.detach(), zeros)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if tis_cap is not None and behaviour_logprobs is not None:
        behaviour_gap = torch.where(on, old_logprobs - behaviour_logprobs, zeros)
        weight = torch.exp(behaviour_gap).clamp(max=tis_cap).detach()
    else:
        weight = torch.ones_like(logprobs)
    per_token = per_token * weight
    loss = masked_mean(per_token, mask)

    with torch.no_grad():
        metrics = {
            "clip_fraction": masked_mean((clipped > unclipped).to(logprobs.dtype), mask).item(),
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "tis_weight_mean": masked_mean(weight, mask).item(),
        }
    return loss, metrics
