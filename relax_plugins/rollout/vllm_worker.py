"""The part of the ``vllm`` rollout that runs inside vLLM's worker processes.

vLLM mixes ``WeightReceiver`` into its worker class (engine argument ``worker_extension_cls``), so
the rollout can call ``collective_rpc("relax_load_weights", args=(packed,))`` with plain
``(name, dtype, shape, bytes)`` records. Those cross vLLM's msgpack channel to the engine core and
its pickle channel to the workers as they are; torch tensors would not (vLLM's encoder turns a
tensor argument into a buffer index that its utility-call decoder hands on as a bare list), and
pushing a closure over the tensors instead needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which lets
the engine unpickle anything sent to it. Here only bytes of known dtypes are accepted.

A second path, for ``roles.rollout.weight_sync: collective``: each worker joins the rollout's weight
group (``relax.weight_group``, rank 1 + its own rank) and takes the rounds the trainer's
rank 0 broadcasts (NCCL on GPUs, gloo on CPU); only the group's address and small results cross
``collective_rpc``, never weight bytes.

Imported by vLLM's worker processes only (it needs torch).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

#: A packed tensor: state-dict name, torch dtype name (``float32``), shape, raw little-endian bytes.
PackedTensor = tuple[str, str, list[int], bytes]


def pack(weights: dict[str, torch.Tensor]) -> list[PackedTensor]:
    """``weights`` as plain records for ``WeightReceiver.relax_load_weights`` (one copy on the CPU)."""
    packed = []
    for name, tensor in weights.items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        packed.append((name, str(flat.dtype).removeprefix("torch."), list(tensor.shape),
                       flat.view(torch.uint8).numpy().tobytes()))
    return packed


def unpack(record: Any) -> tuple[str, torch.Tensor]:
    """One ``(name, tensor)`` from a packed record (it arrives as a list after msgpack)."""
    name, dtype_name, shape, data = record
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight {name!r} has unknown dtype {dtype_name!r}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return str(name), raw.view(dtype).reshape([int(s) for s in shape])


class WeightReceiver:
    """Methods vLLM adds to each of its workers (``worker_extension_cls``)."""

    def relax_load_weights(self, packed: list[Any]) -> int:
        """Load a full Hugging Face ``state_dict`` in place through the worker's own
        ``reload_weights`` (which re-runs vLLM's per-layer weight loaders and, on the CPU backend,
        refreshes the prepacked GEMM copies). Returns the number of tensors loaded."""
        weights = [unpack(record) for record in packed]
        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        return len(weights)

    def relax_join_weight_group(self, address: dict[str, Any], shapes: dict[str, list[int]], tied: bool) -> int:
        """Join the weight group at ``address`` as rank 1 + this worker's rank (the group forms on
        the first round). ``shapes`` are the checkpoint's tensors each round must match exactly;
        ``tied``: a round without ``lm_head.weight`` loads the input embedding there too. Returns
        the rank taken."""
        from relax.weight_group import WeightRecipient

        previous = getattr(self, "_relax_recipient", None)
        if previous is not None:
            previous.close()
        rank = 1 + int(self.rank)  # type: ignore[attr-defined]
        who = f"vllm worker rank {rank - 1} pid {os.getpid()}"
        self._relax_recipient = WeightRecipient(address, rank, who=who)
        self._relax_shapes = {str(k): [int(d) for d in v] for k, v in shapes.items()}
        self._relax_tied = bool(tied)
        return rank

    def relax_receive_weights(self) -> list[int]:
        """Receive one round of the joined group and load it bucket by bucket through
        ``reload_weights``. A round whose names or shapes differ from the checkpoint's is taken off
        the wire (so the sender's round completes) and refused before any of it is loaded.
        Returns ``[policy version, tensors loaded]``."""
        from relax_plugins.hf_weights import shape_mismatch

        recipient = getattr(self, "_relax_recipient", None)
        if recipient is None:
            raise RuntimeError("relax_receive_weights before relax_join_weight_group")
        version, tensors = recipient.receive()
        shapes = dict(recipient.shapes)
        tie = self._relax_tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes
        if tie:
            shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
        problem = shape_mismatch(shapes, self._relax_shapes)
        if problem:
            for _ in tensors:  # drain: the other ranks and the sender finish the round
                pass
            raise ValueError(problem)
        loaded = [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                loaded[0] += 1
                yield name, tensor
                if tie and name == "model.embed_tokens.weight":  # the CPU backend's prepacked lm_head too
                    loaded[0] += 1
                    yield "lm_head.weight", tensor

        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return [int(version), loaded[0]]

