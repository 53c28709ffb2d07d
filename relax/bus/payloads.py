"""Payloads by reference: the bus's column data in Ray's object store, TransferQueue carrying the
rows' metadata.

Why: TransferQueue's own storage units hold every row's every field as a separate value and send
each one as its own message part, so a step costs in proportion to rows x fields (a fetch of 128
rows x 4 columns measured 24-35 ms; 8,192 rows with media columns would take seconds), and every
byte crosses two sockets. Here a put hands its columns over as **one** payload, one buffer per
column: a large one as one object in Ray's object store (shared memory on a node, Ray's transfer
across nodes), a small one (``INLINE_BYTES``) by value to the payload keeper, which holds it in
memory and returns it in the answer that says where rows are. A get takes the rows it was given by
slicing those buffers. The cost of a step then grows with its bytes.

The pieces:

- ``pack_columns`` / ``unpack``: columns as roles write them (``relax.bus.columns``: dense tensor,
  list of tensors, list of objects) to and from ``PackedColumn``s of numpy buffers (Ray keeps
  numpy buffers out of band; torch tensors would be pickled through a copy).
- ``ObjectStoreManager``: a TransferQueue storage backend (``StorageManagerFactory``), so
  TransferQueue's client, controller, partitions, consumption and production bookkeeping are
  unchanged; only where bytes live is ours. ``Bus`` calls its column methods directly (no
  ``TensorDict`` round trip); TransferQueue's own ``put``/``get_data`` work through it as well.
- ``relax.bus.keeper.PayloadKeeper``: the actor that owns the payloads and says where rows are.
"""

from __future__ import annotations

import asyncio
import pickle
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import ray
import torch

from relax.bus.columns import Column
from relax.bus.errors import BusError
from relax.bus.keeper import KEEPER_NAME, PackedColumn, PayloadKeeper
from relax.bus.transferqueue import (
    BatchMeta,
    NonTensorStack,
    StorageBootstrapProvider,
    StorageManager,
    StorageManagerFactory,
    TensorDict,
)

#: TransferQueue's name of this storage backend (``backend.storage_backend``).
BACKEND = "RelaxObjectStore"
#: Ray namespace of the keeper (TransferQueue's own).
NAMESPACE = "transfer_queue"

#: A payload of at most this many bytes goes to the keeper by value and is read back from it in
#: the same call (``PayloadKeeper.keep``); a larger one goes through the object store by reference.
#: Two process hops by value cost less than the object store's put, the keeper's fetch and the
#: reader's fetch, up to a few hundred KB (measured side by side on the 2-core box: 100 KB took
#: 6-7 ms to put against 12, and half the CPU; at 4 MB the object store read 2x faster).
INLINE_BYTES = 256 * 1024

#: torch dtypes numpy cannot hold, carried bit for bit as an integer of the same width.
_CARRIER = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    carrier = _CARRIER.get(tensor.dtype)
    return (tensor.view(carrier) if carrier is not None else tensor).numpy()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _to_torch(array: np.ndarray, dtype: str | None) -> torch.Tensor:
    """A writable tensor of its own (the object store's buffers are shared and read-only)."""
    tensor = torch.from_numpy(np.array(array, copy=True))
    wanted = getattr(torch, dtype) if dtype else tensor.dtype
    return tensor.view(wanted) if wanted in _CARRIER else tensor


def pack_column(name: str, value: Column, num_rows: int) -> PackedColumn:
    """One column as a payload stores it, checking it has one entry per row."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            value = list(value.unbind())
        elif value.ndim == 0:
            raise BusError(f"field {name!r} is a 0-d tensor; give one value per row ([{num_rows}, ...])")
        else:
            _check_rows(name, value.shape[0], num_rows)
            return PackedColumn("dense", _to_numpy(value), _dtype_name(value.dtype))
    if isinstance(value, NonTensorStack):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise BusError(f"field {name!r} is a {type(value).__name__}; give a Tensor or a list with one entry per row")
    values = list(value)
    _check_rows(name, len(values), num_rows)
    tensors = [isinstance(v, torch.Tensor) for v in values]
    if not any(tensors):
        return pack_objects(values)
    if not all(tensors):
        raise BusError(f"field {name!r} mixes tensors and non-tensors; a column holds one kind")
    if len({v.dtype for v in values}) != 1 or len({v.ndim for v in values}) != 1:
        raise BusError(f"field {name!r}: all rows of a ragged column need the same dtype and number of dimensions")
    dtype = _dtype_name(values[0].dtype)
    if values[0].ndim == 0:
        return PackedColumn("dense", _to_numpy(torch.stack(values)), dtype)
    if len({tuple(v.shape[1:]) for v in values}) == 1:
        lengths = np.fromiter((v.shape[0] for v in values), dtype=np.int64, count=len(values))
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return PackedColumn("ragged", _to_numpy(torch.cat(values)), dtype, offsets)
    return PackedColumn("rows", [_to_numpy(v) for v in values], dtype)


def pack_objects(values: list[Any]) -> PackedColumn:
    """A column of objects as one pickled buffer: the keeper copies it as bytes and a reader
    unpickles it once, instead of every hop handling every row's object."""
    return PackedColumn("objects", np.frombuffer(pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL), np.uint8))


def payload_bytes(columns: Mapping[str, PackedColumn]) -> int:
    """A payload's size: its buffers, pickled objects included."""
    return sum(c.data.nbytes if c.kind == "objects" else c.nbytes for c in columns.values())


def _check_rows(name: str, rows: int, num_rows: int) -> None:
    if rows != num_rows:
        raise BusError(f"field {name!r} has {rows} rows but the batch has {num_rows} (one metadata entry per row)")


def pack_columns(columns: Mapping[str, Column], num_rows: int) -> dict[str, PackedColumn]:
    """Every column of a put, as one payload (see ``pack_column``)."""
    if not columns:
        raise BusError("no columns given; write at least one field")
    return {name: pack_column(name, value, num_rows) for name, value in columns.items()}


def _take(column: PackedColumn, src: np.ndarray | None) -> list[Any] | np.ndarray:
    """The rows ``src`` of a column (all of them for ``None``): an array for dense, else a list."""
    if column.kind == "dense":
        return column.data if src is None else column.data[src]
    if column.kind == "ragged":
        offsets = column.offsets
        positions = range(len(offsets) - 1) if src is None else src.tolist()
        return [column.data[offsets[i]:offsets[i + 1]] for i in positions]
    values = column.data if column.kind == "rows" else pickle.loads(column.data)
    return list(values) if src is None else [values[i] for i in src.tolist()]


def unpack(name: str, payloads: list[dict[str, PackedColumn]], pieces: list[tuple], num_rows: int) -> Column:
    """A field of ``num_rows`` rows from the payload pieces ``locate`` named, in the kind its
    producer wrote: a dense tensor when every piece is dense with one row shape, a list of tensors
    (one per row) when rows differ, a list of objects for objects."""
    columns = [(payloads[ref][name], src, dst) for ref, src, dst in pieces]
    kinds = {c.kind for c, _, _ in columns}
    dtype = columns[0][0].dtype
    if kinds == {"dense"} and len({c.data.shape[1:] for c, _, _ in columns}) == 1:
        if len(columns) == 1:
            column, src, dst = columns[0]
            rows = _take(column, src)
            if dst is not None:
                out = np.empty((num_rows, *rows.shape[1:]), dtype=rows.dtype)
                out[dst] = rows
                rows = out
            return _to_torch(rows, dtype)
        out = np.empty((num_rows, *columns[0][0].data.shape[1:]), dtype=columns[0][0].data.dtype)
        for column, src, dst in columns:
            out[dst if dst is not None else slice(None)] = _take(column, src)
        return _to_torch(out, dtype)
    if kinds == {"objects"}:
        values: list[Any] = [None] * num_rows
        for column, src, dst in columns:
            for i, value in zip(range(num_rows) if dst is None else dst.tolist(), _take(column, src)):
                values[i] = value
        return values
    if "objects" in kinds:
        raise BusError(f"field {name!r} was written as objects by some puts and as tensors by others")
    rows_out: list[Any] = [None] * num_rows
    for column, src, dst in columns:
        rows = _take(column, src)
        if column.kind == "dense":
            rows = list(rows)
        for i, row in zip(range(num_rows) if dst is None else dst.tolist(), rows):
            rows_out[i] = _to_torch(row, column.dtype)
    return rows_out


def encode_columns(columns: Mapping[str, Column], num_rows: int) -> TensorDict:
    """Columns as the ``TensorDict`` TransferQueue's own API speaks (``get_data``), checking each has
    ``num_rows`` rows."""
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


def column_schema(columns: Mapping[str, PackedColumn]) -> dict[str, dict[str, Any]]:
    """What TransferQueue's controller records about each field (it only needs to know it exists
    and its kind; row shapes stay in the payload)."""
    return {name: {"dtype": getattr(torch, c.dtype) if c.dtype else None,
                   "shape": tuple(c.data.shape[1:]) if c.kind == "dense" else None,
                   "is_nested": c.kind in ("ragged", "rows"), "is_non_tensor": c.kind == "objects"}
            for name, c in columns.items()}


def find_keeper() -> Any:
    """The running payload keeper's handle; ``BusError`` when the bus was not started."""
    try:
        return ray.get_actor(KEEPER_NAME, namespace=NAMESPACE)
    except ValueError:
        raise BusError("the bus's payload keeper is not running; the driver must call Bus.start() first, "
                       "in the same Ray cluster") from None


def start_keeper(node_resource: str | None) -> Any:
    """Create the keeper (no logical CPU: it only holds references), on a node with
    ``node_resource`` when given (``cluster.bus_node_resource``), else beside the caller."""
    options: dict[str, Any] = {"name": KEEPER_NAME, "namespace": NAMESPACE, "num_cpus": 0}
    if node_resource is not None:
        options["resources"] = {node_resource: 0.001}
    else:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(PayloadKeeper).options(**options).remote()


@StorageBootstrapProvider.register_provider(BACKEND)
def _bootstrap(conf: Any) -> dict[str, Any]:
    """Called by ``transfer_queue.init``: the backend's resources are the keeper alone."""
    return {"keeper": start_keeper(conf.backend[BACKEND].get("required_node_resource"))}


@StorageManagerFactory.register(BACKEND)
class ObjectStoreManager(StorageManager):
    """TransferQueue storage backend over Ray's object store (see the module docstring).

    ``put_columns``/``get_columns`` are what the bus calls; ``put_data``/``get_data``/``clear_data``
    are TransferQueue's interface over the same storage."""

    def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None) -> None:
        super().__init__(controller_info, config, zmq_context=zmq_context)
        self._keeper: Any = None

    @property
    def keeper(self) -> Any:
        if self._keeper is None:
            self._keeper = find_keeper()
        return self._keeper

    # -- the bus's interface -----------------------------------------------------------------

    def store(self, partition: str, rows: list[int], columns: dict[str, PackedColumn]) -> None:
        """Hand a payload to the keeper, by value when small (``INLINE_BYTES``), else through the
        object store (blocking; not on a loop)."""
        indexes = np.asarray(rows, dtype=np.int64)
        if payload_bytes(columns) <= INLINE_BYTES:
            ray.get(self.keeper.keep.remote(partition, indexes, columns))
        else:
            ray.get(self.keeper.hold.remote(partition, indexes, list(columns), [ray.put(columns)]))

    async def announce(self, partition: str, rows: list[int], columns: dict[str, PackedColumn]) -> None:
        """Tell TransferQueue's controller the rows now hold these fields (after ``store``)."""
        await self.notify_data_update(partition, list(rows), column_schema(columns))

    def fetch(self, partition: str, rows: list[int], fields: list[str]) -> dict[str, Column]:
        """``fields`` of the rows with global indexes ``rows``, in that order (blocking)."""
        try:
            found, pieces = ray.get(self.keeper.locate.remote(partition, np.asarray(rows, dtype=np.int64), fields))
        except ray.exceptions.RayTaskError as exc:
            raise BusError(f"cannot read {fields} of partition {partition!r}: {exc.cause}") from None
        by_reference = [i for i, payload in enumerate(found) if not isinstance(payload, dict)]
        payloads = list(found)
        for i, payload in zip(by_reference, ray.get([found[i] for i in by_reference])):
            payloads[i] = payload
        return {name: unpack(name, payloads, pieces[name], len(rows)) for name in fields}

    # -- TransferQueue's interface -------------------------------------------------------------

    async def put_data(self, data: TensorDict, metadata: BatchMeta, data_parser: Any = None) -> None:
        if data_parser is not None:
            raise BusError(f"the {BACKEND} backend does not run data parsers; parse before put")
        if metadata.size == 0:
            return
        columns = pack_columns({name: data.get(name) for name in data.keys()}, metadata.size)
        partition, rows = metadata.partition_ids[0], list(metadata.global_indexes)
        await asyncio.get_running_loop().run_in_executor(None, self.store, partition, rows, columns)
        await self.announce(partition, rows, columns)

    async def get_data(self, metadata: BatchMeta) -> TensorDict:
        if metadata.size == 0:
            return TensorDict({}, batch_size=0)
        fields = list(metadata.field_names)
        columns = await asyncio.get_running_loop().run_in_executor(
            None, self.fetch, metadata.partition_ids[0], list(metadata.global_indexes), fields)
        return encode_columns(columns, metadata.size)

    async def drop_partitions(self, partitions: list[str]) -> None:
        """Let go of every payload of ``partitions`` (``Bus.clear``: once the controller forgot them)."""
        await self.keeper.drop_partitions.remote(partitions)

    async def clear_data(self, metadata: BatchMeta) -> None:
        if metadata.size == 0:
            return
        by_partition: dict[str, list[int]] = {}
        for partition, row in zip(metadata.partition_ids, metadata.global_indexes):
            by_partition.setdefault(partition, []).append(row)
        for partition, rows in by_partition.items():
            await self.keeper.drop.remote(partition, np.asarray(rows, dtype=np.int64))
