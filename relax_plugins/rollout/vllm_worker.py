"""The part of the ``vllm`` rollout that runs inside vLLM's worker processes.

vLLM mixes ``WeightReceiver`` into its worker class (engine argument ``worker_extension_cls``), so
the rollout can call ``collective_rpc("relax_load_weights", args=(packed,))`` with plain
``(name, dtype, shape, bytes)`` records. Those cross vLLM's msgpack channel to the engine core and
its pickle channel to the workers as they are; torch tensors would not (vLLM's encoder turns a
tensor argument into a buffer index that its utility-call decoder hands on as a bare list), and
pushing a closure over the tensors instead needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which lets
the engine unpickle anything sent to it. Here only bytes of known dtypes are accepted.

Imported by vLLM's worker processes only (it needs torch).
"""

from __future__ import annotations

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
