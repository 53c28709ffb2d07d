"""Group-relative advantage estimators: tensors in, tensors out.

Every function here takes one scalar reward per sample (``rewards[B]``) and the group each sample
belongs to (``group_ids[B]``: samples of the same prompt share an id; ids need not be contiguous or
sorted) and returns one advantage per sample (``[B]``, in the rewards' floating dtype, float32 for
integer rewards). The advantage applies to every response token of its sample (outcome reward).

No state, no configuration reads, no Ray: the ``relax_plugins.advantages`` plugins call these with
options taken from the run spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GroupStats", "dr_grpo_advantages", "group_stats", "grpo_advantages", "rloo_advantages"]


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
