"""Converting columns between what roles hold and what TransferQueue stores.

Roles write a column as one of three kinds, and get the same kind back (``relax.bus.payloads``
stores them):

- **dense**: a ``Tensor`` whose first dimension is the row; every row has the same shape.
- **ragged**: a ``list[Tensor]``, one tensor per row, shapes may differ (token ids of different
  lengths, images of different sizes).
- **objects**: a ``list`` of picklable non-tensors (strings, dicts).

This module needs only torch: a process that hands its rows over in memory never imports
TransferQueue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import torch

from relax.bus.errors import BusError

#: One column of a batch, as a role writes it and reads it back.
Column: TypeAlias = torch.Tensor | list[torch.Tensor] | list[Any]


def column_nbytes(value: Column) -> int:
    """Bytes of tensor payload in a column; non-tensor values count as 0 (they are small by contract)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return sum(r.numel() * r.element_size() for r in value.unbind())
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(v.numel() * v.element_size() for v in value if isinstance(v, torch.Tensor))
    return 0


def pad_rows(
    rows: Sequence[torch.Tensor], pad_value: float = 0, side: Literal["right", "left"] = "right"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack rows that differ only in their first dimension, padding that dimension.

    Returns ``(padded, lengths)``: ``padded`` has shape ``[len(rows), max_len, *rest]`` and
    ``lengths[i]`` is ``rows[i].shape[0]``. ``side="left"`` puts the padding first, as prompts
    for generation want; ``"right"`` puts it last, as responses want. The bus does not guess.
    """
    if not rows:
        raise BusError("cannot pad an empty list of rows")
    if len({tuple(r.shape[1:]) for r in rows}) != 1 or rows[0].ndim == 0:
        raise BusError(
            "pad_rows needs rows of at least 1 dimension that differ only in their first dimension; "
            f"got shapes {[tuple(r.shape) for r in rows[:4]]}"
        )
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    max_len = int(lengths.max())
    padded = rows[0].new_full((len(rows), max_len, *rows[0].shape[1:]), pad_value)
    for i, row in enumerate(rows):
        n = row.shape[0]
        if side == "right":
            padded[i, :n] = row
        else:
            padded[i, max_len - n :] = row
    return padded, lengths
