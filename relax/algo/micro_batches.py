"""Micro-batches by token budget: rows grouped by how many tokens they hold, not by a row count.

A step's rows vary widely in length (a long tail of responses near ``max_new_tokens`` among many
short ones). Cut into a fixed number of rows per micro-batch, one micro-batch holds a few long
rows and peaks in memory while the next holds short ones and leaves the device idle.
``roles.<role>.max_tokens_per_micro_batch`` instead bounds the tokens of a micro-batch (the real
tokens, prompt and response, that a packed forward holds), so memory is set by the budget and every
micro-batch fills it about equally. veRL's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu`` and
NeMo-RL's dynamic batching do the same.

Two pure functions over row lengths (no tensors, so they are tested exactly):

- ``token_budget_groups(lengths, budget, min_groups)``: the rows in as few groups as the budget
  allows (at least ``min_groups``, so data-parallel ranks can all run the same number of
  micro-batches, which a sharded model's collectives need), the groups as equal in tokens as the
  largest-first greedy makes them. Every row is in one group; no group holds more than ``budget``
  tokens unless it is a single row longer than the budget (a row is never split).
- ``balanced_shards(lengths, ranks)``: the rows of a batch dealt to data-parallel ranks with row
  counts that differ by at most one and token sums as even as the same greedy makes them, so no
  rank waits on another holding all the long rows; ``data_parallel_shards`` does it mini-batch by
  mini-batch with the row counts of the strided deal (what ``relax.runtime.worker.ranks`` uses).

``micro_batches(batch, rows, budget)`` applies the first to a ``TrainBatch``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["balanced_shards", "data_parallel_shards", "micro_batch_parts", "micro_batches", "pad_fraction",
           "row_lengths", "strided_counts", "token_budget_groups"]


def _fewest_groups(lengths: Sequence[int], budget: int) -> int:
    """Groups first-fit decreasing needs to hold ``lengths`` under ``budget`` (a longer row alone)."""
    rooms: list[int] = []
    for length in sorted(lengths, reverse=True):
        for i, room in enumerate(rooms):
            if length <= room:
                rooms[i] -= length
                break
        else:
            rooms.append(max(budget - length, 0))
    return len(rooms)


def _greedy(lengths: Sequence[int], groups: int, budget: int | None,
            cap: Sequence[int] | None) -> list[list[int]] | None:
    """Largest row first into the group with the fewest tokens that still has room (``budget``
    tokens, ``cap[g]`` rows); None when some row fits no group (a row longer than ``budget`` goes
    only to an empty group)."""
    # (tokens, tie-break, rows, group): among groups as full in tokens, one with fewer free row slots
    # first, so the long rows go where few rows will follow them.
    def entry(tokens: int, count: int, g: int) -> tuple[int, int, int, int]:
        return (tokens, count if cap is None else cap[g] - count, count, g)

    heap = [entry(0, 0, g) for g in range(groups)]
    heapq.heapify(heap)
    out: list[list[int]] = [[] for _ in range(groups)]
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        length, skipped, placed = lengths[row], [], False
        while heap:
            item = heapq.heappop(heap)
            tokens, _, count, g = item
            fits = (budget is None or tokens + length <= budget or count == 0) and (cap is None or count < cap[g])
            if fits:
                out[g].append(row)
                heapq.heappush(heap, entry(tokens + length, count + 1, g))
                placed = True
                break
            skipped.append(item)
        for item in skipped:
            heapq.heappush(heap, item)
        if not placed:
            return None
    return [sorted(group) for group in out]


def token_budget_groups(lengths: Sequence[int], budget: int, min_groups: int = 1) -> list[list[int]]:
    """Row indices grouped so each group holds at most ``budget`` tokens (a row longer than the budget
    alone), in at least ``min_groups`` groups and otherwise as few as first-fit decreasing finds,
    balanced in tokens largest row first. Groups are listed longest first, each in row order; a
    group is empty only when there are fewer rows than ``min_groups``."""
    if budget < 1:
        raise ValueError(f"the token budget must be >= 1, got {budget}")
    if any(length < 0 for length in lengths):
        raise ValueError("row lengths must be >= 0")
    if not lengths:
        return [[] for _ in range(max(min_groups, 0))]
    groups = max(_fewest_groups(lengths, budget), min_groups, 1)
    while True:
        out = _greedy(lengths, groups, budget, None)
        if out is not None:  # the balanced greedy may need a group more than first-fit did
            return sorted(out, key=lambda g: -sum(lengths[r] for r in g))
        groups += 1


def balanced_shards(lengths: Sequence[int], ranks: int, counts: Sequence[int] | None = None) -> list[list[int]]:
    """Row indices dealt to ``ranks`` data-parallel ranks, token sums as even as largest-first greedy
    makes them, each shard in row order: ``counts[d]`` rows to rank ``d`` (they must add up to the
    rows), by default counts that differ by at most one."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if counts is None:
        counts = [len(range(d, len(lengths), ranks)) for d in range(ranks)]
    if len(counts) != ranks or sum(counts) != len(lengths) or min(counts, default=0) < 0:
        raise ValueError(f"counts {list(counts)} must give each of the {ranks} ranks a share of the "
                         f"{len(lengths)} rows")
    out = _greedy(lengths, ranks, None, counts)
    assert out is not None  # the counts add up to the rows, so every row finds a rank with room
    return out


def strided_counts(lo: int, hi: int, ranks: int) -> list[int]:
    """Rows of ``[lo, hi)`` whose index is ``d`` modulo ``ranks``, for each ``d``: how many rows of a
    mini-batch each rank holds when a batch is dealt ``rows[d::ranks]``."""
    return [len(range(lo + (d - lo) % ranks, hi, ranks)) for d in range(ranks)]


def data_parallel_shards(lengths: Sequence[int], ranks: int, updates: int = 1) -> list[list[int]]:
    """A step's rows dealt to ``ranks`` data-parallel ranks, mini-batch by mini-batch
    (``relax_plugins.trainer.steps.minibatch_bounds`` over ``updates``): each rank holds as many rows
    of each mini-batch as the strided deal ``rows[d::ranks]`` gives it (so its own mini-batches cut
    at the same places), but which rows, the long ones spread over the ranks (``balanced_shards``),
    so no rank waits on another holding all the long rows. Each shard in row order."""
    rows = len(lengths)
    bounds = [round(i * rows / updates) for i in range(updates + 1)]
    shards: list[list[int]] = [[] for _ in range(ranks)]
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            continue
        dealt = balanced_shards(lengths[lo:hi], ranks, strided_counts(lo, hi, ranks))
        for d, part in enumerate(dealt):
            shards[d] += [lo + r for r in part]
    return shards


def row_lengths(batch: Any) -> list[int]:
    """Real tokens (prompt and response) of each row of a ``TrainBatch``."""
    return [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]


def micro_batch_parts(batch: Any, rows: int, budget: int | None = None,
                      min_groups: int = 1) -> Iterator[tuple[Any, slice, Any]]:
    """The micro-batches of a ``TrainBatch`` with the rows and columns of ``batch`` each holds (where
    a per-part result goes back): consecutive parts of ``rows`` rows, or with ``budget``
    (``max_tokens_per_micro_batch``) groups of at most that many tokens (``token_budget_groups``,
    at least ``min_groups`` of them; a row index tensor then). Each part is trimmed of columns that
    are padding in all its rows."""
    if budget is None:
        yield from batch.parts(rows)
        return
    import torch

    for group in token_budget_groups(row_lengths(batch), budget, min_groups):
        if not group:
            continue
        index = torch.tensor(group, dtype=torch.long)
        part = batch.select(index)
        columns = part.used_columns()
        yield index, columns, part.select_columns(columns)


def micro_batches(batch: Any, rows: int, budget: int | None = None, min_groups: int = 1) -> Iterator[Any]:
    """``micro_batch_parts`` without the indices: the micro-batches a train step accumulates over."""
    for _, _, part in micro_batch_parts(batch, rows, budget, min_groups):
        yield part


def pad_fraction(slots: int, tokens: int) -> float:
    """``train/pad_frac``: the share of the token slots a forward pass computed that held padding
    (``slots`` computed, ``tokens`` of them real); 0 for no slots."""
    return 0.0 if slots <= 0 else max(0.0, 1.0 - tokens / slots)
