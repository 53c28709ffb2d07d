"""RMSNorm modules for Megatron layer specs that work under sequence parallelism.

megatron-core 0.16.1's local (non-Transformer-Engine) norm, ``WrappedTorchNorm``, asserts
``not config.sequence_parallel``, and Megatron trains MoE layers under tensor parallelism only with
sequence parallelism (``MoELayer.forward`` raises otherwise). These compute the same
``torch.nn.functional.rms_norm`` as that norm's ``torch.nn.RMSNorm``, with the same parameter name
(``weight``), so checkpoints map alike. Under sequence parallelism each tensor-parallel rank
normalises only its part of the sequence, so the weight's gradient is partial there: the
sequence-norm marks it ``sequence_parallel`` (as Megatron marks its own norms and the router),
and the trainer sums such gradients over the tensor-parallel group.

Imported only when a model is built (it imports torch at the top).
"""

from __future__ import annotations

from typing import Any

import torch


class RMSNorm(torch.nn.Module):
    """``torch.nn.RMSNorm`` as a Megatron spec builds it (``config, hidden_size, eps``), for the
    q/k norms, which see the whole sequence (after the QKV projection gathers it)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(hidden, (hidden.shape[-1],), self.weight, self.eps)


class SequenceRMSNorm(RMSNorm):
    """The layer and final norms, which see this rank's part of the sequence under sequence
    parallelism: the weight is marked ``sequence_parallel`` then."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(config, hidden_size, eps, **kwargs)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
