"""The data bus between roles: a typed layer over TransferQueue (see ``relax.bus.bus``).

Importing ``Bus`` imports torch, Ray and TransferQueue; the spec, config and plan layers must not
import it. The names below load on first use, so that ``relax.bus.keeper`` (the payload keeper,
an actor that needs only numpy) starts without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax.bus.bus import Bus
    from relax.bus.columns import Column, pad_rows
    from relax.bus.errors import BusError, BusTimeout
    from relax.bus.records import BusBatch, PartitionCounts, RowHandle, RowMeta

_HOMES = {
    "Bus": "relax.bus.bus",
    "Column": "relax.bus.columns",
    "pad_rows": "relax.bus.columns",
    "BusError": "relax.bus.errors",
    "BusTimeout": "relax.bus.errors",
    "BusBatch": "relax.bus.records",
    "PartitionCounts": "relax.bus.records",
    "RowHandle": "relax.bus.records",
    "RowMeta": "relax.bus.records",
}

__all__ = ["Bus", "BusBatch", "BusError", "BusTimeout", "Column", "PartitionCounts", "RowHandle", "RowMeta",
           "pad_rows"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'relax.bus' has no attribute {name!r}")
