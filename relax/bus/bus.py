"""The bus: the only way the runtime moves per-sample data between roles.

A thin, typed layer over TransferQueue's low-level client. It knows fields, partitions,
consumer tasks and row metadata, never roles:

- a **partition** is one training step (``"step-7"``);
- a **row** is a sample, a **field** is a column (``"input_ids"``, ``"rewards"``...);
- a **consumer task** (``"reward"``, ``"actor"``) takes each ready row of a partition exactly
  once; different tasks each see every row;
- each row carries a ``RowMeta`` (policy version, sample id, trace carrier) as its tag.

The bytes go by reference: each put's columns are one object in Ray's object store (shared memory
on a node), and TransferQueue carries the rows' metadata (``relax.bus.payloads``), so the cost of a
step grows with its bytes, not with rows x fields.

Every call is batched: one round trip costs milliseconds however small the payload, so calling
per sample caps a role at a few hundred samples per second (FACTS-runtime.md section 3).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch

from relax.bus import deployment
from relax.bus.columns import Column, column_nbytes
from relax.bus.errors import BusError, BusTimeout
from relax.bus.keeper import PackedColumn
from relax.bus.payloads import ObjectStoreManager, pack_columns, pack_objects
from relax.bus.records import BusBatch, PartitionCounts, RowHandle, RowMeta
from relax.bus.transferqueue import TransferQueueClient

#: First sleep between two polls of a waiting ``get``; it doubles up to the cap below.
_FIRST_POLL_S = 0.002
#: Longest sleep between polls: bounds both the added latency and the load on the controller.
_MAX_POLL_S = 0.05
#: Task name used only to read a partition's row count when the caller names no task.
_COUNT_TASK = "__relax_bus_counts__"
#: Longest wait for one controller request (metadata, status, clear). A healthy one takes
#: milliseconds; TransferQueue itself waits forever, e.g. after the bus owner closed it.
_CONTROLLER_TIMEOUT_S = 30.0
#: Inside ``get``, a controller request may also use what is left of ``timeout_s``, but at least this.
_MIN_POLL_REQUEST_S = 5.0
#: Extra wait for the client's event loop itself, should a request not unwind after its timeout.
_LOOP_GRACE_S = 5.0

#: The field that carries each row's ``RowMeta`` (as its tag dict), written with the row's first put.
ROW_META_FIELD = "__row_meta__"

_T = TypeVar("_T")


class Bus:
    """A handle on the TransferQueue deployment shared by every process of a run.

    Make one with ``Bus.start()`` in the driver (it owns the deployment), and with
    ``Bus.attach()`` in every role actor that reads or writes data. A ``Bus`` is not picklable;
    pass ``RowHandle``s and ``BusBatch``es between processes instead.
    """

    def __init__(self, client: TransferQueueClient, *, owner: bool) -> None:
        """Use ``Bus.start()`` or ``Bus.attach()``; this only wraps an already-connected client."""
        self._client: TransferQueueClient | None = client
        self._owner = owner
        self.bytes_put = 0
        """Tensor bytes this handle has written (``put`` and ``write_fields``)."""
        self.bytes_got = 0
        """Tensor bytes this handle has read (``get``)."""
        self._clearing: list[concurrent.futures.Future] = []
        """Clears started by ``clear_soon`` and not known to be finished."""

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def start(cls, *, node_resource: str | None = None) -> Bus:
        """Start TransferQueue in the current Ray cluster and return the owning handle.

        Ray must already be initialised with a spare logical CPU for TransferQueue's controller
        (``ray.init(num_cpus=8)`` is plenty). Starting takes a few seconds (a new process).
        Only one deployment can run per Ray cluster; closing the owner stops it for everyone, and
        frees every payload still on the bus. ``node_resource``: place the payload keeper (the
        owner of the payloads) only on nodes that have this Ray custom resource.
        """
        return cls(deployment.start_deployment(node_resource), owner=True)

    @classmethod
    def attach(cls, timeout_s: float = 60.0) -> Bus:
        """Join the deployment another process started (typically from inside a Ray actor).

        Waits up to ``timeout_s`` for it to appear, so actors may be created while the driver
        is still starting the bus. Closing an attached handle leaves the deployment running.
        """
        return cls(deployment.connect_client(timeout_s), owner=False)

    @property
    def is_owner(self) -> bool:
        """Whether closing this handle stops the deployment."""
        return self._owner

    @property
    def bytes_moved(self) -> int:
        """Tensor bytes this handle has written plus read; for tracing and throughput metrics."""
        return self.bytes_put + self.bytes_got

    def close(self) -> None:
        """Release this handle. The owner also stops the controller and the payload keeper. Idempotent."""
        if self._client is None:
            return
        # Let clears in flight finish first: a request cut off when its event loop stops is torn
        # down later by the garbage collector, in a thread whose context it cannot unwind in.
        concurrent.futures.wait(self._clearing, timeout=_CONTROLLER_TIMEOUT_S)
        self._clearing = []
        if self._owner:
            deployment.stop_deployment()
        else:
            self._client.close()
        self._client = None

    def __enter__(self) -> Bus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a Bus holds sockets and cannot be pickled; call Bus.attach() in the other process")

    @property
    def client(self) -> TransferQueueClient:
        """The underlying TransferQueue client, for what the bus does not cover yet."""
        if self._client is None:
            raise BusError("this bus handle is closed")
        return self._client

    # ---- writing ---------------------------------------------------------------------------

    def put(
        self,
        partition: str,
        rows: Mapping[str, Column],
        meta: Sequence[RowMeta | Mapping[str, Any]],
    ) -> RowHandle:
        """Append a batch of new rows to ``partition`` in one batched call.

        ``rows`` maps field name to a column with one entry per row (see ``relax.bus.columns``:
        a dense tensor, a list of tensors for variable-length rows, or a list of objects);
        ``meta`` has one entry per row, a ``RowMeta`` or a dict with at least
        ``policy_version`` and ``sample_id``. The partition is created on first use.

        The metadata travels in the payload with the data (the bus's own field ``__row_meta__``),
        so a consumer can never see a row without it. Returns a handle on the new rows (for
        ``write_fields``).
        """
        row_meta = [RowMeta.coerce(m) for m in meta]
        if not row_meta:
            raise BusError(f"put to partition {partition!r} with no rows; give at least one")
        if ROW_META_FIELD in rows:
            raise BusError(f"{ROW_META_FIELD!r} is the bus's own field (each row's RowMeta); name the column otherwise")
        columns = pack_columns(rows, len(row_meta))
        columns[ROW_META_FIELD] = pack_objects([m.to_tag() for m in row_meta])
        batch_meta = self._ask(
            f"for new rows in partition {partition!r}",
            lambda c: c.async_get_meta(
                data_fields=list(columns), batch_size=len(row_meta), partition_id=partition, mode="insert"
            ),
        )
        self._store(partition, batch_meta.global_indexes, columns)
        return RowHandle(partition=partition, batch_meta=batch_meta)

    def write_fields(self, target: BusBatch | RowHandle, fields: Mapping[str, Column]) -> None:
        """Add (or overwrite) columns of rows already on the bus, in one batched call.

        This is how a consumer such as the reward task adds ``"rewards"`` to the rows it took, so
        a later task (``"actor"``) waiting for ``"rewards"`` can take them. Columns must have one
        entry per row, in the order of ``target``.
        """
        handle = target.handle if isinstance(target, BusBatch) else target
        if handle is None:
            raise BusError("these rows were handed over in memory, not taken from the bus: put them instead")
        self._store(handle.partition, handle.batch_meta.global_indexes, pack_columns(fields, len(handle)))

    def _store(self, partition: str, rows: list[int], columns: dict[str, PackedColumn]) -> None:
        """The payload into the object store, then the controller told that the rows hold it (in
        that order: a reader never sees a field whose bytes are not there yet)."""
        manager = self._storage
        manager.store(partition, list(rows), columns)
        self._ask(f"to announce fields of partition {partition!r}",
                  lambda c: manager.announce(partition, list(rows), columns))
        self.bytes_put += sum(c.nbytes for c in columns.values())

    @property
    def _storage(self) -> ObjectStoreManager:
        manager = self.client.storage_manager
        if not isinstance(manager, ObjectStoreManager):
            raise BusError(f"this bus's TransferQueue client stores data in {type(manager).__name__}, "
                           "not the object store; attach with Bus.attach()")
        return manager

    # ---- reading ---------------------------------------------------------------------------

    def get(
        self,
        partition: str,
        fields: Sequence[str],
        task: str,
        batch_size: int,
        timeout_s: float = 60.0,
    ) -> BusBatch:
        """Take ``batch_size`` rows of ``partition`` that hold all ``fields`` and ``task`` has not taken.

        Polls the controller (2 ms, doubling to 50 ms between polls) until enough rows are
        ready, then takes exactly ``batch_size`` of them, oldest first, and marks them consumed
        for ``task`` only. Raises ``BusTimeout`` after ``timeout_s`` with the counts it saw.

        Rows are marked consumed when they are handed out, before their data is fetched: if the
        fetch fails, those rows are not offered to the same task again (``reset_consumption``
        offers them again, for a task restarted after a failure).
        """
        if batch_size < 1:
            raise BusError(f"batch_size must be at least 1, got {batch_size}")
        fields = list(fields)
        if not fields:
            raise BusError("get needs at least one field to read")
        deadline = time.monotonic() + timeout_s
        pause = _FIRST_POLL_S
        while True:
            batch_meta = self._ask(
                f"for rows of partition {partition!r} for task {task!r}",
                lambda c: c.async_get_meta(
                    data_fields=fields,
                    batch_size=batch_size,
                    partition_id=partition,
                    mode="fetch",
                    task_name=task,
                ),
                timeout_s=max(deadline - time.monotonic(), _MIN_POLL_REQUEST_S),
            )
            if batch_meta.size > 0:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(partition, task, fields, batch_size, timeout_s)
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, _MAX_POLL_S)
        columns = self._storage.fetch(partition, list(batch_meta.global_indexes), [*fields, ROW_META_FIELD])
        tags = columns.pop(ROW_META_FIELD)
        self.bytes_got += sum(column_nbytes(v) for v in columns.values())
        return BusBatch(
            partition=partition,
            task=task,
            fields=columns,
            meta=[RowMeta.from_tag(tag) for tag in tags],
            handle=RowHandle(partition=partition, batch_meta=batch_meta),
        )

    def _timeout(
        self, partition: str, task: str, fields: list[str], wanted: int, timeout_s: float
    ) -> BusTimeout:
        counts = self.counts(partition, task=task, fields=fields)
        return BusTimeout(
            partition=partition,
            task=task,
            fields=fields,
            wanted=wanted,
            ready=counts.ready,
            rows=counts.rows,
            consumed=counts.consumed,
            missing_fields=list(counts.missing_fields),
            timeout_s=timeout_s,
        )

    # ---- bookkeeping -----------------------------------------------------------------------

    def counts(self, partition: str, task: str | None = None, fields: Sequence[str] = ()) -> PartitionCounts:
        """How many rows ``partition`` holds, how many have all ``fields``, how many ``task`` took.

        Two controller round trips; meant for progress checks and error messages, not hot loops.
        """
        what = f"for the status of partition {partition!r}"
        index, consumed_mask = self._ask(
            what, lambda c: c.async_get_consumption_status(task or _COUNT_TASK, partition)
        )
        if index is None:
            return PartitionCounts(partition, 0, 0, 0, 0, tuple(fields))
        rows = int(index.numel())
        consumed = consumed_mask.bool() if task else torch.zeros(rows, dtype=torch.bool)
        produced = torch.ones(rows, dtype=torch.bool)
        missing: list[str] = []
        if fields:
            status = self._production_status(partition, list(fields))
            if status is None:
                # Some field was never written to this partition; find which, for the message.
                missing = [f for f in fields if self._production_status(partition, [f]) is None]
                produced[:] = False
            else:
                produced = status.reshape(rows, -1).bool().all(dim=1)
        return PartitionCounts(
            partition=partition,
            rows=rows,
            produced=int(produced.sum()),
            consumed=int(consumed.sum()),
            ready=int((produced & ~consumed).sum()),
            missing_fields=tuple(missing),
        )

    def _production_status(self, partition: str, fields: list[str]) -> torch.Tensor | None:
        """Per row, per field: 1 once written; ``None`` if some field was never written to the partition."""
        what = f"for the status of partition {partition!r}"
        return self._ask(what, lambda c: c.async_get_production_status(fields, partition))[1]

    def reset_consumption(self, partition: str, task: str) -> None:
        """Offer every row of ``partition`` to ``task`` again: a task restarted after a failure may
        have taken rows it never finished."""
        self._ask(f"to reset task {task!r} on partition {partition!r}",
                  lambda c: c.async_reset_consumption(partition, task))

    def partitions(self) -> list[str]:
        """The partitions that currently exist (put to and not cleared)."""
        return list(self._ask("for the partition list", lambda c: c.async_get_partition_list()))

    def clear(self, partition: str) -> None:
        """Drop a partition's rows, metadata and consumption records everywhere, once its step is done.

        Storage is only released here; nothing is evicted on its own. Clearing a partition that
        does not exist is a no-op.
        """
        self._ask(f"to clear partition {partition!r}", lambda c: _clear_partitions(c, [partition]))

    def clear_soon(self, partitions: Sequence[str]) -> None:
        """Start dropping finished partitions without waiting for it (off a role's critical path):
        one request to the controller for each, and one call to the keeper for them all.

        Failures are not raised here; a partition that stays behind is only memory, and the owner
        drops everything when it closes.
        """
        client = self.client
        self._clearing = [f for f in self._clearing if not f.done()]
        self._clearing.append(asyncio.run_coroutine_threadsafe(_clear_partitions(client, list(partitions)),
                                                               client._loop))

    def _ask(
        self,
        what: str,
        request: Callable[[TransferQueueClient], Coroutine[Any, Any, _T]],
        timeout_s: float = _CONTROLLER_TIMEOUT_S,
    ) -> _T:
        """Run one TransferQueue request on the client's event loop, giving up after ``timeout_s``.

        TransferQueue's own sync wrappers wait forever; if the controller is gone (its owner
        closed the bus, or the driver died) a role would hang instead of failing. A cancelled
        request's socket is discarded by TransferQueue, so a late reply cannot be misread.
        Uses the event loop the sync ``TransferQueueClient`` runs in its own thread (``_loop``,
        TransferQueue 0.1.11); recheck it when upgrading.
        """
        client = self.client

        async def bounded() -> _T:
            # wait_for cancels the request inside the loop and waits for it to unwind, so
            # TransferQueue's socket lease is released in its own context before we return.
            return await asyncio.wait_for(request(client), timeout_s)

        future = asyncio.run_coroutine_threadsafe(bounded(), client._loop)
        try:
            return future.result(timeout=timeout_s + _LOOP_GRACE_S)
        except TimeoutError:  # also what concurrent.futures and asyncio raise, since 3.11
            future.cancel()
            raise BusError(
                f"TransferQueue did not answer {what} within {timeout_s:g}s; is the bus still running "
                "(was its owner closed, or the driver stopped)?"
            ) from None


async def _clear_partitions(client: TransferQueueClient, partitions: list[str]) -> None:
    """Forget finished partitions in TransferQueue's controller, then let the keeper drop their
    payloads: one controller request a partition where TransferQueue's ``async_clear_partition``
    makes three (it fetches the partition's full metadata, marks every row as being cleared, drops
    the storage by row, then clears), and one keeper call for all. Forgetting first already keeps
    readers off the rows, since the controller no longer hands out their metadata; and the keeper
    drops by partition. A step's partition is cleared once every role reported the step, so no
    reader is left on it anyway. Uses TransferQueue 0.1.11's ``_clear_partition_in_controller``;
    recheck it when upgrading."""
    for partition in partitions:
        await client._clear_partition_in_controller(partition)
    await client.storage_manager.drop_partitions(partitions)  # always Relax's (``deployment`` refuses others)
