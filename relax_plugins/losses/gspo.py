"""``gspo``: PPO-clip on the length-normalised sequence ratio (GSPO, in its token form).

The clip range comes from the ``AlgorithmContext`` (``algorithm.clip``) (the ``gspo`` algorithm name defaults it to
GSPO's ``low: 3e-4, high: 4e-4``); the math is ``relax.algo.losses.gspo_loss``.
"""

from __future__ import annotations

from typing import Any

from relax.contracts import AlgorithmContext
from relax_plugins.losses.policy_loss import PolicyLoss


class GSPOLoss(PolicyLoss):
    """GSPO over a ``TrainBatch``; ``seq-mean-token-mean`` aggregation makes it the paper's loss."""

    def __init__(self, config: PolicyLoss.Config, context: AlgorithmContext) -> None:
        super().__init__(config, context)
        self.clip_low, self.clip_high = float(context.clip_low), float(context.clip_high)

    def surrogate(self, batch: Any, logprobs: Any, old: Any, weight: Any) -> tuple[Any, dict[str, float]]:
        from relax.algo.losses import gspo_loss

        return gspo_loss(logprobs, old, batch.advantages, batch.response_mask, self.clip_low,
                         self.clip_high, weight=weight,
                         aggregation=self.aggregation, norm_tokens=self.norm_tokens)
