"""DAPO's dynamic sampling: which groups of a step carry a learning signal.

A group whose rewards are all equal (every answer right, or every answer wrong) has a zero
group-relative advantage for every sample, so it adds nothing to the gradient but dilutes the
batch. DAPO (Yu et al. 2025) drops such groups and samples more prompts until the batch is full;
this module decides what to drop, the runtime does the over-sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relax.algo.advantages import group_stats

__all__ = ["GroupFilter", "filter_groups"]


@dataclass(frozen=True)
class GroupFilter:
    """The verdict on one step's groups."""

    keep: Tensor
    """``[B]`` bool: the samples whose group is kept."""
    kept_groups: Tensor
    """The ids of the kept groups, ascending."""
    dropped_groups: Tensor
    """The ids of the dropped groups, ascending."""
    filter_rate: float
    """Dropped groups / all groups (0 for an empty batch)."""


def filter_groups(rewards: Tensor, group_ids: Tensor) -> GroupFilter:
    """Keep the groups whose rewards are not all equal.

    A group of one sample is "all equal" and is dropped: it has no other sample to be compared
    with (its group-relative advantage is 0). Equality is exact, as in ``group_stats``.
    """
    stats = group_stats(rewards, group_ids)
    keep = ~stats.constant
    ids = torch.unique(group_ids)
    kept = torch.unique(group_ids[keep])
    dropped = ids[~torch.isin(ids, kept)]
    rate = float(dropped.numel()) / float(ids.numel()) if ids.numel() else 0.0
    return GroupFilter(keep=keep, kept_groups=kept, dropped_groups=dropped, filter_rate=rate)
