"""Sequence packing: a padded token batch laid out as a few full rows, and values laid back.

A training batch is padded to its longest prompt plus its longest response
(``relax.algo.batch``), so every row pays for the longest one. Packing puts the real tokens of
several rows side by side in one row of ``capacity`` columns (first-fit, longest rows first), each
keeping its own position ids from 0; a model whose attention reads a restart of the position ids
as a new sequence (Hugging Face models through ``transformers.masking_utils``, called with no
attention mask) then computes exactly what it computes on the padded rows, on fewer columns. On
the tiny CPU preset a padded step of 128 rows carries 25-40% padding; packed, the train step takes
about a quarter less time (``bench/learn_tiny.py``).

Token-aligned values computed on the packed rows (log-probs, entropies) go back to the padded
layout with ``PackedRows.unpack``, differentiably. A row's first token has no context in either
layout; ``PackedRows.starts`` marks it so callers zero it, as the padded layout's column 0 is.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedRows:
    """The packed layout of a ``[B, T]`` batch and the maps between the two layouts."""

    input_ids: Tensor
    """``[bins, capacity]`` token ids; unused slots hold ``pad_id``."""
    position_ids: Tensor
    """``[bins, capacity]`` each packed row's own positions (0 at its first token); 0 in unused slots."""
    source: Tensor
    """Flat index into the padded ``[B * T]`` layout of every real token."""
    target: Tensor
    """Flat index into the packed ``[bins * capacity]`` layout of the same tokens, in the same order."""
    shape: tuple[int, int]
    """``(B, T)``: the padded layout."""

    @property
    def starts(self) -> Tensor:
        """``[bins, capacity]`` True at each row's first token (and at unused slots)."""
        return self.position_ids == 0

    def unpack(self, values: Tensor) -> Tensor:
        """Packed ``[bins, capacity]`` values back in the padded ``[B, T]`` layout, 0 at padding
        (differentiable: gradients flow back to ``values``)."""
        rows, width = self.shape
        picked = values.reshape(-1).index_select(0, self.target)
        return picked.new_zeros(rows * width).index_copy(0, self.source, picked).view(rows, width)


def pack_rows(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, pad_id: int = 0,
              capacity: int | None = None) -> PackedRows:
    """Pack the real tokens of every row (``attention_mask`` 1; contiguous within a row, as the
    collated batch has them) into rows of ``capacity`` columns (default: twice the longest row, so
    most packed rows take two or more rows while attention over a packed row stays within four
    times a padded row's). A row is never split across packed rows."""
    rows, width = input_ids.shape
    lengths = attention_mask.sum(dim=1).tolist()
    longest = max(lengths, default=0)
    capacity = max(int(capacity or 2 * longest), longest, 1)
    # Best fit, longest rows first: each row goes to the packed row with the least room that
    # still holds it (``rooms`` is kept sorted by room).
    bin_of, offset_of = [0] * rows, [0] * rows
    rooms: list[tuple[int, int]] = []
    count = 0
    for row in sorted(range(rows), key=lambda i: -lengths[i]):
        need = lengths[row]
        at = bisect.bisect_left(rooms, (need, -1))
        if at < len(rooms):
            room, chosen = rooms.pop(at)
        else:
            room, chosen, count = capacity, count, count + 1
        bin_of[row], offset_of[row] = chosen, capacity - room
        bisect.insort(rooms, (room - need, chosen))
    device = input_ids.device
    row_index, column = attention_mask.nonzero(as_tuple=True)
    first = attention_mask.argmax(dim=1)  # the first real column of each row
    start = torch.tensor(bin_of, device=device) * capacity + torch.tensor(offset_of, device=device)
    target = start[row_index] + column - first[row_index]
    source = row_index * width + column
    packed_ids = input_ids.new_full((count * capacity,), pad_id).index_copy(0, target, input_ids.reshape(-1)[source])
    packed_positions = position_ids.new_zeros(count * capacity).index_copy(0, target, position_ids.reshape(-1)[source])
    return PackedRows(input_ids=packed_ids.view(count, capacity), position_ids=packed_positions.view(count, capacity),
                      source=source, target=target, shape=(rows, width))
