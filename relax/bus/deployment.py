"""Starting, finding and stopping the TransferQueue deployment the bus talks to.

How TransferQueue 0.1.11 runs (read from its ``interface.py``, ``controller.py`` and
``storage/bootstrap``):

- ``transfer_queue.init(conf)`` in one process creates a named Ray actor
  ``TransferQueueController`` (namespace ``transfer_queue``, 1 logical CPU; we have it create
  ``relax.bus.controller``'s subclass, whose process starts lighter), runs the storage
  backend's bootstrap, then stores the merged config, including the controller's ZMQ address,
  in the controller. Our backend (``relax.bus.payloads``, ``RelaxObjectStore``) keeps the data in
  Ray's object store; its bootstrap starts only the payload keeper (no logical CPU), so the bus
  is one TransferQueue process plus one small actor.
- Any other process of the same Ray cluster reaches the same deployment by looking the
  controller up by name and reading that config (``get_config``); it is ``None`` until the
  starting process has finished. We do that ourselves (``connect_client``) instead of calling
  ``transfer_queue.init()`` a second time, because TransferQueue keeps its client and controller
  in module globals and ``transfer_queue.close()`` in *any* process that attached that way kills
  the shared controller.
- Ray must already be initialised and have spare logical CPUs, or those actors stay pending and
  ``init`` blocks forever (FACTS-runtime.md section 3: the shipped demo hangs on a 2-CPU Ray).
  ``ray.init(num_cpus=8)`` is plenty on a laptop.
- A storage backend is found by name in TransferQueue's registries, which live in each process:
  importing ``relax.bus.payloads`` (this module does) registers ours before ``init`` or a client.
- The controller must run in polling mode: otherwise a ``get_meta`` with too few ready rows
  blocks the controller for ``TQ_CONTROLLER_GET_METADATA_TIMEOUT`` (1 s) and then raises,
  which makes waiting consumers expensive for everybody.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import ray

from relax.bus import controller, payloads
from relax.bus.errors import BusError
from relax.bus.transferqueue import TransferQueueClient
from relax.bus.transferqueue import transfer_queue as tq

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"

#: Logical CPUs the TransferQueue controller actor asks Ray for (the payload keeper takes none).
_CONTROLLER_CPUS = controller.CPUS


def logical_cpus() -> int:
    """The logical CPUs the deployment takes from Ray (its actors' asks)."""
    return _CONTROLLER_CPUS


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


def start_deployment(node_resource: str | None = None) -> TransferQueueClient:
    """Start the controller and the payload keeper in this Ray cluster; return this process's client.

    Refuses, rather than hangs, when Ray lacks the logical CPU the controller needs, and refuses to
    silently join a deployment somebody else started (``transfer_queue.init`` would).
    """
    if find_controller() is not None:
        raise BusError(
            "a TransferQueue controller is already running in this Ray cluster; use Bus.attach() to join it, "
            "or close the bus that started it first"
        )
    if node_resource is not None and not any(n.get("Alive") and n.get("Resources", {}).get(node_resource, 0) > 0
                                             for n in ray.nodes()):
        raise BusError(f"no alive Ray node has the custom resource {node_resource!r} (cluster.bus_node_resource); "
                       f"start a node with --resources '{{\"{node_resource}\": 1}}' or unset it")
    free = ray.available_resources().get("CPU", 0.0)
    if free < logical_cpus():
        raise BusError(
            f"TransferQueue's controller needs {_CONTROLLER_CPUS} free logical CPU in Ray, but only {free:g} "
            "are free; start Ray with more, e.g. ray.init(num_cpus=8)"
        )
    conf = {
        "controller": {"polling_mode": True},
        "backend": {
            "storage_backend": payloads.BACKEND,
            payloads.BACKEND: {"required_node_resource": node_resource},
        },
    }
    with controller.started_from_here():  # its process skips torch._dynamo (relax.bus.controller)
        tq.init(conf)
    return tq.get_client()


def stop_deployment() -> None:
    """Stop the controller and the payload keeper this process started (the payloads go with the
    keeper, their owner), and close its client."""
    tq.close()
    try:
        ray.kill(payloads.find_keeper())
    except BusError:
        pass


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
    if backend != payloads.BACKEND:
        raise BusError(f"the running TransferQueue stores data in {backend!r}, not in Relax's {payloads.BACKEND!r}; "
                       "it was not started by Bus.start() (close it, or start Relax on another Ray cluster)")
    client = TransferQueueClient(
        client_id=f"relax-bus-{os.getpid()}-{uuid.uuid4().hex[:8]}", controller_info=conf.controller.zmq_info
    )
    client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
    return client
