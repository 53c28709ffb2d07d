"""``sapo``: a soft sigmoid gate on the token ratio instead of a hard clip (SAPO, Gao et al. 2025).

``algorithm.clip`` is not used: the gate's temperatures are this loss's options. The math is
``relax.algo.losses.sapo_loss``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import AlgorithmContext
from relax_plugins.losses.policy_loss import PolicyLoss


class SAPOLoss(PolicyLoss):
    """SAPO over a ``TrainBatch``."""

    class Config(BaseModel):
        """Options of the SAPO loss (the paper's defaults)."""

        model_config = ConfigDict(extra="forbid")

        tau_pos: float = Field(1.0, gt=0.0)
        """Gate temperature for tokens with a positive advantage; larger narrows the trust region."""
        tau_neg: float = Field(1.05, gt=0.0)
        """Gate temperature for tokens with a zero or negative advantage (damped sooner: larger)."""

    def __init__(self, config: SAPOLoss.Config, context: AlgorithmContext) -> None:
        super().__init__(config, context)
        self.tau_pos, self.tau_neg = float(config.tau_pos), float(config.tau_neg)

    def surrogate(self, batch: Any, logprobs: Any, old: Any, weight: Any) -> tuple[Any, dict[str, float]]:
        from relax.algo.losses import sapo_loss

        return sapo_loss(logprobs, old, batch.advantages, batch.response_mask, self.tau_pos, self.tau_neg,
                         weight=weight,
                         aggregation=self.aggregation, norm_tokens=self.norm_tokens)
