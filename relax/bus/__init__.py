"""The data bus between roles: a typed layer over TransferQueue (see ``relax.bus.bus``).

Importing this package imports torch, Ray and TransferQueue; the spec, config and plan layers
must not import it.
"""

from relax.bus.bus import Bus
from relax.bus.columns import Column, pad_rows
from relax.bus.errors import BusError, BusTimeout
from relax.bus.records import BusBatch, PartitionCounts, RowHandle, RowMeta

__all__ = [
    "Bus",
    "BusBatch",
    "BusError",
    "BusTimeout",
    "Column",
    "PartitionCounts",
    "RowHandle",
    "RowMeta",
    "pad_rows",
]
