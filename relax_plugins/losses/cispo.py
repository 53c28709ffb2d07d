"""``cispo``: a clipped, stop-gradient importance weight times the token log-prob (MiniMax-M1).

The weight's upper bound is ``1 + algorithm.clip.high``; MiniMax-M1 sets no lower bound, which is
the default here (``truncate_low`` adds ``1 - algorithm.clip.low``). The math is
``relax.algo.losses.cispo_loss``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from relax.contracts import AlgorithmContext
from relax_plugins.losses.policy_loss import PolicyLoss


class CISPOLoss(PolicyLoss):
    """CISPO over a ``TrainBatch``: no token's gradient is dropped, only its weight is bounded."""

    class Config(BaseModel):
        """Options of the CISPO loss."""

        model_config = ConfigDict(extra="forbid")

        truncate_low: bool = False
        """Also bound the weight below at ``1 - algorithm.clip.low`` (MiniMax-M1 bounds it above only)."""

    def __init__(self, config: CISPOLoss.Config, context: AlgorithmContext) -> None:
        super().__init__(config, context)
        self.clip_low = float(context.clip_low) if config.truncate_low else None
        self.clip_high = float(context.clip_high)

    def surrogate(self, batch: Any, logprobs: Any, old: Any, weight: Any) -> tuple[Any, dict[str, float]]:
        from relax.algo.losses import cispo_loss

        return cispo_loss(logprobs, old, batch.advantages, batch.response_mask, self.clip_low,
                          self.clip_high, weight=weight,
                          aggregation=self.aggregation, norm_tokens=self.norm_tokens)
