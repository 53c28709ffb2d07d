"""Sequence packing (``relax.algo.packing``): every real token of a padded batch lands once, rows
stay whole and keep their positions, and values go back to the padded layout with gradients."""

from __future__ import annotations

import pytest
import torch

from relax.algo.packing import pack_rows


def _padded(lengths: list[int], width: int, left: int, pad_id: int = 0):
    """Rows of ``lengths`` real tokens: the first ``left`` rows left-padded, the rest right-padded;
    token ids encode (row, column) so misplaced tokens show."""
    rows = len(lengths)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, n in enumerate(lengths):
        start = width - n if i < left else 0
        ids[i, start:start + n] = 1000 * (i + 1) + torch.arange(start, start + n)
        mask[i, start:start + n] = 1
    return ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)


def test_every_row_lands_whole_once_with_its_positions():
    lengths = [7, 2, 5, 1, 7, 3, 4, 6, 0, 2]
    ids, mask, positions = _padded(lengths, width=9, left=5)
    packed = pack_rows(ids, mask, positions, pad_id=-1)
    capacity = packed.input_ids.shape[1]
    assert capacity == 2 * max(lengths)
    assert packed.input_ids.numel() < ids.numel()  # padding went away
    found = {}
    for b, row in enumerate(packed.input_ids.tolist()):
        for col, token in enumerate(row):
            if token != -1:
                found.setdefault(token // 1000 - 1, []).append((b, col, packed.position_ids[b, col].item()))
    assert sorted(found) == [i for i, n in enumerate(lengths) if n]
    for i, slots in found.items():
        assert len(slots) == lengths[i]
        assert len({b for b, _, _ in slots}) == 1  # a row is never split
        cols = [c for _, c, _ in slots]
        assert cols == list(range(cols[0], cols[0] + lengths[i]))  # contiguous, in order
        assert [p for _, _, p in slots] == list(range(lengths[i]))  # its own positions from 0
    assert packed.starts.sum().item() >= sum(1 for n in lengths if n)


def test_unpack_puts_values_back_and_carries_gradients():
    ids, mask, positions = _padded([3, 5, 1, 4], width=6, left=2)
    packed = pack_rows(ids, mask, positions, capacity=8)
    assert packed.input_ids.shape == (2, 8)  # 5+3, 4+1
    values = packed.input_ids.float().requires_grad_()
    back = packed.unpack(values)
    assert torch.equal(back, (ids * mask).float())
    back.sum().backward()
    assert torch.equal(values.grad, (packed.input_ids != 0).float())  # unused slots get no gradient


def test_a_capacity_below_the_longest_row_grows_to_it():
    ids, mask, positions = _padded([6, 2], width=6, left=0)
    packed = pack_rows(ids, mask, positions, capacity=3)
    assert packed.input_ids.shape[1] == 6


@pytest.mark.parametrize("rows", [1, 64])
def test_best_fit_fills_packed_rows(rows):
    generator = torch.Generator().manual_seed(rows)
    lengths = torch.randint(1, 40, (rows,), generator=generator).tolist()
    ids, mask, positions = _padded(lengths, width=40, left=rows // 2)
    packed = pack_rows(ids, mask, positions)
    bins, capacity = packed.input_ids.shape
    assert sum(lengths) <= bins * capacity
    # no row was opened while an earlier one could hold the row that opened it: at most one
    # packed row is half full or less
    assert bins <= 2 * sum(lengths) / capacity + 1
