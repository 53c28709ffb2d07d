"""Advantage estimators: tensors in, tensors out.

Two levels:

* **Outcome level** (``grpo``, ``dr_grpo``, ``rloo``): one scalar reward per sample
  (``rewards[B]``) and the group each sample belongs to (``group_ids[B]``: samples of the same
  prompt share an id; ids need not be contiguous or sorted) give one advantage per sample (``[B]``,
  in the rewards' floating dtype, float32 for integer rewards). The advantage applies to every
  response token of its sample; which tokens those are is the loss's business (its mask).
* **Token level** (``reinforce_pp``, ``reinforce_pp_baseline``, ``gae``): the rewards plus
  ``[B, T]`` token tensors in the ``relax.algo.batch`` layout (``response_mask`` and, as needed,
  behaviour log-probs, reference log-probs and critic values) give a ``[B, T]`` advantage that is 0
  off the response tokens, and for ``gae`` the returns the critic regresses to.

Token-level conventions shared by every estimator here:

* A sample's outcome reward is placed on its **last response token** (the last column where
  ``response_mask`` is 1); a row without response tokens has nothing to credit and gets 0.
* A KL penalty "to go" is ``-kl_coef * k(logprobs, ref_logprobs)`` on every response token (``k``
  one of ``relax.algo.kl``'s estimators, on the behaviour log-probs: no gradient flows).
* Discounting counts response tokens only: the step after response token ``t`` is the next column
  whose mask is 1, so a mask with holes (e.g. tool output inside a response) skips them.
* Whitening is over all response tokens of the batch at once: ``(x - mean) / (std + eps)``, std the
  unbiased (n - 1) estimator over those tokens; a batch with fewer than two response tokens, or
  whose values are all equal, whitens to exactly 0.

No state, no configuration reads, no Ray: the ``relax_plugins.advantages`` plugins call these with
options taken from the run spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "GroupStats",
    "TokenAdvantageInputs",
    "TokenAdvantages",
    "discounted_returns",
    "dr_grpo_advantages",
    "gae_advantages",
    "group_stats",
    "grpo_advantages",
    "put_rows",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "take_rows",
    "token_rewards",
    "whiten",
]


@dataclass(frozen=True)
class TokenAdvantageInputs:
    """What a token-level estimator reads (``compute_tokens``). Token tensors are ``[B, T]`` in the
    ``relax.algo.batch`` layout: entry ``t`` is about the token at column ``t``."""

    rewards: Tensor
    """``[B]`` scalar (outcome) reward of each sample."""
    group_ids: Tensor
    """``[B]`` the prompt each sample answers (samples of one prompt share an id)."""
    response_mask: Tensor
    """``[B, T]`` float: 1 on response tokens, 0 elsewhere."""
    logprobs: Tensor
    """``[B, T]`` the behaviour policy's log-prob of each response token (from the rollout)."""
    ref_logprobs: Tensor | None = None
    """``[B, T]`` the reference policy's log-probs, when a reference role runs."""
    values: Tensor | None = None
    """``[B, T]`` the critic's value of the state in which each response token was chosen (entry
    ``t`` is ``V(tokens before t)``), when a critic role runs."""


@dataclass(frozen=True)
class TokenAdvantages:
    """What a token-level estimator returns."""

    advantages: Tensor
    """``[B, T]`` float32, 0 off the response tokens."""
    returns: Tensor | None = None
    """``[B, T]`` float32 value targets of the critic (0 off the response tokens), if any."""


@dataclass(frozen=True)
class GroupStats:
    """Statistics of each sample's own group, broadcast back to the samples (each ``[B]``)."""

    size: Tensor
    """Samples in the group, ``n``."""
    total: Tensor
    """Sum of the group's rewards."""
    mean: Tensor
    """Mean of the group's rewards."""
    squared_deviation: Tensor
    """``sum_j (r_j - mean)^2`` over the group."""
    constant: Tensor
    """True where every reward of the group is equal (max == min)."""


def group_stats(rewards: Tensor, group_ids: Tensor) -> GroupStats:
    """Size, sum, mean, squared deviation and constancy of each sample's group."""
    if rewards.ndim != 1 or group_ids.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            "rewards and group_ids must be 1-D tensors of the same length, got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0

    def reduce(values: Tensor, how: str) -> Tensor:
        out = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device)
        out = out.scatter_reduce(0, inverse, values, reduce=how, include_self=False)
        return out[inverse]

    size = reduce(torch.ones_like(rewards), "sum")
    total = reduce(rewards, "sum")
    mean = total / size
    squared_deviation = reduce((rewards - mean) ** 2, "sum")
    constant = reduce(rewards, "amax") == reduce(rewards, "amin")
    return GroupStats(size, total, mean, squared_deviation, constant)


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: the reward minus its group's mean, divided by the group's std.

    For sample ``i`` of group ``g`` with ``n`` samples and rewards ``r_1..r_n``::

        mean_g = (1/n) * sum_j r_j
        std_g  = sqrt( 1/(n-1) * sum_j (r_j - mean_g)^2 )    # the unbiased (Bessel-corrected)
                                                             # estimator, as torch.std's default
        A_i    = (r_i - mean_g) / (std_g + eps)              # normalize_std=True  (GRPO)
        A_i    =  r_i - mean_g                               # normalize_std=False (Dr. GRPO)

    A group whose rewards are all equal gets exactly 0 for every sample, and so does a group of one
    sample (its std is undefined and it has nothing to be compared with).
    """
    stats = group_stats(rewards, group_ids)
    rewards = rewards.to(stats.mean.dtype)
    zero = torch.zeros_like(stats.mean)
    centered = torch.where(stats.constant | (stats.size < 2), zero, rewards - stats.mean)
    if not normalize_std:
        return centered
    std = torch.sqrt(stats.squared_deviation / (stats.size - 1).clamp(min=1))
    return centered / (std + eps)


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO advantages: the reward minus its group's mean, with no std division.

    ``A_i = r_i - (1/n) * sum_j r_j`` over the sample's group (Liu et al. 2025, "Understanding
    R1-Zero-Like Training: A Critical Perspective"). A group of one sample, or whose rewards are all
    equal, gets 0.
    """
    return grpo_advantages(rewards, group_ids, normalize_std=False)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantages: the reward minus the mean of the *other* samples of its group.

    ``A_i = r_i - 1/(n-1) * sum_{j != i} r_j``, which equals ``n/(n-1) * (r_i - mean_g)``
    (Ahmadian et al. 2024, "Back to Basics"). A group of one sample has no other sample to compare
    with and gets 0; a group whose rewards are all equal gets 0.
    """
    stats = group_stats(rewards, group_ids)
    rewards = rewards.to(stats.mean.dtype)
    others = (stats.total - rewards) / (stats.size - 1).clamp(min=1)
    zero = torch.zeros_like(stats.mean)
    return torch.where(stats.constant | (stats.size < 2), zero, rewards - others)


# -- token level -----------------------------------------------------------------------------------


def _check_tokens(name: str, tensor: Tensor, mask: Tensor) -> Tensor:
    if tensor.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)} but response_mask has "
                         f"{tuple(mask.shape)}; give one entry per token column")
    return tensor.float()


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """``(x - mean) / (std + eps)`` over the entries where ``mask`` is 1; 0 elsewhere.

    ``mean`` and the unbiased (n - 1) ``std`` are taken over the masked entries of the whole
    tensor. Fewer than two masked entries, or masked entries that are all equal, give exactly 0
    (no direction to prefer); masked-out entries never contribute, even when NaN.
    """
    on = mask > 0
    values = torch.where(on, values.float(), torch.zeros_like(values, dtype=torch.float32))
    count = on.sum()
    if count < 2:
        return torch.zeros_like(values)
    mean = values.sum() / count
    centered = torch.where(on, values - mean, torch.zeros_like(values))
    kept = values[on]
    if bool((kept == kept[0]).all()):
        return torch.zeros_like(values)
    std = torch.sqrt((centered ** 2).sum() / (count - 1))
    return centered / (std + eps)


def token_rewards(rewards: Tensor, response_mask: Tensor, token_kl: Tensor | None = None,
                  kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards ``[B, T]``: the outcome reward on each row's last response token, minus
    ``kl_coef * token_kl`` on every response token (0 off the mask and for rows without response
    tokens)."""
    mask = response_mask.float()
    if rewards.ndim != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must have one value per row ({mask.shape[0]}), got shape "
                         f"{tuple(rewards.shape)}")
    on = mask > 0
    out = torch.zeros_like(mask)
    if token_kl is not None and kl_coef != 0.0:
        token_kl = _check_tokens("token_kl", token_kl, mask)
        out = torch.where(on, -kl_coef * token_kl, out)
    columns = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(on, columns, torch.full_like(columns, -1)).amax(dim=1)
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    out[rows, last[has_tokens]] += rewards.float().to(mask.device)[has_tokens]
    return out


def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = sum_{s >= t} gamma^(k(s) - k(t)) * r_s`` over response tokens ``s`` of the row, where
    ``k`` counts response tokens (holes in the mask are skipped, not discounted); 0 off the mask."""
    mask = response_mask.float()
    rewards = _check_tokens("token_rewards", token_rewards, mask)
    on = mask > 0
    out = torch.zeros_like(rewards)
    carry = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in range(rewards.shape[1] - 1, -1, -1):
        carry = torch.where(on[:, t], rewards[:, t] + gamma * carry, carry)
        out[:, t] = torch.where(on[:, t], carry, torch.zeros_like(carry))
    return out


def reinforce_pp_advantages(rewards: Tensor, response_mask: Tensor, token_kl: Tensor | None = None,
                            kl_coef: float = 0.0, gamma: float = 1.0, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (Hu 2025): discounted token returns with the KL penalty to go, whitened.

    Per response token ``t`` of sample ``i`` (``T_i`` its last response token)::

        r_t  = -kl_coef * kl_t + (R_i if t == T_i else 0)      # see token_rewards
        G_t  = sum_{s >= t} gamma^(s - t) * r_s                 # see discounted_returns
        A_t  = (G_t - mean(G)) / (std(G) + eps)                 # whiten over the batch's tokens

    No baseline and no group: a prompt may have one sample. All-equal returns (e.g. every reward
    equal and no KL) whiten to 0; masked tokens get 0 and never enter the mean or std.
    """
    per_token = token_rewards(rewards, response_mask, token_kl, kl_coef)
    return whiten(discounted_returns(per_token, response_mask, gamma), response_mask, eps)


def reinforce_pp_baseline_advantages(
    rewards: Tensor, group_ids: Tensor, response_mask: Tensor, token_kl: Tensor | None = None,
    kl_coef: float = 0.0, gamma: float = 1.0, eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++-baseline: the group-mean baseline on the outcome reward, then REINFORCE++.

    ``R_i' = R_i - mean_g`` (Dr. GRPO's centring: a group of one or whose rewards are all equal
    gets ``R_i' = 0``), then the token returns with the KL penalty to go and the batch whitening of
    ``reinforce_pp_advantages``. The group baseline removes the per-prompt difficulty; the batch
    whitening, unlike GRPO's per-group std, does not blow up the advantages of near-constant groups.
    """
    centred = dr_grpo_advantages(rewards, group_ids)
    return reinforce_pp_advantages(centred, response_mask, token_kl, kl_coef, gamma, eps)


def gae_advantages(
    rewards: Tensor, values: Tensor, response_mask: Tensor, token_kl: Tensor | None = None,
    kl_coef: float = 0.0, gamma: float = 1.0, lam: float = 0.95, whiten_advantages: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens; ``(A, returns)``.

    With ``r_t`` from ``token_rewards`` (outcome on the last token, KL penalty to go), ``V_t`` the
    critic's value at response token ``t`` and ``V`` after the last response token 0 (terminal)::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A + V                         # before whitening: the critic's targets

    ``t + 1`` is the next response token (holes in the mask are skipped). With
    ``whiten_advantages`` the advantages (not the returns) are whitened over the batch's response
    tokens. Masked tokens get 0 in both outputs and their values are never read.
    """
    mask = response_mask.float()
    values = _check_tokens("values", values, mask)
    on = mask > 0
    values = torch.where(on, values, torch.zeros_like(values))
    per_token = token_rewards(rewards, mask, token_kl, kl_coef)
    advantages = torch.zeros_like(per_token)
    next_value = torch.zeros(mask.shape[0], dtype=per_token.dtype, device=per_token.device)
    next_advantage = torch.zeros_like(next_value)
    for t in range(mask.shape[1] - 1, -1, -1):
        delta = per_token[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(on[:, t], advantage, torch.zeros_like(advantage))
        next_value = torch.where(on[:, t], values[:, t], next_value)
        next_advantage = torch.where(on[:, t], advantage, next_advantage)
    returns = advantages + values
    if whiten_advantages:
        advantages = whiten(advantages, mask, eps)
    return advantages, returns


# -- rows kept out ---------------------------------------------------------------------------------


def take_rows(inputs: TokenAdvantageInputs, index: Tensor) -> TokenAdvantageInputs:
    """The token-level inputs of the rows ``index`` only (the others are not part of the batch the
    estimator sees: their rewards, tokens and values enter no mean, std or whitening)."""
    def rows(tensor: Tensor | None) -> Tensor | None:
        return None if tensor is None else tensor.index_select(0, index)

    return TokenAdvantageInputs(rewards=inputs.rewards.index_select(0, index),
                                group_ids=inputs.group_ids.index_select(0, index),
                                response_mask=inputs.response_mask.index_select(0, index),
                                logprobs=inputs.logprobs.index_select(0, index),
                                ref_logprobs=rows(inputs.ref_logprobs), values=rows(inputs.values))


def put_rows(values: Tensor, index: Tensor, size: int) -> Tensor:
    """``values`` (one row per entry of ``index``) at rows ``index`` of a zero tensor of ``size``
    rows: the rows kept out get advantage (and return) 0."""
    out = torch.zeros((size, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_copy(0, index.to(values.device), values)
