"""How weights leave a trainer: ``BucketExtractor``, the ``relax.contracts.WeightExtractor`` of the
built-in trainers.

Why buckets: a weight sync, an export or a forward-only role's update needs every tensor once, but
never all of them at the same moment. A sharded trainer (FSDP2) gathers a parameter's full tensor
only when its bucket fills, so a rank holds at most one bucket of gathered tensors besides its own
shards, and a channel sends (or a receiver loads) one bucket while the next is gathered. A replica
trainer hands out views of its own parameters the same way.

The extractor is also the one place that decides *which* tensors leave and under which names: the
full model in Hugging Face naming (what the rollouts load), or only an adapter's tensors
(``adapter_only``: LoRA) through the ``include`` and ``rename`` the trainer gives.

Imported inside the backends (it needs torch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

#: Default most bytes of one bucket (the weight group's broadcast bucket size).
BUCKET_BYTES = 256 * 1024 * 1024


def gathered(tensor: Any) -> torch.Tensor:
    """A tensor as the whole of it: a ``DTensor`` (an FSDP2 shard) gathered over its mesh (a
    collective: every rank of the mesh must ask for the same tensor in the same order), any other
    tensor detached as it is."""
    full = getattr(tensor, "full_tensor", None)
    if full is not None:
        return full().detach()
    return tensor.detach()


class BucketExtractor:
    """``(name, tensor)`` buckets of at most ``bucket_bytes`` (a larger tensor travels alone), in the
    order ``tensors`` gives them.

    ``tensors`` returns the ``(name, tensor)`` pairs afresh on each call (a model's ``state_dict``:
    Hugging Face names, a tied ``lm_head.weight`` included); a pair's tensor may be a ``DTensor``,
    gathered when its bucket is filled. ``include`` keeps only the names it accepts (an adapter's)
    and ``rename`` maps a kept name to the rollout's. Every rank of a sharded model must iterate
    ``buckets`` to the end together (the gathers are collectives)."""

    def __init__(self, tensors: Callable[[], Iterable[tuple[str, Any]]], *, bucket_bytes: int = BUCKET_BYTES,
                 adapter_only: bool = False, include: Callable[[str], bool] | None = None,
                 rename: Callable[[str], str] | None = None) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be at least 1, got {bucket_bytes}")
        self._tensors = tensors
        self.bucket_bytes = int(bucket_bytes)
        self.adapter_only = adapter_only
        self._include = include
        self._rename = rename or (lambda name: name)

    def _selected(self) -> Iterator[tuple[str, Any]]:
        seen: set[str] = set()
        for name, tensor in self._tensors():
            if self._include is not None and not self._include(name):
                continue
            out = self._rename(name)
            if out in seen:
                raise ValueError(f"two weights are both named '{out}' in the rollout's naming (the second from "
                                 f"'{name}'); the trainer's rename must map names one to one")
            seen.add(out)
            yield out, tensor

    def shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (dtype name, shape) of every tensor, from the (global) shapes: nothing is gathered."""
        return {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in self._selected()}

    def total_bytes(self) -> int:
        """Bytes the buckets hold together (what one weight sync moves)."""
        return sum(_nbytes(t) for _, t in self._selected())

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The tensors, gathered and detached, bucket by bucket. A replica's tensors are views of
        its parameters: copy what must outlive the next optimizer step."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in self._selected():
            nbytes = _nbytes(tensor)
            if bucket and size + nbytes > self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, gathered(tensor)))
            size += nbytes
        if bucket:
            yield bucket

    def state_dict(self, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """All the tensors as one dict of clones (on ``device`` when given): for a caller that needs
        a snapshot which later optimizer steps do not change. It holds the whole model (or adapter),
        so a sharded trainer asks for it only where a full copy is wanted."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.buckets():
            for name, tensor in bucket:
                out[name] = tensor.to(device, copy=True) if device is not None else tensor.clone()
        return out


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())
