"""Which prompts each step trains on: a pure function of the seed and the step.

Because the order depends on nothing else, a resumed run (or a run in another placement mode)
sees exactly the same prompts at the same step, and the "data position" saved in a checkpoint is
simply the step.
"""

from __future__ import annotations

import random
from typing import Any


class PromptSchedule:
    """Epoch-wise shuffled prompt indices, ``prompts_per_step`` per step."""

    def __init__(self, size: int, prompts_per_step: int, seed: int, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError("the training data set is empty; give it at least one prompt")
        self.size = size
        self.per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: steps only move forward
        return self._orders[epoch]

    def indices(self, step: int) -> list[int]:
        """Data-set indices of the prompts of ``step`` (crossing epoch boundaries as needed)."""
        start = step * self.per_step
        return [self._order(pos // self.size)[pos % self.size] for pos in range(start, start + self.per_step)]


def sampling_seed(run_seed: int, step: int) -> int:
    """The generation seed of a step: the same in every placement mode and after a resume."""
    return (run_seed * 1_000_003 + step * 7919) % (2**31 - 1)


def prompt_rows(dataset: Any, indices: list[int], prompt_key: str, label_key: str) -> list[dict[str, Any]]:
    """The data set rows of a step, checked for the prompt column."""
    rows = []
    for index in indices:
        row = dataset[index]
        if prompt_key not in row:
            raise KeyError(f"row {index} of the training data has no '{prompt_key}' column (data.prompt_key); "
                           f"it has: {', '.join(sorted(row))}")
        rows.append({"index": index, "prompt": str(row[prompt_key]), "label": row.get(label_key)})
    return rows
