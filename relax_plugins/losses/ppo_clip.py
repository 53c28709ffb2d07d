"""``ppo_clip``: the PPO clipped surrogate with DAPO's asymmetric clip and truncated IS.

The clip range comes from ``spec.algorithm.clip`` and the off-policy correction from
``spec.async_policy``; the math is ``relax.algo.losses.ppo_clip_loss``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict


class PPOClipLoss:
    """Token-mean PPO-clip loss over a ``relax.algo.batch.TrainBatch``.

    The old policy of the ratio is ``batch.old_logprobs`` when the batch carries recomputed ones,
    else the behaviour log-probs ``batch.rollout_logprobs`` (with ``correction: none`` or ``tis``
    and no recompute, the behaviour policy *is* the old policy). With ``correction: tis`` each
    token's loss is weighted by ``min(exp(old - behaviour), tis_cap)``, detached: a weight of 1
    unless old log-probs were recomputed. ``correction: decoupled`` is not implemented yet.
    """

    #: How the loss aggregates, so a trainer splitting a batch into micro-batches can weight each
    #: part's loss by its share of response tokens and reproduce the full batch's loss exactly.
    aggregation: ClassVar[Literal["token_mean"]] = "token_mean"

    class Config(BaseModel):
        """PPO-clip takes its clip range from ``algorithm.clip`` and has no options of its own."""

        model_config = ConfigDict(extra="forbid")

    def __init__(self, config: PPOClipLoss.Config, spec: Any) -> None:
        self.config = config
        self.clip_low = float(spec.algorithm.clip.low)
        self.clip_high = float(spec.algorithm.clip.high)
        self.correction = spec.async_policy.correction
        if self.correction == "decoupled":
            raise NotImplementedError(
                "ppo_clip does not implement async_policy.correction 'decoupled' yet (proximal "
                "log-probs from roles.actor_fwd); use correction 'tis' or 'none'"
            )
        self.tis_cap = float(spec.async_policy.tis_cap) if self.correction == "tis" else None

    def compute(self, batch: Any, logprobs: Any) -> tuple[Any, dict[str, float]]:
        """``(loss, metrics)`` for token log-probs ``logprobs[B, T]`` of the policy being trained."""
        from relax.algo.losses import ppo_clip_loss

        old = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
        return ppo_clip_loss(
            logprobs,
            old,
            batch.advantages,
            batch.response_mask,
            self.clip_low,
            self.clip_high,
            behaviour_logprobs=batch.rollout_logprobs,
            tis_cap=self.tis_cap,
        )
