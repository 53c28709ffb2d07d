"""The small records that cross the bus API: per-row metadata, a fetched batch, counts.

They are plain dataclasses so a role can log, pickle or hand them to another Ray actor freely.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from relax.bus.columns import Column, pad_rows
from relax.bus.errors import BusError

if TYPE_CHECKING:  # the records themselves need only torch: no TransferQueue in a process without a bus
    from relax.bus.transferqueue import BatchMeta


@dataclass(frozen=True)
class RowMeta:
    """Small per-row metadata that travels with a row from its producer to every consumer.

    It travels in the row's payload as its tag dict (the bus's own field ``__row_meta__``), so a
    consumer gets it back with the row without asking for it. Keep it small: every reader of the
    row reads it.
    """

    policy_version: int
    """Version of the policy that generated the row; the staleness gate compares it to the step."""
    sample_id: str
    """Stable id of the sample across roles, for logs and traces."""
    trace: dict[str, str] = field(default_factory=dict)
    """OpenTelemetry carrier (``propagate.inject(carrier)``), so one trace follows the row."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Any other small, picklable values a producer wants consumers to see (e.g. a group id): every
    key of a tag but the three above."""

    def to_tag(self) -> dict[str, Any]:
        """The flat dict stored as the row's TransferQueue tag."""
        tag = dict(self.extra)
        tag.update(policy_version=self.policy_version, sample_id=self.sample_id, trace=dict(self.trace))
        return tag

    @classmethod
    def from_tag(cls, tag: Mapping[str, Any]) -> RowMeta:
        """Rebuild from a tag; raises ``BusError`` naming what is missing. (Every row of every step
        passes here: one copy of the tag becomes ``extra``, rather than a comprehension over it.)"""
        extra = dict(tag)
        try:
            policy_version, sample_id = int(extra.pop("policy_version")), str(extra.pop("sample_id"))
        except KeyError:
            missing = [k for k in ("policy_version", "sample_id") if k not in tag]
            raise BusError(f"row metadata {dict(tag)!r} lacks required key(s) {missing}") from None
        trace = extra.pop("trace", None)
        return cls(policy_version, sample_id, dict(trace) if trace else {}, extra)

    @classmethod
    def coerce(cls, value: RowMeta | Mapping[str, Any]) -> RowMeta:
        """Accept either a ``RowMeta`` or a plain dict with at least ``policy_version`` and ``sample_id``."""
        return value if isinstance(value, RowMeta) else cls.from_tag(value)


@dataclass(frozen=True)
class RowHandle:
    """Opaque reference to rows already on the bus, for ``Bus.write_fields``.

    Picklable: a role may hand it to another actor that computes the new columns.
    """

    partition: str
    batch_meta: BatchMeta = field(repr=False)

    def __len__(self) -> int:
        return self.batch_meta.size


@dataclass
class BusBatch:
    """Rows a consumer task took from one partition: their columns, their metadata and a handle.

    ``fields[name]`` is:

    - a dense ``Tensor`` of shape ``[rows, *row_shape]`` for a field its producer wrote as a tensor;
    - a ``list[Tensor]`` (one per row, exact shapes) for a field written as a list of tensors
      (variable length); ``padded(name)`` turns it into a padded tensor plus lengths;
    - a ``list`` of Python objects for a field written as a list of non-tensors (e.g. strings).

    The kind therefore depends only on how the producer wrote the field, never on the lengths
    that happen to be in one batch.
    """

    partition: str
    task: str
    fields: dict[str, Column]
    meta: list[RowMeta]
    handle: RowHandle | None
    """Where the rows are on the bus (for ``write_fields``); None for rows handed over in memory."""

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, name: str) -> Column:
        return self.fields[name]

    def select(self, indices: Sequence[int]) -> BusBatch:
        """These rows, only ``indices`` of them and in that order (columns, metadata and handle)."""
        index = torch.tensor(list(indices), dtype=torch.long)
        fields = {name: value[index] if isinstance(value, torch.Tensor) else [value[i] for i in indices]
                  for name, value in self.fields.items()}
        handle = (None if self.handle is None else
                  RowHandle(self.handle.partition, self.handle.batch_meta.select_samples(list(indices))))
        return BusBatch(partition=self.partition, task=self.task, fields=fields,
                        meta=[self.meta[i] for i in indices], handle=handle)

    def padded(
        self, name: str, pad_value: float = 0, side: Literal["right", "left"] = "right"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A ragged field as ``(padded [rows, max_len, ...], lengths [rows])``; see ``pad_rows``."""
        value = self.fields[name]
        if isinstance(value, torch.Tensor):
            raise BusError(f"field {name!r} is already dense ({tuple(value.shape)}); use batch[{name!r}]")
        return pad_rows(value, pad_value=pad_value, side=side)


@dataclass(frozen=True)
class PartitionCounts:
    """How far a partition has got, as the TransferQueue controller sees it right now."""

    partition: str
    rows: int
    """Rows put into the partition so far (0 if it does not exist or was cleared)."""
    produced: int
    """Rows that hold every field asked about (equals ``rows`` when no fields were given)."""
    consumed: int
    """Rows the task has already taken (0 when no task was given)."""
    ready: int
    """Rows that are produced and not yet consumed: what ``Bus.get`` for that task could take now."""
    missing_fields: tuple[str, ...] = ()
    """Fields asked about that no row of the partition has yet."""
