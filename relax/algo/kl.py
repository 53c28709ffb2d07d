"""Per-token estimators of the KL divergence from the policy to a reference policy.

The tokens were sampled from the policy ``pi``; with ``log_r = ref_logprobs - logprobs`` (the
log-ratio ``log pi_ref(x) / pi(x)`` at a sampled token), Schulman's estimators of
``KL(pi || pi_ref) = E_pi[-log_r]`` are::

    k1 = -log_r                      # unbiased, high variance, can be negative
    k2 = 0.5 * log_r ** 2            # biased, low variance, >= 0
    k3 = exp(log_r) - 1 - log_r      # unbiased, low variance, >= 0; capped at K3_CAP here

The same estimators serve as a loss term (``algorithm.kl_in: loss``, with the gradient through
``logprobs``) and as a per-token reward penalty (``algorithm.kl_in: reward``, on the behaviour
log-probs, no gradient). Tensors are ``[B, T]`` in the ``relax.algo.batch`` alignment.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["K3_CAP", "K3_LOG_RATIO_BOUND", "KL_ESTIMATORS", "KLEstimator", "kl_divergence"]

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

#: ``|log_r|`` is clamped to this before k3's ``exp``, so the exponential stays finite (e^20 is
#: about 4.85e8; e^89 already overflows float32). It is not what bounds k3 (``K3_CAP`` is): it keeps
#: the value under the cap finite, so that the cap's zero gradient is a true 0 and not ``0 * inf``
#: (NaN) in backward.
K3_LOG_RATIO_BOUND = 20.0
#: k3 itself is capped at ``+-K3_CAP`` (it is never negative, so in effect at ``K3_CAP``), with zero
#: gradient past the cap: one token whose reference probability is e^20 times its policy
#: probability would otherwise add e^20 (about 4.85e8) to the batch's KL and dominate its gradient.
#: A k3 of 10 is a log-ratio of about 2.5 towards the reference or -11 away from it, far past
#: anything a healthy run sees, so the cap only ever cuts outliers.
K3_CAP = 10.0


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3",
                  mask: Tensor | None = None) -> Tensor:
    """The per-token KL estimate (``[B, T]``, see the module docstring); 0 where ``mask`` is 0.

    Masked-out entries are replaced before any arithmetic, so a NaN or an infinity there never
    reaches the result or its gradient. k3 is guarded twice: its log-ratio is clamped to
    ``+-K3_LOG_RATIO_BOUND`` so ``exp`` stays finite, and the estimate is capped at ``+-K3_CAP``
    with zero gradient past the cap (see the two constants for why both).
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs "
                         f"{tuple(ref_logprobs.shape)} must have the same shape")
    log_r = ref_logprobs.detach().to(logprobs.dtype) - logprobs
    if mask is not None:
        log_r = torch.where(mask > 0, log_r, torch.zeros_like(log_r))
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    if estimator == "k3":
        log_r = log_r.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        k3 = torch.exp(log_r) - 1.0 - log_r
        return k3.clamp(-K3_CAP, K3_CAP)
    raise ValueError(f"unknown KL estimator '{estimator}'; use one of {', '.join(KL_ESTIMATORS)}")
