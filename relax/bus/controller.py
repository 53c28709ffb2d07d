"""TransferQueue's controller actor, defined here so that its process imports TransferQueue the way
the bus does.

The controller only keeps metadata, but its process imports TransferQueue, and with it torch and
tensordict, whose compile marks pull in ``torch._dynamo``: about 1.2 s of CPU, on the start-up path
of every run that has a bus, while the workers import their models on the same cores. Ray loads an
actor's class from the module that defines it, so a subclass defined here makes that process import
``relax.bus.transferqueue`` (which keeps ``torch._dynamo`` out) before TransferQueue itself.
The controller's behaviour is TransferQueue's own, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# First: TransferQueue and tensordict imported the bus's way (without torch._dynamo); the split
# keeps the import sorter from moving TransferQueue's own modules above it.
from relax.bus.transferqueue import transfer_queue

# isort: split
import ray
from transfer_queue import interface
from transfer_queue.controller import TransferQueueController

#: Logical CPUs the controller asks Ray for (TransferQueue's own default).
CPUS = 1


class Controller(TransferQueueController.__ray_actor_class__):  # type: ignore[name-defined]
    """TransferQueue's controller, started from this module (see the module's docstring)."""


RemoteController = ray.remote(num_cpus=CPUS)(Controller)


@contextmanager
def started_from_here() -> Iterator[None]:
    """While ``transfer_queue.init`` runs, it creates this module's controller class instead of its
    own (``init`` takes the class from ``transfer_queue.interface``; nothing else there changes)."""
    original = interface.TransferQueueController
    interface.TransferQueueController = RemoteController
    try:
        yield
    finally:
        interface.TransferQueueController = original


__all__ = ["CPUS", "Controller", "RemoteController", "started_from_here", "transfer_queue"]
