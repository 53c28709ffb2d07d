"""``ppo_clip``: the PPO clipped surrogate with DAPO's asymmetric clip, a dual clip and TIS.

The clip range comes from the ``AlgorithmContext`` (``algorithm.clip``: ``low``, ``high`` and the
dual clip ``c``), the off-policy correction too (``async_policy``) (see ``policy_loss``); the math is
``relax.algo.losses.ppo_clip_loss``.
"""

from __future__ import annotations

from typing import Any

from relax.contracts import AlgorithmContext
from relax_plugins.losses.policy_loss import PolicyLoss


class PPOClipLoss(PolicyLoss):
    """PPO-clip over a ``relax.algo.batch.TrainBatch``, aggregated per ``algorithm.loss_aggregation``."""

    def __init__(self, config: PolicyLoss.Config, context: AlgorithmContext) -> None:
        super().__init__(config, context)
        self.clip_low, self.clip_high = float(context.clip_low), float(context.clip_high)
        self.clip_c = None if context.clip_c is None else float(context.clip_c)

    def surrogate(self, batch: Any, logprobs: Any, old: Any, weight: Any) -> tuple[Any, dict[str, float]]:
        from relax.algo.losses import ppo_clip_loss

        return ppo_clip_loss(logprobs, old, batch.advantages, batch.response_mask, self.clip_low,
                             self.clip_high, weight=weight, clip_c=self.clip_c, aggregation=self.aggregation,
                             norm_tokens=self.norm_tokens)
