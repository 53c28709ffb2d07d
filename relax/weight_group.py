"""A point-to-many weight group: the trainer's rank 0 broadcasts a ``state_dict`` to the ranks of
one inference engine, over NCCL for CUDA tensors and over gloo for CPU tensors.

The group is private to its members: a ``torch.distributed.TCPStore`` (the sender is its master,
on a free port of the one address it is given, loopback when every rank is on its node) and a
process group object built directly on that store (``ProcessGroupGloo`` / ``ProcessGroupNCCL``).
Nothing here calls ``init_process_group`` or touches the default group of either side, so a
trainer with its own tp/dp group and vLLM workers with theirs can both join. Rank 0 is the sender; the receivers are
ranks 1..n (a vLLM engine's worker of
rank r joins as 1 + r).

Wire format of one round (round numbers count up from 1 on both sides):

1. The sender writes ``round/<n>`` to the store: JSON ``{"version", "buckets": [{"dtype",
   "nbytes", "tensors": [[name, shape, byte offset], ...]}, ...]}``. A receiver reads it (a
   blocking ``get``), so no ``broadcast_object_list`` and no pickle.
2. Each bucket is one flat byte buffer of tensors of one dtype (so every tensor view is aligned),
   at most ``bucket_bytes`` unless a single tensor is larger (then it travels alone), broadcast
   from rank 0 as ``uint8`` (every backend supports that dtype, whatever the weights' dtype).
3. Each receiver sets ``round/<n>/done/<rank>`` once it has taken the last bucket; the sender waits
   for all of them (a blocking store ``wait``), so a send returns when the round arrived everywhere.

The receiver yields ``(name, tensor)`` views of the current bucket, so an engine loads the weights
layer by layer and never holds a second full copy.

The CUDA path is the same code with ``ProcessGroupNCCL`` and the buckets on the current CUDA device
(chosen by the sender from its tensors' device and told to the receivers through the store); it
cannot run on a CPU-only machine and is untested here. Imports only torch and the standard library.

Plugin-facing: rollout backends that receive weights collectively (``join_weight_group`` /
``receive_weights``) may import this module (``WeightRecipient``); the runtime uses the sending
side (``WeightSender``). It lives outside ``relax.runtime`` so plugins never import the runtime,
and must stay free of ray (the import-rule test holds it).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: Default size of one broadcast bucket.
BUCKET_BYTES = 256 << 20
#: The store prefix of the process group's own keys (ours are ``joined/*`` and ``round/*``).
GROUP_PREFIX = "group/"


@dataclass(frozen=True)
class WeightGroupAddress:
    """Where a receiver finds its group: the sender's store, the group's size, its time limit."""

    host: str
    port: int
    world_size: int
    """The sender plus every receiver rank."""
    timeout_s: float = 300.0
    """Longest wait for a peer to join, a round to start or a bucket to arrive."""

    def as_dict(self) -> dict[str, Any]:
        """Plain values (for channels that carry no dataclasses, e.g. vLLM's ``collective_rpc``)."""
        return asdict(self)


class WeightGroupError(RuntimeError):
    """A peer did not join, or a round did not complete, within the group's timeout."""


def node_address(towards: str | None = None) -> str:
    """This node's IP address: the one that routes to ``towards`` when given (a receiver's address
    as the sender sees it), else the one of the default route, else the hostname's."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((towards or "10.255.255.255", 1))  # UDP: nothing is sent
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def _listen_on(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` and a free port, for the sender's store (which takes the
    file descriptor over). Bound to that one address: with every rank on one node the sender's
    host is loopback (an embedded run's Ray node is 127.0.0.1), so nothing off the machine can
    reach the store; otherwise it is the node address the receivers were told."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise WeightGroupError(f"the weight sender cannot listen on {host} ({exc}); give it an address of this "
                               "node") from exc
    return listener


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _process_group(store: Any, rank: int, world_size: int, backend: str, host: str, timeout_s: float) -> Any:
    """The group's process group, built on the store alone (no default group). Blocks until every
    rank has built its own (gloo connects the full mesh here; NCCL on its first collective)."""
    prefixed = dist.PrefixStore(GROUP_PREFIX, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":  # untested on this machine: needs a CUDA build of torch and GPUs
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


def _broadcast(group: Any, buffer: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([buffer], options).wait()


def plan_buckets(shapes: list[tuple[str, torch.dtype, list[int]]], bucket_bytes: int) -> list[dict[str, Any]]:
    """Cut ``(name, dtype, shape)`` into flat buckets of one dtype each, in order within a dtype,
    each at most ``bucket_bytes`` unless one tensor alone is larger."""
    by_dtype: dict[torch.dtype, list[tuple[str, list[int]]]] = {}
    for name, dtype, shape in shapes:
        by_dtype.setdefault(dtype, []).append((name, shape))
    buckets: list[dict[str, Any]] = []
    for dtype, tensors in by_dtype.items():
        size = torch.empty((), dtype=dtype).element_size()
        current: dict[str, Any] | None = None
        for name, shape in tensors:
            nbytes = size * _numel(shape)
            if current is None or (current["tensors"] and current["nbytes"] + nbytes > bucket_bytes):
                current = {"dtype": str(dtype).removeprefix("torch."), "nbytes": 0, "tensors": []}
                buckets.append(current)
            current["tensors"].append([name, list(shape), current["nbytes"]])
            current["nbytes"] += nbytes
    return buckets


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightGroupError(f"the sender announced unknown dtype {name!r}; both sides need the same torch")
    return dtype


class WeightSender:
    """Rank 0 of a weight group: ``serve`` opens the store, ``connect`` waits for the receivers,
    ``send`` broadcasts one round."""

    def __init__(self, receivers: int, timeout_s: float = 300.0, bucket_bytes: int = BUCKET_BYTES,
                 host: str | None = None) -> None:
        if receivers < 1:
            raise ValueError(f"a weight group needs at least one receiver, got {receivers}")
        self.host = host or node_address()
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_bytes)
        # The store listens on ``host`` alone (a free port), never on every interface: a store
        # created by host and port binds all of them, so it is handed a socket bound here instead.
        listener = _listen_on(self.host)
        port = listener.getsockname()[1]
        self.store = dist.TCPStore(self.host, port, None, True, timedelta(seconds=self.timeout_s),
                                   wait_for_workers=False, master_listen_fd=listener.detach())
        self.address = WeightGroupAddress(self.host, int(port), receivers + 1, self.timeout_s)
        self.group: Any = None
        self.backend: str | None = None
        self.round = 0

    def connect(self, device: torch.device | str = "cpu") -> None:
        """Wait until every receiver has joined, then build the process group (for ``device``'s
        backend). A receiver missing after the timeout is named in the error."""
        if self.group is not None:
            return
        self.backend = _backend_for(torch.device(device))
        self.store.set("backend", self.backend)
        ranks = range(1, self.address.world_size)
        try:
            self.store.wait([f"joined/{r}" for r in ranks], timedelta(seconds=self.timeout_s))
        except (RuntimeError, TimeoutError) as exc:
            joined = {r: self.store.get(f"joined/{r}").decode() for r in ranks if self.store.check([f"joined/{r}"])}
            missing = [r for r in ranks if r not in joined]
            if missing:
                raise WeightGroupError(
                    f"weight group at {self.host}:{self.address.port}: receiver rank(s) {missing} of "
                    f"{self.address.world_size - 1} did not join within {self.timeout_s:g} s (joined: "
                    f"{joined or 'none'}); check that the rollout engine's workers started and can reach "
                    "this node and port (firewall, the node's address), and that they joined with this address"
                ) from exc
            raise
        self.group = _process_group(self.store, 0, self.address.world_size, self.backend, self.host,
                                    self.timeout_s)

    def send(self, weights: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Broadcast one round (the whole ``weights``, tagged with their policy ``version``) and
        wait until every receiver has it. Returns the round's size and times."""
        started = time.perf_counter()
        device = next((t.device for t in weights.values()), torch.device("cpu"))
        self.connect(device)
        joined_s = time.perf_counter() - started
        if _backend_for(device) != self.backend:
            raise WeightGroupError(f"the group was built for {self.backend}, but these weights are on {device}; "
                                   "send every round from the same device")
        buckets = plan_buckets([(k, v.dtype, list(v.shape)) for k, v in weights.items()], self.bucket_bytes)
        self.round += 1
        key = f"round/{self.round}"
        self.store.set(key, json.dumps({"version": int(version), "buckets": buckets}))
        sent = 0
        for bucket in buckets:
            if bucket["nbytes"] == 0:
                continue
            flat = torch.cat([weights[name].detach().contiguous().reshape(-1).view(torch.uint8)
                              for name, _, _ in bucket["tensors"]])
            _broadcast(self.group, flat)
            sent += bucket["nbytes"]
            del flat
        self._await_done(key)
        self.store.delete_key(key)
        return {"bytes": sent, "buckets": len(buckets), "join_s": joined_s,
                "send_s": time.perf_counter() - started - joined_s}

    def _await_done(self, key: str) -> None:
        """Block (no polling) until every receiver has marked the round done."""
        ranks = range(1, self.address.world_size)
        keys = [f"{key}/done/{r}" for r in ranks]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except (RuntimeError, TimeoutError) as exc:
            missing = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
            raise WeightGroupError(f"weight group at {self.host}:{self.address.port}: receiver rank(s) {missing} "
                                   f"did not finish {key} within {self.timeout_s:g} s") from exc
        for k in keys:
            self.store.delete_key(k)

    def close(self) -> None:
        """Let the group go (a receiver still in a round fails at its timeout)."""
        _shutdown(self.group)
        self.group = None


class WeightRecipient:
    """One receiver rank of a weight group: ``join`` once, then ``receive`` every round."""

    def __init__(self, address: WeightGroupAddress | dict[str, Any], rank: int, who: str = "") -> None:
        address = address if isinstance(address, WeightGroupAddress) else WeightGroupAddress(**address)
        if not 1 <= rank < address.world_size:
            raise ValueError(f"receiver rank {rank} is outside 1..{address.world_size - 1} of this weight group")
        self.address, self.rank = address, int(rank)
        self.who = who or f"pid {os.getpid()} on {socket.gethostname()}"
        self.group: Any = None
        self.backend = ""
        self.round = 0
        self.shapes: dict[str, list[int]] = {}
        """Names and shapes of the last round (known before its first bucket arrives)."""
        try:
            self.store = dist.TCPStore(address.host, address.port, None, False, timedelta(seconds=address.timeout_s))
        except (RuntimeError, TimeoutError) as exc:
            raise WeightGroupError(
                f"receiver rank {rank} could not reach the weight sender's store at {address.host}:{address.port} "
                f"within {address.timeout_s:g} s ({exc}); check that the sender opened the group and that this "
                "node can reach that address and port") from exc

    def join(self) -> None:
        """Announce this rank and build the process group (blocks until the sender builds its own)."""
        if self.group is not None:
            return
        self.store.set(f"joined/{self.rank}", self.who)
        try:
            self.backend = self.store.get("backend").decode()
            host = node_address(self.address.host)
            self.group = _process_group(self.store, self.rank, self.address.world_size, self.backend, host,
                                        self.address.timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise WeightGroupError(
                f"receiver rank {self.rank} ({self.who}) joined the weight group at {self.address.host}:"
                f"{self.address.port}, but the group did not form within {self.address.timeout_s:g} s ({exc}); "
                "the sender or another receiver did not connect: check that every receiver joined and that "
                "the sender was asked to send") from exc

    @property
    def device(self) -> torch.device:
        """Where buckets land: the current CUDA device under NCCL, else the CPU."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def receive(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """The next round: its policy version and an iterator of ``(name, tensor)`` views into one
        bucket at a time. Exhaust the iterator: the sender waits for every receiver's last bucket."""
        self.join()
        self.round += 1
        key = f"round/{self.round}"
        try:
            meta = json.loads(self.store.get(key))
        except (RuntimeError, TimeoutError) as exc:
            raise WeightGroupError(f"receiver rank {self.rank}: round {self.round} did not start within "
                                   f"{self.address.timeout_s:g} s ({exc}); the sender was not asked to send, "
                                   "or it failed") from exc
        self.shapes = {name: list(shape) for bucket in meta["buckets"] for name, shape, _ in bucket["tensors"]}
        return int(meta["version"]), self._tensors(key, meta["buckets"])

    def _tensors(self, key: str, buckets: list[dict[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        device = self.device
        for bucket in buckets:
            dtype = _dtype(bucket["dtype"])
            flat = torch.empty(int(bucket["nbytes"]), dtype=torch.uint8, device=device)
            if bucket["nbytes"]:
                _broadcast(self.group, flat)
            size = torch.empty((), dtype=dtype).element_size()
            for name, shape, offset in bucket["tensors"]:
                nbytes = size * _numel(shape)
                yield name, flat[offset:offset + nbytes].view(dtype).view(shape)
            del flat
        self.store.set(f"{key}/done/{self.rank}", b"1")

    def close(self) -> None:
        _shutdown(self.group)
        self.group = None


def _shutdown(group: Any) -> None:
    """Shut a process group down, if there is one and its backend can."""
    if group is not None and hasattr(group, "shutdown"):
        try:
            group.shutdown()
        except RuntimeError:
            pass
