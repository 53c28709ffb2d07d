"""How new policy weights reach the roles that generate or score with them: the weight channels.

The actor publishes each new version into its channel; a rollout (or an ``actor_fwd`` of its own)
waits on its channel for the version the staleness bound requires:

- ``InProcessWeights``: colocate, the trainer and the rollout share a process;
- ``ObjectStoreWeights``: separate/hybrid, through Ray's object store (``RunState`` holds the
  reference);
- ``CollectiveWeights``: ``roles.rollout.weight_sync: collective``, over a weight group per
  rollout replica (``relax.weight_group``); a replica gets a ``WeightPull``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import ray
import torch

from relax.runtime.worker.role_env import RoleEnv


class WeightChannel(Protocol):
    """How new policy weights reach a rollout backend."""

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        """Publish ``weights`` (a copy the trainer no longer changes) as policy ``version``; a
        channel may finish the hand-over in the background (``settle`` waits for it)."""
        ...

    def settle(self) -> None:
        """Return once every publish so far reached the readers' side (raising its error, if any)."""
        ...

    def wait(self, min_version: int, held: int) -> tuple[int, dict[str, Any] | WeightPull | None]:
        """The newest version (at least ``min_version``) and, when newer than ``held``, its weights:
        a state dict, or a ``WeightPull`` that receives them straight into the backend."""
        ...


class InProcessWeights:
    """Colocate: the trainer and the rollout share a process; the newest weights are just handed
    over, or, once the rollout generates with the trainer's own model (``share_policy_model``),
    only the version is (the weights handed over are an empty dict)."""

    def __init__(self) -> None:
        self.version = 0
        self.weights: dict[str, Any] | None = None
        self.shares_model = False
        """The rollout generates with the trainer's model: publishing needs no snapshot."""

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        self.version, self.weights = version, ({} if self.shares_model else weights)

    def settle(self) -> None:
        pass

    def wait(self, min_version: int, held: int) -> tuple[int, dict[str, Any] | None]:
        if self.version < min_version:
            raise RuntimeError(f"colocated rollout needs policy version {min_version} but the trainer is at "
                               f"{self.version}; steps ran out of order")
        return self.version, (self.weights if self.version > held else None)


def share_policy_model(channel: InProcessWeights, trainer: Any, rollout: Any) -> bool:
    """Colocate: let the rollout backend generate with the trainer's own model when both can (the
    trainer offers it through ``shareable_model``, the rollout takes it through ``adopt_model``:
    the built-in ``torch`` trainer and ``hf`` rollout on the same model, dtype and device). The
    trainer and the rollout then take turns on one copy of the weights in one thread, so the
    rollout of step s still generates with exactly policy version s, and no step copies weights:
    a snapshot of the whole model per publish plus its copy into the rollout's model before (on
    a 7B model in bf16, 28 GB of copies a step and two extra copies held). Returns whether the
    model is shared; when not, the weights are handed over as before. Both sides are asked for
    their declared capabilities (``relax.contracts.ModelOffer`` and ``ModelSharing``)."""
    from relax.registry import supports

    if not (supports(trainer, "trainer", "model_offer") and supports(rollout, "rollout", "model_sharing")):
        return False
    model = trainer.shareable_model()
    if model is None or not rollout.adopt_model(model):
        return False
    channel.shares_model = True
    channel.weights = {}  # the snapshot published before the rollout was built is not needed
    return True


#: Where each tensor starts in a packed buffer is a multiple of this many bytes, so every slice can
#: be viewed as its own dtype.
_ALIGN = 64


@dataclass
class PackedWeights:
    """A state dict as one byte buffer plus each tensor's name, dtype, shape and offset: how weights
    travel through the object store.

    Why: Ray serializes a dict of tensors tensor by tensor. For the tiny CPU model (21 tensors,
    0.5 MB) a ``ray.put`` took 3.4 ms and a ``ray.get`` in another process 2.2 ms, both on the
    step's critical path in separate mode (the rollout of the next step waits for them); one numpy
    buffer takes 1.9 ms and 0.05 ms, and slicing it back into tensors 0.5 ms.
    """

    buffer: np.ndarray
    tensors: list[tuple[str, str, tuple[int, ...], int]]
    """(name, dtype name, shape, byte offset) of each tensor, in the state dict's order."""

    @classmethod
    def of(cls, weights: dict[str, Any]) -> PackedWeights | dict[str, Any]:
        """Pack ``weights``; a dict holding anything but tensors is returned as it is."""
        if not all(isinstance(t, torch.Tensor) for t in weights.values()):
            return weights
        entries, offset = [], 0
        for name, tensor in weights.items():
            entries.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
            offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        buffer = torch.empty(offset, dtype=torch.uint8)
        for (_, _, _, start), tensor in zip(entries, weights.values()):
            raw = tensor.detach().reshape(-1).view(torch.uint8)
            buffer[start:start + raw.numel()].copy_(raw)
        return cls(buffer=buffer.numpy(), tensors=entries)

    def unpack(self) -> dict[str, torch.Tensor]:
        """The state dict back, as views into one writable copy of the buffer (the object store's
        own copy is read-only)."""
        data = torch.from_numpy(self.buffer.copy())
        out = {}
        for name, dtype_name, shape, start in self.tensors:
            dtype = getattr(torch, dtype_name)
            count = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
            out[name] = data[start:start + count].view(dtype).view(shape)
        return out


def unpacked(weights: PackedWeights | dict[str, Any]) -> dict[str, Any]:
    """What ``PackedWeights.of`` was given."""
    return weights.unpack() if isinstance(weights, PackedWeights) else weights


class ObjectStoreWeights:
    """Separate/hybrid: weights go through Ray's object store; ``RunState`` holds the reference.

    The actor's side publishes in a background thread, one version at a time and in order: packing,
    ``ray.put`` (a round trip to the raylet's object store) and the call to ``RunState`` took the
    actor's loop 6-8 ms a step on the tiny preset (2 cores), between one optimizer step and the
    next, while the version only has to reach the rollout before it asks for it. A publish still in
    flight is waited for by the next one (and by ``settle``), which raises its error."""

    def __init__(self, env: RoleEnv) -> None:
        self.env = env
        self._sender: ThreadPoolExecutor | None = None
        self._sending: Future | None = None

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        self.settle()
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-publish")
        self._sending = self._sender.submit(self._send, version, weights, self.env.take_carried_reports())

    def _send(self, version: int, weights: dict[str, Any], reports: list[Any] | None) -> None:
        # The call is not awaited: calls from one process to one actor run in order, and the
        # reference keeps the weights alive in this process's object store until a newer version
        # replaces them.
        self.env.state.publish.remote(version, [ray.put(PackedWeights.of(weights))], reports)

    def settle(self) -> None:
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.result(timeout=self.env.timeout_s)

    def wait(self, min_version: int, held: int) -> tuple[int, dict[str, Any] | None]:
        policy = self.env.wait_version(min_version)
        return policy.version, (unpacked(ray.get(policy.weights[0], timeout=self.env.timeout_s))
                                if policy.version > held else None)


class CollectiveWeights:
    """Separate/hybrid with ``roles.rollout.weight_sync: collective``: weights go from the actor's
    rank 0 to each rollout replica over a weight group of their own (``relax.weight_group``:
    NCCL on GPUs, gloo on CPU), pulled by the replica when it needs a newer version.

    The actor's side keeps its newest snapshot and publishes only the version (plus an object-store
    reference when ``object_store`` too, for an ``actor_fwd`` in another worker). A replica's side
    waits for the version, then asks the actor's worker (registered in ``RunState``) to send its
    snapshot over the replica's group (``RoleWorker.send_weights``, on a free thread of that worker)
    while it receives straight into its backend. The group is opened on a replica's first pull, so a
    replica added mid-run, or a restarted one, joins the same way; a restarted actor is a new sender,
    for which the replica opens a new group."""

    def __init__(self, env: RoleEnv, object_store: bool = False) -> None:
        self.env = env
        self.object_store = object_store
        self.snapshot: tuple[int, dict[str, Any]] | None = None
        """The actor's newest ``(version, weights)``: what a pull sends."""
        self.groups: dict[str, Any] = {}
        """The actor's ``WeightSender`` per rollout replica (by holder)."""
        self.sender: Any = None
        """A replica's sender (the actor worker's handle) whose group its backend joined."""

    # -- the actor's side ----------------------------------------------------------------------

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        self.snapshot = (version, weights)  # before the version is announced: a pull sends >= it
        self.env.state.publish.remote(version, [ray.put(PackedWeights.of(weights))] if self.object_store else [],
                                      self.env.take_carried_reports())

    def settle(self) -> None:
        pass

    def open(self, holder: str, receivers: int) -> dict[str, Any]:
        """A new weight group for replica ``holder`` (replacing its old one): its address."""
        from relax.weight_group import WeightSender

        old = self.groups.pop(holder, None)
        if old is not None:
            old.close()
        sender = WeightSender(receivers, timeout_s=self.env.timeout_s, host=ray.util.get_node_ip_address())
        self.groups[holder] = sender
        return sender.address.as_dict()

    def send(self, holder: str) -> dict[str, Any]:
        """Broadcast the newest snapshot over ``holder``'s group; its version, size and times. A
        failed send drops the group (the replica opens a new one on its next pull)."""
        if self.snapshot is None or holder not in self.groups:
            raise RuntimeError(f"rollout replica {holder} asked for weights before "
                               f"{'the actor published any' if self.snapshot is None else 'opening its group'}")
        version, weights = self.snapshot
        sender = self.groups[holder]
        # Not marked in env.activity: that is the run thread's state, and this runs beside it.
        try:
            stats = sender.send(weights, version)
        except Exception:
            if self.groups.get(holder) is sender:  # not a newer group the replica opened meanwhile
                del self.groups[holder]
            sender.close()
            raise
        return {"version": version, **stats}

    # -- a rollout replica's side -------------------------------------------------------------------

    def wait(self, min_version: int, held: int) -> tuple[int, WeightPull | None]:
        version = self.env.wait_version(min_version).version
        return version, (WeightPull(self) if version > held else None)

    def pull(self, backend: Any) -> int:
        """Receive the actor's newest weights into ``backend`` (joining a group first if needed);
        the version received, which the backend now holds."""
        env = self.env
        sender = env.call(env.state.weight_sender.remote())
        if sender is None:
            raise RuntimeError("no actor worker registered to send weights (roles.rollout.weight_sync: "
                               "collective); the actor failed to start or runs in another run")
        if self.sender is None or self.sender._actor_id != sender._actor_id:
            address = env.call(sender.open_weight_group.remote(env.holder, int(backend.weight_group_ranks)))
            backend.join_weight_group(address)
            self.sender = sender
        sent = sender.send_weights.remote(env.holder)
        try:
            version = backend.receive_weights()
            env.call(sent)
        except Exception:
            self.sender = None  # a new group on the next pull
            raise
        return version


@dataclass
class WeightPull:
    """A newer version to pull (what ``CollectiveWeights.wait`` returns instead of the weights)."""

    channel: CollectiveWeights

    def into(self, backend: Any) -> int:
        return self.channel.pull(backend)

