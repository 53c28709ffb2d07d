"""Converting columns between what roles hold and what TransferQueue stores.

Roles write a column as one of three kinds, and get the same kind back (``relax.bus.payloads``
stores them; ``encode_columns`` builds the ``TensorDict`` TransferQueue's own API speaks):

- **dense**: a ``Tensor`` whose first dimension is the row; every row has the same shape.
- **ragged**: a ``list[Tensor]``, one tensor per row, shapes may differ (token ids of different
  lengths, images of different sizes). Stored as a nested tensor: jagged layout when only the
  first row dimension varies, strided layout otherwise.
- **objects**: a ``list`` of picklable non-tensors (strings, dicts), stored as a ``NonTensorStack``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

import torch

from relax.bus.errors import BusError
from relax.bus.transferqueue import NonTensorStack, TensorDict

#: One column of a batch, as a role writes it and reads it back.
Column: TypeAlias = torch.Tensor | list[torch.Tensor] | list[Any]


def encode_columns(columns: Mapping[str, Column], num_rows: int) -> TensorDict:
    """Pack columns into the ``TensorDict`` TransferQueue stores, checking each has ``num_rows`` rows."""
    if not columns:
        raise BusError("no columns given; write at least one field")
    packed: dict[str, Any] = {}
    for name, value in columns.items():
        if isinstance(value, torch.Tensor):
            rows = value.size(0) if value.is_nested else (value.shape[0] if value.ndim else None)
            if rows is None:
                raise BusError(f"field {name!r} is a 0-d tensor; give one value per row ([{num_rows}, ...])")
            packed[name] = value
        elif isinstance(value, (list, tuple)):
            rows = len(value)
            packed[name] = _pack_list(name, list(value))
        else:
            raise BusError(
                f"field {name!r} is a {type(value).__name__}; give a Tensor or a list with one entry per row"
            )
        if rows != num_rows:
            raise BusError(
                f"field {name!r} has {rows} rows but the batch has {num_rows} (one metadata entry per row)"
            )
    return TensorDict(packed, batch_size=[num_rows])


def _pack_list(name: str, values: list[Any]) -> torch.Tensor | NonTensorStack:
    tensors = [isinstance(v, torch.Tensor) for v in values]
    if not any(tensors):
        return NonTensorStack(*values)
    if not all(tensors):
        raise BusError(f"field {name!r} mixes tensors and non-tensors; a column holds one kind")
    if len({v.dtype for v in values}) != 1 or len({v.ndim for v in values}) != 1:
        raise BusError(
            f"field {name!r}: all rows of a ragged column need the same dtype and number of dimensions"
        )
    if values[0].ndim == 0:
        return torch.stack(values)
    if len({tuple(v.shape[1:]) for v in values}) == 1:
        return torch.nested.nested_tensor(values, layout=torch.jagged)
    # More than one ragged dimension (e.g. images): only the strided layout can hold it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage.*")
        return torch.nested.nested_tensor(values, layout=torch.strided)


def column_nbytes(value: Column | TensorDict | NonTensorStack) -> int:
    """Bytes of tensor payload in a column; non-tensor values count as 0 (they are small by contract)."""
    if isinstance(value, TensorDict):
        return sum(column_nbytes(v) for v in value.values())
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
