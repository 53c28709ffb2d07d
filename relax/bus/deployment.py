"""Starting, finding and stopping the TransferQueue deployment the bus talks to.

How TransferQueue 0.1.11 runs (read from its ``interface.py``, ``controller.py`` and
``storage/bootstrap``):

- ``transfer_queue.init(conf)`` in one process creates a named Ray actor
  ``TransferQueueController`` (namespace ``transfer_queue``, 1 logical CPU) and
  ``num_data_storage_units`` ``SimpleStorageUnit`` actors (1 logical CPU each, pinned
  round-robin to nodes), then stores the merged config, including every actor's ZMQ address,
  in the controller. Data then moves by ZMQ, not through Ray's object store.
- Any other process of the same Ray cluster reaches the same deployment by looking the
  controller up by name and reading that config (``get_config``); it is ``None`` until the
  starting process has finished. We do that ourselves (``connect_client``) instead of calling
  ``transfer_queue.init()`` a second time, because TransferQueue keeps its client and controller
  in module globals and ``transfer_queue.close()`` in *any* process that attached that way kills
  the shared controller.
- Ray must already be initialised and have spare logical CPUs, or those actors stay pending and
  ``init`` blocks forever (FACTS-runtime.md section 3: the shipped demo hangs on a 2-CPU Ray).
  ``ray.init(num_cpus=8)`` is plenty on a laptop.
- The controller must run in polling mode: otherwise a ``get_meta`` with too few ready rows
  blocks the controller for ``TQ_CONTROLLER_GET_METADATA_TIMEOUT`` (1 s) and then raises,
  which makes waiting consumers expensive for everybody.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import psutil
import ray

from relax.bus.errors import BusError

# TransferQueue reads this once, at import, and warns on every put/get when it exceeds the
# physical cores (8 by default; our dev machines have 2). Set it before importing the package.
# Storage actors inherit it only if it was set before ``ray.init`` started the raylet.
os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))

import transfer_queue as tq  # noqa: E402  (must follow the environment default above)
from transfer_queue import TransferQueueClient  # noqa: E402

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"

#: Logical CPUs the TransferQueue controller actor asks Ray for.
_CONTROLLER_CPUS = 1
#: Logical CPUs each SimpleStorage unit actor asks Ray for.
_STORAGE_UNIT_CPUS = 1


def logical_cpus(num_storage_units: int) -> int:
    """The logical CPUs a deployment with ``num_storage_units`` takes from Ray (its actors' asks)."""
    return _CONTROLLER_CPUS + _STORAGE_UNIT_CPUS * num_storage_units


def _require_ray() -> None:
    if not ray.is_initialized():
        raise BusError(
            "Ray is not initialised; call ray.init(num_cpus=8) (or join a cluster) before starting or "
            "attaching to the bus"
        )


def find_controller() -> Any | None:
    """The running TransferQueue controller actor handle, or ``None`` if there is none."""
    _require_ray()
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return None


def start_deployment(num_storage_units: int, storage_capacity: int | None,
                     node_resource: str | None = None) -> TransferQueueClient:
    """Start the controller and storage units in this Ray cluster; return this process's client.

    Refuses, rather than hangs, when Ray lacks the logical CPUs the actors need, and refuses to
    silently join a deployment somebody else started (``transfer_queue.init`` would).
    """
    if num_storage_units < 1:
        raise BusError(f"num_storage_units must be at least 1, got {num_storage_units}")
    if find_controller() is not None:
        raise BusError(
            "a TransferQueue controller is already running in this Ray cluster; use Bus.attach() to join it, "
            "or close the bus that started it first"
        )
    if node_resource is not None and not any(n.get("Alive") and n.get("Resources", {}).get(node_resource, 0) > 0
                                             for n in ray.nodes()):
        raise BusError(f"no alive Ray node has the custom resource {node_resource!r} (cluster.bus_node_resource); "
                       f"start a node with --resources '{{\"{node_resource}\": 1}}' or unset it")
    need = logical_cpus(num_storage_units)
    free = ray.available_resources().get("CPU", 0.0)
    if free < need:
        raise BusError(
            f"TransferQueue needs {need} free logical CPUs in Ray (controller + {num_storage_units} storage "
            f"unit(s)), but only {free:g} are free; start Ray with more, e.g. ray.init(num_cpus=8)"
        )
    conf = {
        "controller": {"polling_mode": True},
        "backend": {
            "storage_backend": "SimpleStorage",
            "SimpleStorage": {
                "num_data_storage_units": num_storage_units,
                "total_storage_size": storage_capacity,
                "required_node_resource": node_resource,
            },
        },
    }
    tq.init(conf)
    return tq.get_client()


def stop_deployment() -> None:
    """Stop the storage units and the controller this process started, and close its client."""
    tq.close()


def connect_client(timeout_s: float) -> TransferQueueClient:
    """A fresh client on the running deployment, independent of TransferQueue's module globals.

    Waits up to ``timeout_s`` for the starting process to finish publishing its config.
    """
    controller = find_controller()
    deadline = time.monotonic() + timeout_s
    while controller is None:
        if time.monotonic() > deadline:
            raise BusError(
                f"no TransferQueue controller in this Ray cluster after {timeout_s:g}s; the driver must call "
                "Bus.start() first, and this process must be connected to the same Ray cluster"
            )
        time.sleep(0.1)
        controller = find_controller()
    conf = ray.get(controller.get_config.remote())
    while conf is None:
        if time.monotonic() > deadline:
            raise BusError(f"the TransferQueue controller did not finish starting within {timeout_s:g}s")
        time.sleep(0.1)
        conf = ray.get(controller.get_config.remote())
    if not conf.controller.polling_mode:
        raise BusError(
            "the running TransferQueue controller is not in polling mode, so waiting consumers would "
            "block it; start it with Bus.start() (which sets controller.polling_mode=True)"
        )
    backend = conf.backend.storage_backend
    client = TransferQueueClient(
        client_id=f"relax-bus-{os.getpid()}-{uuid.uuid4().hex[:8]}", controller_info=conf.controller.zmq_info
    )
    client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
    return client
