"""The payload keeper: the Ray actor that keeps the bus's payloads alive and says where each row's
columns are.

Every ``Bus.put`` (and ``write_fields``) hands the keeper its columns as one payload, in one of two
ways, by size (``relax.bus.payloads.INLINE_BYTES``):

- **by value** (``keep``), a small payload: the columns travel in the call and the keeper holds
  its own copy in memory; a reader's ``locate`` returns them in its answer. Two process hops by
  value cost less than the object store's put, the keeper's fetch of it (a lookup at its owner)
  and a reader's fetch: for 100 KB, 6-7 ms against 12 ms to put and 3 ms against 4 ms to read,
  and about half the CPU in each of the three processes (measured side by side on the 2-core box).
- **by reference** (``hold``), a large one: the payload is one object in Ray's object store, and
  the keeper takes a copy of its own there. Ray ties an object to the process that put it (its
  owner: when that process dies, the object is lost), and since Ray 2.56 ``ray.put`` can no
  longer name another owner; so the keeper, which lives as long as the run, puts the payload again
  itself (one memory copy per put). Readers get the object refs inside ``locate``'s answer, so Ray
  counts them as borrowed (never serialized out of band, never leaked), and read the buffers in
  place from shared memory.

Either way the bus's data outlives the process that wrote it (a rollout worker that dies after its
rows were accepted loses nothing), and is freed once the keeper lets go of it, when its partition
is cleared. TransferQueue's controller keeps what the rows *are* (partitions, which fields each
row has, which task took it, its tag); the keeper keeps where their bytes are: per partition and
field, the payloads that hold it and the global index of each of their rows.

The actor imports only numpy and Ray, so it starts in well under a second and takes no logical
CPU: payloads hold only numpy arrays and builtins (``PackedColumn``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import ray

#: The keeper's name in Ray (namespace ``transfer_queue``, beside TransferQueue's own controller).
KEEPER_NAME = "RelaxBusPayloads"


@dataclass
class PackedColumn:
    """One column of a payload (``relax.bus.payloads.pack_column`` makes them).

    ``kind``: ``dense`` (``data`` is ``[rows, ...]``), ``ragged`` (rows differ in their first
    dimension only: ``data`` is every row concatenated, ``offsets[i]:offsets[i+1]`` is row i),
    ``rows`` (rows differ in more than their first dimension, e.g. images: ``data`` is a list of
    arrays) or ``objects`` (``data`` is the pickled list of values, as bytes). ``dtype`` names the torch
    dtype (``"bfloat16"``): numpy lacks some, which then travel as integers of the same width."""

    kind: Literal["dense", "ragged", "rows", "objects"]
    data: Any
    dtype: str | None = None
    offsets: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        if self.kind in ("dense", "ragged"):  # objects are small by contract: not counted
            return int(self.data.nbytes)
        if self.kind == "rows":
            return int(sum(a.nbytes for a in self.data))
        return 0


def _owned(column: PackedColumn) -> PackedColumn:
    """A copy whose buffers belong to this process (a call's arguments may be views of its message)."""
    data = ([np.array(a, copy=True) for a in column.data] if column.kind == "rows"
            else np.array(column.data, copy=True))
    offsets = None if column.offsets is None else np.array(column.offsets, copy=True)
    return PackedColumn(column.kind, data, column.dtype, offsets)


@dataclass
class _Payload:
    """One put's columns (held here, or an object in the object store), and the global index of each
    of its rows."""

    data: Any
    """The columns (``dict[str, PackedColumn]``) kept by value, or the object ref of the keeper's copy."""
    rows: np.ndarray
    """Global indexes of the rows, in payload order."""
    order: np.ndarray
    """``argsort(rows)``: finds a row's payload position by binary search."""
    live: int
    """How many of its rows are still held (a payload is released when none is)."""


@dataclass
class _Partition:
    payloads: dict[int, _Payload] = field(default_factory=dict)
    by_field: dict[str, list[int]] = field(default_factory=dict)
    """Per field, the payloads that hold it, oldest first (a later write of a row wins)."""


class PayloadKeeper:
    """Holds every payload on the bus (by value or its object ref), by partition (use as a Ray actor)."""

    def __init__(self) -> None:
        self._partitions: dict[str, _Partition] = {}
        self._next_id = 0

    def hold(self, partition: str, rows: np.ndarray, fields: list[str], refs: list[Any]) -> int:
        """Keep a copy of the payload ``refs[0]`` (in a list, so Ray passes the reference, not the
        value) holding ``fields`` for the rows with global indexes ``rows``; returns its id. Once
        this returns, the writer may exit: the copy is the keeper's."""
        own = ray.put(ray.get(refs[0]))  # numpy buffers are read in place: one copy, into the store
        return self._add(partition, rows, fields, own)

    def keep(self, partition: str, rows: np.ndarray, columns: dict[str, PackedColumn]) -> int:
        """Keep a small payload by value: ``columns`` of the rows with global indexes ``rows``, copied
        into this process; returns its id. Once this returns, the writer may exit."""
        return self._add(partition, rows, list(columns), {name: _owned(c) for name, c in columns.items()})

    def _add(self, partition: str, rows: np.ndarray, fields: list[str], data: Any) -> int:
        part = self._partitions.setdefault(partition, _Partition())
        payload_id = self._next_id
        self._next_id += 1
        rows = np.asarray(rows, dtype=np.int64)
        part.payloads[payload_id] = _Payload(data, rows, np.argsort(rows, kind="stable"), len(rows))
        for name in fields:
            part.by_field.setdefault(name, []).append(payload_id)
        return payload_id

    def locate(self, partition: str, rows: np.ndarray, fields: list[str]) -> tuple[list[Any], dict[str, list[tuple]]]:
        """Where ``fields`` of the rows ``rows`` (global indexes, in the reader's order) are.

        Returns ``(payloads, pieces)``: the payloads involved (each its columns, when kept by value,
        or an object ref), and per field a list of ``(payload position, payload row positions,
        reader row positions)``; the newest write of a row wins. Raises ``KeyError`` naming what is
        not held (a cleared partition, say)."""
        part = self._partitions.get(partition)
        if part is None:
            raise KeyError(f"the bus holds no payload for partition {partition!r} (cleared already?)")
        rows = np.asarray(rows, dtype=np.int64)
        found_payloads: list[Any] = []
        ref_index: dict[int, int] = {}
        pieces: dict[str, list[tuple]] = {}
        for name in fields:
            missing = np.ones(len(rows), dtype=bool)
            found: list[tuple] = []
            for payload_id in reversed(part.by_field.get(name, [])):
                payload = part.payloads.get(payload_id)
                if payload is None:
                    continue
                if len(found) == 0 and len(payload.rows) == len(rows) and np.array_equal(payload.rows, rows):
                    src = dst = None  # the common case: exactly the rows of one put, in its order
                    missing[:] = False
                else:
                    wanted = np.flatnonzero(missing)
                    at = np.searchsorted(payload.rows, rows[wanted], sorter=payload.order)
                    at = np.minimum(at, len(payload.rows) - 1)
                    hit = payload.rows[payload.order[at]] == rows[wanted]
                    if not hit.any():
                        continue
                    dst = wanted[hit]
                    src = payload.order[at[hit]]
                    missing[dst] = False
                if payload_id not in ref_index:
                    ref_index[payload_id] = len(found_payloads)
                    found_payloads.append(payload.data)
                found.append((ref_index[payload_id], src, dst))
                if not missing.any():
                    break
            if missing.any():
                lost = rows[missing][:8].tolist()
                raise KeyError(f"field {name!r} of rows {lost} of partition {partition!r} is not on the bus")
            pieces[name] = found
        return found_payloads, pieces

    def drop(self, partition: str, rows: np.ndarray) -> int:
        """Let go of some rows of a partition (``drop_partitions`` lets go of whole ones): a payload
        is released once none of its rows is held. Returns how many payloads were released."""
        part = self._partitions.get(partition)
        if part is None:
            return 0
        rows = np.asarray(rows, dtype=np.int64)
        released = 0
        for payload_id, payload in list(part.payloads.items()):
            payload.live -= int(np.isin(payload.rows, rows).sum())
            if payload.live <= 0:
                del part.payloads[payload_id]
                released += 1
        if not part.payloads:
            del self._partitions[partition]
        return released

    def drop_partitions(self, partitions: list[str]) -> int:
        """Let go of every payload of each of ``partitions`` (one call for the steps a run finished
        together); returns how many payloads were released."""
        return sum(len(part.payloads) for name in partitions if (part := self._partitions.pop(name, None)))

    def held(self) -> dict[str, int]:
        """Payloads held per partition (for tests and diagnostics)."""
        return {name: len(part.payloads) for name, part in self._partitions.items()}
