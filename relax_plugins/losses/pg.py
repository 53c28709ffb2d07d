"""``pg``: the vanilla policy gradient ``-A * log pi`` (REINFORCE), with no importance ratio.

Without a ratio the gradient is right only for samples of the policy being trained, so the loss
declares ``tolerated_staleness = 0`` and honours only ``correction: none``: ``relax validate``
rejects a spec that would feed it stale samples. The math is ``relax.algo.losses.pg_loss``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from relax_plugins.losses.policy_loss import PolicyLoss


class PolicyGradientLoss(PolicyLoss):
    """REINFORCE over a ``TrainBatch``: strictly on-policy."""

    tolerated_staleness: ClassVar[int | None] = 0
    corrections: ClassVar[frozenset[str]] = frozenset({"none"})

    def surrogate(self, batch: Any, logprobs: Any, old: Any, weight: Any) -> tuple[Any, dict[str, float]]:
        from relax.algo.losses import pg_loss

        return pg_loss(logprobs, batch.advantages, batch.response_mask, aggregation=self.aggregation,
                       norm_tokens=self.norm_tokens)
