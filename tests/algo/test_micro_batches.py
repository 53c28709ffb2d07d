"""Token-budget micro-batches (``relax.algo.micro_batches``): every row once, no group over the
budget unless it is one row longer than it, groups and data-parallel shards balanced in tokens."""

from __future__ import annotations

import random

import pytest
import torch

from relax.algo.micro_batches import (
    balanced_shards,
    data_parallel_shards,
    micro_batch_parts,
    pad_fraction,
    strided_counts,
    token_budget_groups,
)

#: A long tail: most rows short, a few near the longest.
LONG_TAIL = [5, 6, 4, 60, 5, 7, 4, 58, 6, 5, 5, 4, 62, 6, 5, 4]


def _check_groups(lengths, budget, groups):
    rows = sorted(r for g in groups for r in g)
    assert rows == list(range(len(lengths)))  # every row exactly once
    for group in groups:
        assert sum(lengths[r] for r in group) <= budget or len(group) == 1


@pytest.mark.parametrize("budget", [1, 30, 64, 100, 1000])
def test_every_row_once_and_no_group_over_the_budget(budget):
    groups = token_budget_groups(LONG_TAIL, budget)
    _check_groups(LONG_TAIL, budget, groups)
    if budget == 1:
        assert len(groups) == len(LONG_TAIL)  # every row alone
    if budget == 1000:
        assert len(groups) == 1


def test_random_lengths_hold_the_rules_and_use_few_groups():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(0, 80) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(10, 200)
        groups = token_budget_groups(lengths, budget)
        _check_groups(lengths, budget, groups)
        # within one group of the lower bound set by the total (rows longer than the budget each alone)
        over = [n for n in lengths if n > budget]
        bound = len(over) + -(-sum(n for n in lengths if n <= budget) // budget)
        assert len(groups) <= max(bound, 1) * 2


def test_a_row_longer_than_the_budget_stands_alone():
    groups = token_budget_groups([10, 200, 10], budget=50)
    assert [1] in groups
    _check_groups([10, 200, 10], 50, groups)


def test_groups_are_balanced_in_tokens():
    groups = token_budget_groups(LONG_TAIL, budget=100)
    sums = [sum(LONG_TAIL[r] for r in g) for g in groups]
    assert len(groups) == 3  # 271 tokens under 100 each
    assert max(sums) - min(sums) <= max(LONG_TAIL)
    # the three long rows land in different groups
    assert sorted(len({3, 7, 12} & set(g)) for g in groups) == [1, 1, 1]


def test_min_groups_gives_every_rank_the_same_count():
    groups = token_budget_groups([5, 6, 7], budget=1000, min_groups=3)
    assert sorted(map(len, groups)) == [1, 1, 1]
    groups = token_budget_groups([5], budget=1000, min_groups=2)
    assert sorted(map(len, groups)) == [0, 1]


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match="budget"):
        token_budget_groups([1, 2], budget=0)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_shards_take_every_row_once_with_even_counts_and_tokens(ranks):
    shards = balanced_shards(LONG_TAIL, ranks)
    assert sorted(r for s in shards for r in s) == list(range(len(LONG_TAIL)))
    counts = [len(s) for s in shards]
    assert max(counts) - min(counts) <= 1
    sums = [sum(LONG_TAIL[r] for r in s) for s in shards]
    assert max(sums) - min(sums) <= max(LONG_TAIL)
    if ranks == 2:  # strided dealing (rows[d::2]) gives 150 against 96; 144 against 102 is the best
        assert max(sums) - min(sums) == 42  # with 8 rows each (the two longest rows together and the 4 shortest)


def test_random_shards_stay_even():
    rng = random.Random(1)
    for _ in range(200):
        lengths = [rng.randint(1, 80) for _ in range(rng.randint(1, 40))]
        ranks = rng.randint(1, 5)
        shards = balanced_shards(lengths, ranks)
        assert sorted(r for s in shards for r in s) == list(range(len(lengths)))
        counts = [len(s) for s in shards]
        assert max(counts) - min(counts) <= 1


def test_parts_of_a_batch_hold_their_rows_trimmed():
    lengths = [2, 7, 3, 8]
    width = 10
    mask = torch.zeros(4, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n:] = 1
    ids = torch.arange(40).view(4, width) * mask

    class Batch:  # the two TrainBatch methods micro_batch_parts uses, on a real mask
        def __init__(self, ids, mask):
            self.input_ids, self.attention_mask = ids, mask

        def select(self, rows):
            return Batch(self.input_ids[rows], self.attention_mask[rows])

        def used_columns(self):
            used = self.attention_mask.any(dim=0).nonzero()
            return slice(int(used[0]), int(used[-1]) + 1)

        def select_columns(self, cols):
            return Batch(self.input_ids[:, cols], self.attention_mask[:, cols])

    seen = []
    for rows, cols, part in micro_batch_parts(Batch(ids, mask), rows=99, budget=10):
        assert int(part.attention_mask.sum()) <= 10
        assert torch.equal(part.input_ids, ids[rows][:, cols])
        assert bool(part.attention_mask[:, 0].any())  # trimmed: the first column holds a token
        seen += rows.tolist()
    assert sorted(seen) == [0, 1, 2, 3]


def test_pad_fraction():
    assert pad_fraction(100, 75) == pytest.approx(0.25)
    assert pad_fraction(0, 0) == 0.0


@pytest.mark.parametrize(("ranks", "updates"), [(2, 1), (2, 2), (3, 2), (4, 3)])
def test_data_parallel_shards_keep_the_strided_counts_per_mini_batch_and_even_the_tokens(ranks, updates):
    rows = len(LONG_TAIL)
    shards = data_parallel_shards(LONG_TAIL, ranks, updates)
    assert sorted(r for s in shards for r in s) == list(range(rows))
    bounds = [round(i * rows / updates) for i in range(updates + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        held = [[r for r in shard if lo <= r < hi] for shard in shards]
        assert [len(h) for h in held] == strided_counts(lo, hi, ranks)
        strided = [sum(LONG_TAIL[r] for r in range(lo, hi) if r % ranks == d) for d in range(ranks)]
        sums = [sum(LONG_TAIL[r] for r in h) for h in held]
        assert max(sums) - min(sums) <= max(strided) - min(strided)
    for shard in shards:
        assert shard == sorted(shard)


def test_strided_counts_are_those_of_rows_d_mod_ranks():
    assert strided_counts(0, 16, 3) == [6, 5, 5]
    assert strided_counts(5, 11, 4) == [len([i for i in range(5, 11) if i % 4 == d]) for d in range(4)]


def test_counts_that_do_not_add_up_are_refused():
    with pytest.raises(ValueError, match="counts"):
        balanced_shards([1, 2, 3], 2, [1, 1])
