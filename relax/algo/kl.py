"""Per-token estimators of the KL divergence from the policy to a reference policy.

The tokens were sampled from the policy ``pi``; with ``log_r = ref_logprobs - logprobs`` (the
log-ratio ``log pi_ref(x) / pi(x)`` at a sampled token), Schulman's estimators of
``KL(pi || pi_ref) = E_pi[-log_r]`` are::

    k1 = -log_r                      # unbiased, high variance, can be negative
    k2 = 0.5 * log_r ** 2            # biased, low variance, >= 0
    k3 = exp(log_r) - 1 - log_r      # unbiased, low variance, >= 0

The same estimators serve as a loss term (``algorithm.kl_in: loss``, with the gradient through
``logprobs``) and as a per-token reward penalty (``algorithm.kl_in: reward``, on the behaviour
log-probs, no gradient). Tensors are ``[B, T]`` in the ``relax.algo.batch`` alignment.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["KL_ESTIMATORS", "KLEstimator", "kl_divergence"]

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

#: ``|log_r|`` is clamped to this before k3's ``exp``: a token the reference finds e^20 times
#: likelier would otherwise overflow and dominate the batch.
K3_LOG_RATIO_BOUND = 20.0


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3",
                  mask: Tensor | None = None) -> Tensor:
    """The per-token KL estimate (``[B, T]``, see the module docstring); 0 where ``mask`` is 0.

    Masked-out entries are replaced before any arithmetic, so a NaN or an infinity there never
    reaches the result or its gradient.
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
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator '{estimator}'; use one of {', '.join(KL_ESTIMATORS)}")
