"""What the synthetic data sets share: a fixed number of problems, item ``i`` drawn from a random
generator seeded by the set's name, its seed and ``i`` only, so every process (and every rerun)
sees the same item ``i`` without storing anything."""

from __future__ import annotations

import random


def item_rng(name: str, seed: int, size: int, index: int) -> tuple[int, random.Random]:
    """``(index, generator)`` of item ``index`` of a set of ``size`` problems (negative indices count
    from the end, as for a list); ``IndexError`` outside the set."""
    if not -size <= index < size:
        raise IndexError(f"index {index} is out of range for {size} problems")
    index %= size
    return index, random.Random(f"relax-{name}:{seed}:{index}")
